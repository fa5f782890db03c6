"""``csrun launch`` with real processes on loopback: faults and signals.

The plain case (1 ps + 2 workers: the loss falls, every task's exit code, the variables
on the ps) is ``test_shipped_configs.py::test_parameter_server_config_trains_via_launch``
on configs/ps_local.yaml. Here: a worker killed mid-run, a ps killed mid-run, and a
SIGTERM to the launcher followed by ``--resume``.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from csrun.core.runner.checkpoint import CheckpointManager
from tests.helpers.tiny_config import ps_config

pytestmark = pytest.mark.process  # csrun launch and its tasks

CONFIG = ps_config("~strategy.timeout_s", "optimizer.kwargs={momentum: 0.9}",
                   "train.steps=400", "checkpoint={dir: ck, every_steps: 10, keep: 2}")


class Launch:
    """A ``csrun launch`` process in ``folder``; its own output goes to launch.out."""

    def __init__(self, folder: Path, *args: str):
        self.folder = folder
        (folder / "c.yaml").write_text(CONFIG)
        env = {k: v for k, v in os.environ.items() if k != "CSRUN_TRACEBACK"}
        self.out = open(folder / "launch.out", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "csrun.cli", "launch", "c.yaml", *args,
             "--json", "r.json", "--logs", "logs"], cwd=folder, env=env,
            stdout=self.out, stderr=subprocess.STDOUT)

    def wait_for(self, predicate, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert self.process.poll() is None, f"launch ended early: {self.output()}"
            assert time.monotonic() < deadline, f"no {what}: {self.output()}"
            time.sleep(0.05)

    def log_has(self, task: str, text: str) -> bool:
        path = self.folder / "logs" / f"{task.replace(':', '-')}.stdout.log"
        return path.exists() and text in path.read_text(errors="replace")

    def pid(self, task: str) -> int:
        found = re.search(rf"started {task}( \(chief\))? at \S+, pid (\d+)", self.output())
        assert found, self.output()
        return int(found.group(2))

    def output(self) -> str:
        return (self.folder / "launch.out").read_text(errors="replace")

    def finish(self, timeout: float = 120) -> tuple[int, dict]:
        code = self.process.wait(timeout=timeout)
        self.out.close()
        return code, json.loads((self.folder / "r.json").read_text())

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.out.close()


@pytest.fixture
def launched(tmp_path):
    started = []

    def start(*args, folder=tmp_path):
        started.append(Launch(folder, *args))
        return started[-1]
    yield start
    for job in started:  # a failed test must not leave a cluster running
        job.kill()
        for line in job.output().splitlines():
            found = re.search(r"pid (\d+)", line)
            if found:
                try:
                    os.kill(int(found.group(1)), signal.SIGKILL)
                except ProcessLookupError:
                    pass


def codes(result: dict) -> dict:
    return {t["task"]: t["exit_code"] for t in result["tasks"]}


@pytest.mark.timeout(180)
def test_a_killed_worker_lets_the_chief_finish_and_is_reported(launched):
    job = launched("--chief", "--workers", "1", "--ps", "1")
    job.wait_for(lambda: job.log_has("worker:0", "step 20/400"), "progress of worker:0")
    os.kill(job.pid("worker:0"), signal.SIGKILL)
    code, result = job.finish()
    assert code == 0, job.output()
    assert result["status"] == "completed" and result["chief"] == "chief:0"
    assert codes(result) == {"ps:0": 0, "chief:0": 0, "worker:0": -signal.SIGKILL}
    assert result["lost_workers"] == ["worker:0"]
    chief = result["result"]
    assert chief["steps"] == 400 and chief["cluster"]["lost_workers"] == ["worker:0"]
    assert chief["cluster"]["role"] == "chief" and chief["cluster"]["task"] == "chief:0"
    updates = chief["cluster"]["updates"]
    assert updates["chief:0"] == 400 and 20 <= updates["worker:0"] < 400
    output = job.output()
    assert "lost worker:0; the job goes on without it" in output
    assert "lost workers: worker:0" in output and "worker:0 ended: killed by SIGKILL" in output


@pytest.mark.timeout(180)
def test_a_dead_ps_stops_the_job_with_a_clear_error_and_the_checkpoint_intact(launched,
                                                                                tmp_path):
    job = launched("--workers", "1", "--ps", "2", "train.steps=100000")
    job.wait_for(lambda: len(list((tmp_path / "ck").glob("*.json"))) >= 2, "checkpoints")
    os.kill(job.pid("ps:1"), signal.SIGKILL)
    code, result = job.finish()
    assert code == 1, job.output()
    assert result["status"] == "failed" and result["failed_task"] == "ps:1"
    # ps:0 too ends with the job's line ("the chief ended the job: ps:1 ..."): exit 1
    assert codes(result) == {"ps:0": 1, "ps:1": -signal.SIGKILL, "worker:0": 1}
    output = job.output()
    assert "error: ps:1 failed first (killed by SIGKILL); the chief worker:0 then exit 1" \
        in output
    assert re.search(r"ps:1 \(127\.0\.0\.1:\d+\) stopped answering: the last checkpoint, "
                     r"step \d+, is intact \(ck/ckpt-\d+\.pt\); the job cannot go on", output)
    assert "Traceback" not in output
    # the newest checkpoint verifies and indexes both ps tasks' shards of every variable
    manifest = sorted((tmp_path / "ck").glob("*.json"))[-1]
    identity = json.loads(manifest.read_text())["identity"]
    payload, listed = CheckpointManager(tmp_path / "ck", 2, identity).load_latest()
    assert payload["ps"]["format"] == "shards-1"
    assert len(payload["ps"]["variables"]) == 4  # the MLP's weights and biases
    assert sorted(f["ps"] for f in payload["ps"]["files"]) == [0, 1]
    assert [f["file"] for f in listed["files"]] == [f["file"] for f in payload["ps"]["files"]]


@pytest.mark.timeout(240)
def test_sigterm_stops_every_task_cleanly_and_resume_goes_on(launched, tmp_path):
    job = launched("--workers", "2", "--ps", "1", "train.steps=100000")
    job.wait_for(lambda: job.log_has("worker:0", "checkpoint: step 20"), "a checkpoint")
    job.wait_for(lambda: job.log_has("worker:1", "step 10/"), "progress of worker:1")
    job.process.send_signal(signal.SIGTERM)
    code, result = job.finish()
    assert code == 143, job.output()
    assert result["status"] == "interrupted" and result["signal"] == "SIGTERM"
    assert codes(result) == {"ps:0": 0, "worker:0": 143, "worker:1": 143}
    assert result["lost_workers"] == [] and result["result"]["status"] == "interrupted"
    saved = result["result"]["checkpoint"]["last_step"]
    assert saved == result["result"]["steps"] >= 20
    # (written again after the others finished: a new generation, ckpt-N.g1.pt)
    payload = torch.load(tmp_path / result["result"]["checkpoint"]["last"],
                         weights_only=True)
    applied = payload["ps"]["version"]  # both workers' updates, up to the last save
    assert applied >= saved and sum(payload["ps"]["steps"].values()) == applied
    done_by_1 = payload["ps"]["steps"]["worker:1"]  # it goes on from there on resume

    job = launched("--workers", "2", "--ps", "1", f"train.steps={saved + 20}", "--resume")
    code, result = job.finish()
    assert code == 0, job.output()
    chief = result["result"]
    assert chief["checkpoint"]["resumed_from_step"] == saved and chief["steps"] == saved + 20
    # each worker ends at the steps asked, none trained twice: the counts add up
    assert chief["cluster"]["updates"] == {"worker:0": saved + 20, "worker:1": saved + 20}
    assert chief["cluster"]["global_step"] == 2 * (saved + 20)
    assert f"[worker:0] note: resumed from step {saved}" in job.output()
    told = f"starting at the chief's step {saved}" if done_by_1 == saved else \
        f"continuing at step {done_by_1}"
    assert f"[worker:1] note: {told}" in job.output()


@pytest.mark.timeout(240)
def test_a_second_sigterm_aborts_the_job_with_143(launched, tmp_path):
    # it was reported as a second Ctrl-C: status aborted, exit 130
    job = launched("--workers", "1", "--ps", "1", "train.steps=100000")
    job.wait_for(lambda: job.log_has("worker:0", "step 10/"), "progress of worker:0")
    job.process.send_signal(signal.SIGTERM)
    time.sleep(0.1)  # the tasks take longer than this to save and stop
    job.process.send_signal(signal.SIGTERM)
    code, result = job.finish()
    assert code == 143, job.output()
    assert (result["status"], result["signal"], result["exit_code"]) == \
        ("aborted", "SIGTERM", 143)
    assert "Traceback" not in job.output()
