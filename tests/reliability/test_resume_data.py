"""``--resume`` and the data (round 2, item 4): the run's identity holds the data file's
SHA-256, not its path, so a changed file is refused and a moved one resumes."""

from __future__ import annotations

import numpy as np
from typer.testing import CliRunner

from csrun.cli.main import app
from tests.helpers.tiny_config import TINY

CONFIG = TINY.replace("source: {kind: synthetic, examples: 96, features: 6, classes: 3}",
                      "source: {kind: file, path: data.npz}")


def _data(path, seed):
    rng = np.random.default_rng(seed)
    np.savez(path, x=rng.normal(size=(96, 6)).astype(np.float32),
             y=rng.integers(0, 3, size=96))


def _train(*args):
    return CliRunner().invoke(app, ["train", *map(str, args)], catch_exceptions=False)


def test_resume_refuses_a_data_file_that_changed(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(CONFIG)
    _data(tmp_path / "data.npz", seed=0)
    common = ["run.yaml", "checkpoint.dir=ck", "checkpoint.every_steps=5"]
    assert _train(*common, "train.steps=10").exit_code == 0
    _data(tmp_path / "data.npz", seed=1)  # same name, shape and kind; other examples
    done = _train(*common, "train.steps=20", "--resume")
    assert done.exit_code == 1
    assert "is from a different run (dataset.source.path.sha256: checkpoint" in done.stderr


def test_resume_follows_a_data_file_that_moved(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text(CONFIG)
    _data(tmp_path / "data.npz", seed=0)
    common = ["run.yaml", "checkpoint.dir=ck", "checkpoint.every_steps=5"]
    assert _train(*common, "train.steps=10").exit_code == 0
    (tmp_path / "data.npz").rename(tmp_path / "moved.npz")
    done = _train(*common, "train.steps=20", "--resume", "dataset.source.path=moved.npz")
    assert done.exit_code == 0, done.stderr
    assert "resumed from step 10" in done.stdout
