"""Crashes: ``kill -9`` mid-run then ``--resume`` ends with the ``params_sha256`` of an
uninterrupted run (real processes); a crash between writing and renaming a checkpoint
never corrupts the previous one."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from csrun.cli.main import app
from csrun.core.runner.dir_lock import LOCK_NAME
from csrun.core.runner.checkpoint import CheckpointManager
from tests.helpers import crash_driver
from tests.helpers.cli import child_env, csrun_command
from tests.helpers.tiny_config import TINY

pytestmark = pytest.mark.process  # killed csrun processes

LONG = ["train.steps=240", "checkpoint.dir=ck", "checkpoint.every_steps=20",
        "checkpoint.keep=3"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The JSON result of the run the crashed ones must end like (a real process too)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    (folder / "tiny.yaml").write_text(TINY)
    done = subprocess.run(csrun_command() + ["train", "tiny.yaml", *LONG, "--json", "r.json"],
                          cwd=folder, env=child_env(), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads((folder / "r.json").read_text())


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def _kill_after(process, metrics: Path, steps: int, timeout: float = 120) -> None:
    """SIGKILL ``process`` once ``metrics`` has ``steps`` more lines than now."""
    target = _lines(metrics) + steps
    deadline = time.monotonic() + timeout
    while _lines(metrics) < target:
        assert process.poll() is None, f"it ended before the kill: {process.communicate()}"
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGKILL


@pytest.mark.timeout(600)
def test_kill_9_twice_then_resume_ends_like_an_uninterrupted_run(spawn, csrun, tiny,
                                                                 tmp_path, uninterrupted):
    metrics = tmp_path / "m.jsonl"
    _kill_after(spawn("train", tiny, *LONG, "--metrics", metrics), metrics, 50)
    first = CheckpointManager(tmp_path / "ck", 3, {}).manifests()
    assert first, "no checkpoint before the kill"
    _kill_after(spawn("train", tiny, *LONG, "--resume", "--metrics", metrics), metrics, 70)
    second = CheckpointManager(tmp_path / "ck", 3, {}).manifests()
    assert second[-1].name > first[-1].name  # the resumed run got further, then died too
    done = csrun("train", tiny, *LONG, "--resume", "--json", "r.json")
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    print(f"\nkill -9 twice (checkpoints then: {first[-1].stem}, {second[-1].stem}); "
          f"resumed from step {result['checkpoint']['resumed_from_step']}; params_sha256 "
          f"{result['params_sha256'][:16]}... uninterrupted "
          f"{uninterrupted['params_sha256'][:16]}...")
    assert 0 < result["checkpoint"]["resumed_from_step"] < 240
    assert result["params_sha256"] == uninterrupted["params_sha256"]
    assert result["losses"] == uninterrupted["losses"]
    assert result["metrics"] == uninterrupted["metrics"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("point", ["write", "rename", "manifest"])
def test_a_crash_while_saving_leaves_the_previous_checkpoint_intact(point, csrun, tiny,
                                                                   tmp_path, uninterrupted,
                                                                   monkeypatch):
    driver = [sys.executable, crash_driver.__file__, point, "100"]
    crashed = csrun("train", tiny, *LONG, command=driver)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    folder = tmp_path / "ck"
    left = {p.name for p in folder.iterdir()} - {LOCK_NAME} - {
        f"ckpt-{step:08d}.{kind}" for step in (40, 60, 80) for kind in ("pt", "json")}
    if point == "manifest":  # the payload in place, the manifest still a temp file
        assert "ckpt-00000100.pt" in left and "ckpt-00000100.json" not in left
    else:
        assert [n[:18] for n in left] == [".ckpt-00000100.pt."]
    payload, manifest = CheckpointManager(folder, 3, _identity_of(tiny)).load_latest()
    assert manifest["step"] == payload["step"] == 80  # the previous one, verified

    monkeypatch.chdir(tmp_path)  # the resume need not be a process of its own
    done = CliRunner().invoke(app, ["train", str(tiny), *LONG, "--resume", "--json",
                                    "r.json"], catch_exceptions=False)
    assert done.exit_code == 0, done.stderr
    assert f"removed {len(left)} incomplete checkpoint file(s)" in done.stdout
    assert "resumed from step 80" in done.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["params_sha256"] == uninterrupted["params_sha256"]
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def _identity_of(config_path: Path) -> dict:
    from csrun.core.runner.preflight import load_config
    from csrun.core.runner.checkpointing import run_identity
    config = load_config(config_path, LONG)
    return run_identity(config, len(config.strategy.compute_devices))
