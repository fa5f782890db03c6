"""Divergence without NaN (round 2, item 5): Adam at lr=1e9 on the digits took the loss
from 2.3 to 5e8 at chance accuracy (11% held out) and the run reported success. The rule (core/runner/divergence.py,
docs/reliability.md) fails it with exit 1; ``train.divergence: null`` turns it off."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from csrun.cli.main import app
from csrun.core.runner.divergence import diverged

RUNAWAY = ["dataset.source={kind: digits}", "optimizer.name=Adam", "optimizer.lr=1e9", "train.steps=30", "train.log_every=5"]


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_a_loss_that_runs_away_fails_the_run(tiny, tmp_path):
    done = _invoke("train", tiny, *RUNAWAY, "--json", tmp_path / "r.json")
    assert done.exit_code == 1, done.output
    assert "error: the loss diverged:" in done.stderr and "lower optimizer.lr" in done.stderr
    assert "for 3 logs in a row" in done.stderr
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "failed"


def test_the_check_can_be_turned_off(tiny):
    assert _invoke("train", tiny, *RUNAWAY, "train.divergence=null").exit_code == 0


def test_the_rule():
    start = [2.0] * 5
    assert diverged(start + [1e6] * 5, 5, 1000, last=False) is None  # one window only
    assert diverged(start + [1e6] * 15, 5, 1000, last=False)  # three in a row
    assert diverged(start + [1e6] * 5 + [1.0] * 5 + [1e6] * 5, 5, 1000, last=False) is None
    assert diverged(start + [1e6] * 5, 5, 1000, last=True)  # the run ends on it
    assert diverged(start + [1e3] * 15, 5, 1000, last=True) is None  # 500x: not enough
    assert diverged(start + [1e6] * 15, 5, None, last=True) is None  # turned off
    assert diverged([0.0] + [1e6] * 15, 5, 1000, last=True) is None  # a start of zero
