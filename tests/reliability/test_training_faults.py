"""Training faults: a NaN or infinite loss stops the run naming the step and the replica,
with the last good checkpoint intact (resuming from it ends as a clean run ends); an
exception in one replica surfaces with the replica's id and device and never hangs the
others, which wait for it in a synchronized BatchNorm.
"""

from __future__ import annotations

import gc
import json
import threading
import time

import pytest
from typer.testing import CliRunner

from csrun.cli.main import app
from csrun.core.runner.checkpoint import CheckpointManager
from csrun.core.runner.preflight import load_config
from csrun.core.runner.checkpointing import run_identity
from tests.helpers import injected_faults

CONFIG = """\
strategy: {compute_devices: [CPU:0, CPU:1, CPU:2], parameter_device: CPU:0}
dataset:
  source: {kind: synthetic, examples: 96, features: 6, classes: 3}
  steps:
    - {op: shuffle, buffer: 128}
    - {op: batch, size: 24}
model:
  kind: import
  target: "tests.helpers.injected_faults:FaultyMLP"
  kwargs: {features: 6, classes: 3, batch_norm: true}
optimizer: {name: SGD, lr: 0.1}
train: {steps: 12, log_every: 4}
checkpoint: {dir: ck, every_steps: 3, keep: 2}
"""


def _train(tmp_path, *args):
    done = CliRunner().invoke(app, ["train", str(tmp_path / "c.yaml"), *args, "--json",
                                    str(tmp_path / "r.json")], catch_exceptions=False)
    return done, json.loads((tmp_path / "r.json").read_text())


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    (tmp_path / "c.yaml").write_text(CONFIG)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(injected_faults, "FAULT", None)
    return tmp_path


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["nan", "inf"])
def test_a_non_finite_loss_names_step_and_replica_and_the_checkpoint_survives(mode, run_dir):
    clean, clean_result = _train(run_dir, "checkpoint.dir=clean")
    assert clean.exit_code == 0, clean.stderr

    injected_faults.FAULT = f"{mode}:8:1"  # step 8, replica 1 (CPU:1)
    failed, result = _train(run_dir)
    assert failed.exit_code == 1 and result["status"] == "failed"
    value = "nan" if mode == "nan" else "inf"
    assert f"the loss is {value} at step 8 on replica 1 (CPU:1)" in result["error"]
    assert "stopped before the update" in result["error"]
    # checkpoint.dir written in the config starts at the config's folder (run_dir)
    assert f"the last checkpoint (step 6, {run_dir / 'ck' / 'ckpt-00000006.pt'}) is intact" \
        in result["error"], result["error"]
    assert "Traceback" not in failed.stderr and "step 8 on replica 1" in failed.stderr

    # intact: it verifies (size, SHA-256) and loads, and resuming from it ends exactly
    # where the clean run ended
    config = load_config(run_dir / "c.yaml")
    latest = CheckpointManager("ck", 2, run_identity(config, 3)).load_latest()
    assert latest is not None and latest[1]["step"] == 6
    injected_faults.FAULT = None
    resumed, result = _train(run_dir, "--resume")
    assert resumed.exit_code == 0, resumed.stderr
    assert result["checkpoint"]["resumed_from_step"] == 6
    assert result["params_sha256"] == clean_result["params_sha256"]
    assert result["losses"] == clean_result["losses"]


# A hang is what this test looks for, and a hung replica can hold the main thread where
# a signal cannot free it: the thread method ends the whole session instead of waiting
@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("execution", ["ordered", "concurrent"])
def test_an_exception_in_one_replica_names_it_and_nothing_hangs(execution, run_dir):
    injected_faults.FAULT = "raise:5:2"  # replica 2 raises; 0 and 1 wait in BatchNorm
    threads = threading.active_count()
    failed, result = _train(run_dir, f"strategy.execution={execution}")
    assert failed.exit_code == 1 and result["status"] == "failed"
    error = result["error"]
    assert "RuntimeError: injected fault at step 5" in error
    assert error.startswith("step 5, replica 2 (CPU:2): model.target: "), error
    assert "injected fault" in failed.stderr and "replica 2" in failed.stderr
    assert "Traceback" not in failed.stderr
    del failed  # its exception chain holds the run's frames, and so the strategy
    latest = sorted((run_dir / "ck").glob("ckpt-*.json"))
    assert [p.name for p in latest] == ["ckpt-00000003.json"]  # the last good one
    # the replicas' worker threads were released, not left blocked in the BatchNorm
    # all-reduce: once the failed run is collected, they end (a blocked one never would)
    deadline = time.monotonic() + 10
    while threading.active_count() > threads and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert threading.active_count() <= threads


@pytest.mark.process
@pytest.mark.timeout(180)
def test_a_failing_replica_ends_the_process(run_dir, csrun):
    """A real process: exit 1 within the timeout (a thread stuck in a collective would
    keep the interpreter from exiting)."""
    done = csrun("train", "c.yaml", "strategy.execution=concurrent", "--json", "r.json",
                 env={"CSRUN_TEST_FAULT": "raise:3:1"}, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "replica 1 (CPU:1): model.target: " in done.stderr
    assert json.loads((run_dir / "r.json").read_text())["status"] == "failed"
