"""Faults of a user's data while a run loads it: a collate function that returns no
batch mid-run, a DataLoader worker that crashes. Each is a failure (exit 1) naming the
config key of the code that failed, never csrun's unexpected-error path.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from csrun.cli.main import app
from tests.helpers import faulty_data

CONFIG = """\
strategy: {compute_devices: [CPU:0, CPU:1]}
dataset:
  source: {kind: import, target: "tests.helpers.faulty_data:Blobs", kwargs: {size: 64}}
  collate: "tests.helpers.faulty_data:late_string"
  steps: [{op: batch, size: 8}]
model: {kind: import, target: "tests.helpers.faulty_data:Net", loss: cross_entropy}
optimizer: {name: SGD, lr: 0.1}
train: {steps: 6}
"""


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    faulty_data.reset()
    (tmp_path / "c.yaml").write_text(CONFIG)
    return tmp_path / "c.yaml"


def failed(done, json_path) -> str:
    assert done.exit_code == 1, done.output
    assert "CSRUN_TRACEBACK" not in done.stderr and "Traceback" not in done.stderr
    assert json.loads(json_path.read_text())["status"] == "failed"
    return done.stderr


def test_a_collate_that_returns_a_string_mid_run_names_dataset_collate(config):
    done = CliRunner().invoke(app, ["train", str(config), "--json", "r.json"],
                              catch_exceptions=False)
    err = " ".join(failed(done, config.parent / "r.json").split())
    assert "error: dataset.collate: tests.helpers.faulty_data:late_string on 8 examples " \
           "returned no batch: the batch holds a str ('not a batch'), not a tensor" in err


@pytest.mark.process
@pytest.mark.timeout(300)
def test_the_same_in_a_dataloader_worker(config, csrun):
    done = csrun("train", config, "dataset.workers=1", "--json", "r.json", timeout=240)
    assert done.returncode == 1, done.stderr
    assert "error: dataset.collate: tests.helpers.faulty_data:late_string on 8 examples " \
           "returned no batch" in " ".join(done.stderr.split())
    assert "(in DataLoader worker process 0)" in done.stderr
    assert "CSRUN_TRACEBACK" not in done.stderr


@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_crashed_dataloader_worker_names_the_dataset(config, csrun):
    done = csrun("train", config, "dataset.collate=null", "dataset.workers=1",
                 "dataset.source.kwargs.crash_at=30", "--json", "r.json", timeout=240)
    assert done.returncode == 1, done.stderr
    err = " ".join(done.stderr.split())
    assert "error: a DataLoader worker (pid" in err and "while loading " \
           "dataset.source.target Blobs (tests.helpers.faulty_data:Blobs)" in err, err
    assert "dataset.workers: 0" in err and "CSRUN_TRACEBACK" not in err
    result = json.loads((config.parent / "r.json").read_text())
    assert result["status"] == "failed" and "DataLoader worker" in result["error"]
