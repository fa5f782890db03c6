"""A run owns its ``checkpoint.dir`` (round 2, item 1): a second run on the same
directory, or a restarted job whose old copy still runs, is refused (exit 2, naming the
directory and the holder's pid) instead of deleting the first run's checkpoints. The
lock dies with its process, even killed with SIGKILL."""

from __future__ import annotations

import signal
import time

import pytest

from csrun.core.runner.checkpoint import CheckpointManager
from csrun.core.runner.preflight import load_config
from csrun.core.runner.session import Outputs, Session
from csrun.core.config.problems import ConfigError

LONG = ["train.steps=100000", "checkpoint.dir=ck", "checkpoint.every_steps=10"]


def _wait_for_checkpoint(folder, process, seconds=120):
    deadline = time.monotonic() + seconds
    while not list(folder.glob("ckpt-*.json")):
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "no checkpoint in time"
        time.sleep(0.1)


@pytest.mark.process
@pytest.mark.timeout(300)
def test_a_second_run_on_a_busy_checkpoint_dir_is_refused(spawn, csrun, tiny, tmp_path):
    first = spawn("train", tiny, *LONG)
    folder = tmp_path / "ck"
    _wait_for_checkpoint(folder, first)
    for extra in ([], ["--resume"]):  # a fresh run, and a scheduler's restart
        second = csrun("train", tiny, *LONG, *extra, timeout=120)
        assert second.returncode == 2, second.stderr
        assert f"checkpoint.dir: 'ck' is in use by another run (pid {first.pid})" in \
            second.stderr and "another checkpoint.dir" in second.stderr
        assert "Traceback" not in second.stderr
    assert list(folder.glob("ckpt-*.json")), "the first run's checkpoints were deleted"
    first.send_signal(signal.SIGKILL)
    first.wait()
    # the lock died with the process: resuming now works
    third = csrun("train", tiny, *LONG[1:], "train.steps=5", "--resume", timeout=120)
    assert third.returncode in (0, 1), third.stderr  # 1: already past step 5 is fine too
    assert "in use by another run" not in third.stderr


def test_the_lock_is_released_when_a_run_ends(tiny, tmp_path, monkeypatch):
    """In one process (a library user, tests): the second session gets the directory
    once the first is closed, not before."""
    monkeypatch.chdir(tmp_path)
    config = load_config(tiny, ["checkpoint.dir=ck"])
    first = Session(config, Outputs(), lambda event: None)
    with pytest.raises(ConfigError) as info:
        Session(config, Outputs(), lambda event: None)
    assert info.value.problems[0].path == "checkpoint.dir"
    first.close()
    Session(config, Outputs(), lambda event: None).close()
    CheckpointManager("ck", 1, {}).claim()  # and with every session closed, anyone can
