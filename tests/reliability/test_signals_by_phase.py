"""A stop (Ctrl-C, SIGTERM) at each phase of a run is heard, and the process ends with
the outcome it has:

* during the final held-out evaluation: the run is interrupted there (its checkpoint of
  the last step is saved already), exit 143 (it used to go on, and exit 0), at once, in
  the middle of a batch (a slow batch used to run to its end: 9 s past the SIGTERM);
* a second SIGTERM aborts with 143 and says "second SIGTERM" (it said "second Ctrl-C",
  exit 130);
* once the outcome is decided, a user's thread that is no daemon does not keep the
  process alive, and a signal during the exit does not change the outcome (SIGTERM
  reported "no training step ran");
* a standard output whose reader stopped reading does not keep a SIGTERM from being
  heard (the run blocked in a write, and waited there).

Moments a timer cannot hit are made deterministic by a user model that writes a marker
file and then waits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.train import train
from tests.helpers.cli import child_env, csrun_command
from tests.helpers.tiny_config import tiny_config

USER_MODULE = '''\
import os, pathlib, signal, time
from torch import nn

STOP = None  # in-process: an Event the evaluation sets
SIGNAL_SELF = False  # in-process: the evaluation sends itself SIGTERM
RELEASED = False  # in-process: the test lets a waiting evaluation go

class Net(nn.Module):
    """Writes a marker in its first evaluation (and waits: ``eval_wait`` s), or at a
    training call."""
    def __init__(self, mark_at=0, eval_wait=3):
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.calls, self.mark_at, self.eval_wait = 0, mark_at, eval_wait
    def forward(self, x):
        if self.training:
            self.calls += 1
            if self.calls == self.mark_at:
                pathlib.Path("training").write_text("")
                time.sleep(3)
        elif self.calls:  # not preflight's call: an evaluation after training
            if STOP is not None:
                STOP.set()
            if not os.path.exists("evaluating"):
                pathlib.Path("evaluating").write_text("")
                if SIGNAL_SELF:  # in-process: the signal a scheduler would send
                    signal.raise_signal(signal.SIGTERM)
                deadline = time.monotonic() + self.eval_wait
                while time.monotonic() < deadline and not RELEASED:
                    time.sleep(0.05)
        return self.lin(x)
'''


def user_config(tmp_path, name: str, *overrides: str) -> str:
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    return tiny_config(f"model={{kind: import, target: '{name}:Net'}}",
                       "checkpoint={dir: ck, every_steps: 100}", "train.steps=6", *overrides)


@pytest.fixture
def user(tmp_path, monkeypatch):
    name = f"user_{uuid.uuid4().hex[:8]}"
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_a_stop_during_the_final_evaluation_interrupts_the_run(tmp_path, user):
    text = user_config(tmp_path, user)
    config = load_config_text(text, str(tmp_path / "c.yaml"))
    stop = threading.Event()
    sys.modules[user].STOP = stop
    events = []
    result = train(config, stop=stop, on_event=events.append)
    assert result.status == "interrupted" and result.steps == 6
    assert result.checkpoint["last"].endswith("ckpt-00000006.pt")  # saved before
    assert "eval_loss" not in result.metrics
    assert any("interrupted during the final evaluation, after step 6" in e.message
               for e in events if type(e).__name__ == "Notice")


@pytest.mark.timeout(120)
def test_a_sigterm_interrupts_a_slow_final_evaluation_mid_batch(tmp_path, user):
    """A batch of the final evaluation that would take 10 minutes: the SIGTERM in it
    interrupts it there (it used to run to its end first)."""
    text = user_config(tmp_path, user, "model.kwargs.eval_wait=600")
    config = load_config_text(text, str(tmp_path / "c.yaml"))
    sys.modules[user].SIGNAL_SELF = True
    events = []
    try:
        result = train(config, on_event=events.append)
    finally:
        sys.modules[user].RELEASED = True  # the batch let go ends (in the test process)
    assert (result.status, result.signal, result.steps) == ("interrupted", "SIGTERM", 6)
    assert result.checkpoint["last"].endswith("ckpt-00000006.pt")
    assert "eval_loss" not in result.metrics
    assert any("interrupted during the final evaluation, after step 6" in e.message
               for e in events if type(e).__name__ == "Notice")


def _spawn(tmp_path, *args, **popen):
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    popen.setdefault("stdout", subprocess.PIPE)
    return subprocess.Popen(csrun_command() + [str(a) for a in args], cwd=tmp_path, env=env,
                            stderr=subprocess.PIPE, text=True, **popen)


def _wait_for(path, process, seconds=120):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"no {path.name} in time"
        time.sleep(0.05)


@pytest.mark.process
@pytest.mark.timeout(180)
@pytest.mark.parametrize("eval_wait, after", [(3, 0), (600, 1)], ids=["batch_of_3_s",
                                                                     "batch_of_600_s"])
def test_sigterm_during_the_final_evaluation_exits_143(tmp_path, eval_wait, after):
    """SIGTERM ``after`` s into an evaluation batch of ``eval_wait`` s (round 3 sent it
    one second in): exit 143 at once, not when the batch ends."""
    (tmp_path / "c.yaml").write_text(user_config(tmp_path, f"evaluates{eval_wait}",
                                                 f"model.kwargs.eval_wait={eval_wait}"))
    process = _spawn(tmp_path, "train", "c.yaml", "--json", "out.json")
    try:
        _wait_for(tmp_path / "evaluating", process)
        time.sleep(after)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)  # not the batch's 600 s
    finally:
        process.kill()
    assert process.returncode == 143, err
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["status"] == "interrupted" and result["signal"] == "SIGTERM"
    assert result["checkpoint"]["last"].endswith("ckpt-00000006.pt")
    assert "interrupted; checkpoint" in err and "Traceback" not in err


@pytest.mark.process
@pytest.mark.timeout(180)
def test_a_second_sigterm_aborts_with_143(tmp_path):
    (tmp_path / "c.yaml").write_text(user_config(tmp_path, "trains", "model.kwargs.mark_at=5"))
    process = _spawn(tmp_path, "train", "c.yaml", "--json", "out.json")
    try:
        _wait_for(tmp_path / "training", process)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 143, err
    assert "aborted (second SIGTERM)" in err and "Ctrl-C" not in err, err
    result = json.loads((tmp_path / "out.json").read_text())
    assert (result["status"], result["signal"], result["exit_code"]) == \
        ("aborted", "SIGTERM", 143)


@pytest.mark.process
@pytest.mark.timeout(180)
def test_a_users_thread_does_not_keep_a_finished_run_alive(tmp_path):
    (tmp_path / "c.yaml").write_text("""\
strategy: {compute_devices: [CPU:0, CPU:1]}
dataset:
  source: {kind: import, target: "tests.helpers.faulty_data:Blobs", kwargs: {thread: true}}
  steps: [{op: batch, size: 8}]
model: {kind: import, target: "tests.helpers.faulty_data:Net", loss: cross_entropy}
train: {steps: 3}
""")
    process = _spawn(tmp_path, "train", "c.yaml", "--json", "out.json")
    try:
        out, err = process.communicate(timeout=120)  # it waited for the thread forever
    finally:
        process.kill()
    assert process.returncode == 0, err
    assert json.loads((tmp_path / "out.json").read_text())["status"] == "completed"
    assert "exiting without waiting for 2 thread(s) still running in your code " \
           "(user-prefetcher, user-prefetcher)" in " ".join(err.split())


@pytest.mark.process
@pytest.mark.timeout(240)
def test_sigterm_is_heard_while_stdout_is_a_full_pipe(tmp_path):
    (tmp_path / "c.yaml").write_text(tiny_config(
        "train={steps: 1000000, log_every: 1}", "checkpoint={dir: ck, every_steps: 100000}"))
    read, write = os.pipe()  # nobody reads: it fills after some 300 steps' logs
    try:
        process = _spawn(tmp_path, "train", "c.yaml", "--json", "out.json", stdout=write)
        os.close(write)
        deadline = time.monotonic() + 120
        while not _full(read) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _full(read), "the pipe did not fill"
        time.sleep(1)  # blocked in a write by now
        process.send_signal(signal.SIGTERM)
        try:
            err = process.communicate(timeout=60)[1]
        finally:
            process.kill()
    finally:
        os.close(read)
    assert process.returncode == 143, err
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["status"] == "interrupted" and result["checkpoint"]["last"]
    assert (tmp_path / "ck").is_dir()


def _full(fd: int) -> bool:
    import fcntl
    import termios
    waiting = bytearray(4)
    fcntl.ioctl(fd, termios.FIONREAD, waiting)
    return int.from_bytes(waiting, sys.byteorder) >= 60_000  # of a 64 KiB pipe
