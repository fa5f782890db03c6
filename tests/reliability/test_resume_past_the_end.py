"""Resuming from a checkpoint past ``train.steps`` (round 2, item 11) reported
"300/200 completed"; now a note says nothing is left to train and the run ends at the
checkpoint's step."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from csrun.cli.main import app


def _train(*args):
    return CliRunner().invoke(app, ["train", *map(str, args)], catch_exceptions=False)


def test_resume_past_the_configured_steps_reports_the_checkpoint_step(tiny, tmp_path,
                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _train(tiny, "checkpoint.dir=ck", "train.steps=12").exit_code == 0
    done = _train(tiny, "checkpoint.dir=ck", "train.steps=8", "--resume",
                  "--json", "r.json")
    assert done.exit_code == 0, done.stderr
    assert "12/8" not in done.stdout and "steps          12/12" in done.stdout
    assert "is past the 8 steps configured: nothing to train" in done.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert (result["steps"], result["total_steps"]) == (12, 12)
