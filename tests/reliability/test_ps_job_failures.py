"""Every task of a failing parameter-server job ends with one line naming the task that
failed first and its reason (issue 39), through real ``csrun launch`` jobs of a tiny
embedding model: ps:0 killed mid-run, the chief failing on an out-of-range id or a
truncated checkpoint, a forged shard file, a ps that cannot write its checkpoint file.
No task blames the user's code for a transport failure, prints a raw
``DistNetworkError``, a thread traceback or ``terminate called``, or dies by SIGABRT;
``launch`` exits 1. And the restart by hand of docs/parameter-server.md (issue 37)."""

import hashlib
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

from tests.helpers.tiny_config import TABLE_JOB, ps_config

pytestmark = pytest.mark.process  # csrun launch and its tasks

RANKER = """\
import json, os, time

import torch


def task():
    spec = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    return f"{spec.get('type')}:{spec.get('index')}"


class Ranker(torch.nn.Module):
    def __init__(self, rows=1000):
        super().__init__()
        self.rows, self.calls = rows, 0
        self.a = torch.nn.Embedding(rows, 8, sparse=True)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        ids = (x[:, 0].abs() * 977).long() % self.rows
        if self.training:
            self.calls += 1
            if os.environ.get("BAD_ID_ON") == task() and self.calls > 12:
                ids = ids + self.rows  # out of range
            time.sleep(float(os.environ.get("STEP_SLEEP_S", "0")))
        return self.head(self.a(ids))


def loss(model, batch):
    \"\"\"The user's own loss: the table lookups happen inside it.\"\"\"
    x, y = batch
    return torch.nn.functional.cross_entropy(model(x), y, reduction="none")
"""

CONFIG = ps_config(*TABLE_JOB, "strategy.timeout_s=30",
                   "train={steps: 100000, log_every: 5}",
                   "checkpoint={dir: ck, every_steps: 5, keep: 2}")

TASKS = ("ps:0", "ps:1", "worker:0", "worker:1")


class Job:
    """``csrun launch c.yaml --workers 2 --ps 2`` in ``folder`` (worker:0 is the chief)."""

    def __init__(self, folder: Path, *args: str, env: dict | None = None):
        self.folder = folder
        folder.mkdir(exist_ok=True)
        (folder / "c.yaml").write_text(CONFIG)
        (folder / "ranker.py").write_text(RANKER)
        environ = {k: v for k, v in os.environ.items()
                   if not k.startswith(("TF_CONFIG", "CSRUN_", "BAD_ID", "STEP_SLEEP"))}
        environ.update(env or {}, OMP_NUM_THREADS="1")
        self.out = open(folder / "launch.out", "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "csrun.cli", "launch", "c.yaml", "--workers", "2",
             "--ps", "2", "--json", "r.json", "--logs", "logs", *args], cwd=folder,
            env=environ, stdout=self.out, stderr=subprocess.STDOUT)

    def log(self, task: str, stream: str = "stderr") -> str:
        path = self.folder / "logs" / f"{task.replace(':', '-')}.{stream}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_for(self, predicate, what: str, timeout: float = 150) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert self.process.poll() is None, f"launch ended early: {self.output()}"
            assert time.monotonic() < deadline, f"no {what}: {self.output()}"
            time.sleep(0.05)

    def pid(self, task: str) -> int:
        found = re.search(rf"started {task}( \(chief\))? at \S+, pid (\d+)", self.output())
        assert found, self.output()
        return int(found.group(2))

    def address(self, task: str) -> str:
        found = re.search(rf"started {task}( \(chief\))? at (\S+),", self.output())
        assert found, self.output()
        return found.group(2)

    def output(self) -> str:
        return (self.folder / "launch.out").read_text(errors="replace")

    def finish(self, timeout: float = 200) -> tuple[int, dict]:
        code = self.process.wait(timeout=timeout)
        self.out.close()
        return code, json.loads((self.folder / "r.json").read_text())

    def last_line(self, task: str) -> str:
        """A task's one line: its only ``error:`` line (a hint may follow it)."""
        errors = [line for line in self.log(task).splitlines() if line.startswith("error:")]
        assert len(errors) <= 1, f"{task}: {errors}"
        return errors[-1] if errors else ""

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.out.close()
        for found in re.finditer(r"pid (\d+)", self.output()):
            try:
                os.kill(int(found.group(1)), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def jobs(tmp_path):
    started = []

    def start(*args, folder=None, env=None):
        started.append(Job(folder or tmp_path / f"job{len(started)}", *args, env=env))
        return started[-1]
    yield start
    for job in started:  # a failed test must not leave a cluster running
        job.kill()


def codes(result: dict) -> dict:
    return {t["task"]: t["exit_code"] for t in result["tasks"]}


def assert_clean(job: Job) -> None:
    """Nothing raw in any task's output: no traceback, no gloo or C++ words."""
    for task in TASKS:
        text = job.log(task)
        for raw in ("Traceback", "DistNetworkError", "terminate called", "Exception in thread",
                    "Failed to recv", "c10::", "frame #"):
            assert raw not in text, f"{task}: {raw!r} in\n{text}"


@pytest.mark.timeout(300)
def test_a_killed_ps0_is_named_by_every_task_with_the_intact_checkpoint(jobs):
    job = jobs("model.loss=ranker:loss")  # a lookup in the user's loss meets the dead ps
    job.wait_for(lambda: "checkpoint: step 10" in job.log("worker:0", "stdout"),
                 "a checkpoint")
    time.sleep(3)  # the others hear of the chief's checkpoints once a second
    address = job.address("ps:0")
    os.kill(job.pid("ps:0"), signal.SIGKILL)
    code, result = job.finish()
    assert code == 1, job.output()
    assert result["status"] == "failed" and result["failed_task"] == "ps:0"
    assert codes(result)["ps:0"] == -signal.SIGKILL
    assert codes(result)["ps:1"] == 1 and codes(result)["worker:1"] == 1  # not SIGABRT
    assert_clean(job)
    # the chief names its last checkpoint; the others the newest they heard of
    said = rf"^error: ps:0 \({re.escape(address)}\) stopped answering: "
    chief = re.match(said + r"the last checkpoint, step (\d+), is intact \(ck/ckpt-\d+\.pt\)"
                     r"; the job cannot go on without it \(worker:0: ", job.last_line("worker:0"))
    assert chief, job.last_line("worker:0")
    step = int(chief.group(1))
    assert (job.folder / "ck" / f"ckpt-{step:08d}.json").exists()
    for task in ("ps:1", "worker:1"):
        line = job.last_line(task)
        heard = re.match(said + r"the chief's checkpoints are intact \(the newest this task "
                         rf"heard of: step (\d+), ck/ckpt-\d+\.pt\); the job cannot go on "
                         rf"without it \({task}: ", line)
        assert heard and 5 <= int(heard.group(1)) <= step, f"{task}: {line}"
    for task in ("ps:1", "worker:0", "worker:1"):
        assert "model.loss" not in job.log(task) and "ranker.py" not in job.log(task)


@pytest.mark.timeout(300)
def test_a_chief_failing_on_an_out_of_range_id_is_named_by_every_task(jobs):
    job = jobs(env={"BAD_ID_ON": "worker:0"})
    code, result = job.finish()
    assert code == 1, job.output()
    assert result["failed_task"] == "worker:0", job.output()
    chief = job.last_line("worker:0")
    assert "index out of range" in chief, chief
    assert_clean(job)
    for task in ("ps:0", "ps:1", "worker:1"):
        line = job.last_line(task)
        assert line.startswith("error: the chief ended the job: worker:0 failed: "), \
            f"{task}: {line}"
        assert "index out of range" in line, f"{task}: {line}"
        assert codes(result)[task] == 1


LATE = """\
import json, os, pathlib, time

# worker:1 starts once the chief has failed and ended the job (this folder is first on
# PYTHONPATH: Python imports this module before anything else); torch and csrun are
# imported first, so that it joins well within ps:0's wait for every task to hear
if json.loads(os.environ.get("TF_CONFIG", "{}")).get("task") == {"type": "worker", "index": 1}:
    import torch, csrun.core  # noqa: F401
    deadline = time.monotonic() + 150
    while not pathlib.Path("logs/worker-0.result.json").exists() and \\
            time.monotonic() < deadline:
        time.sleep(0.05)
"""


@pytest.mark.timeout(300)
def test_a_worker_starting_after_the_chief_failed_ends_with_the_chiefs_reason(jobs, tmp_path):
    """The race behind the test above, made certain: a worker that joins after the ps
    tasks stopped making channels hears why from the store, not "ps:0 stopped answering"."""
    folder = tmp_path / "late"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(LATE)
    job = jobs(folder=folder, env={"BAD_ID_ON": "worker:0", "PYTHONPATH": str(folder)})
    code, result = job.finish()
    assert code == 1 and result["failed_task"] == "worker:0", job.output()
    assert_clean(job)
    line = job.last_line("worker:1")
    assert line.startswith("error: the chief ended the job: worker:0 failed: "), line
    assert "index out of range" in line and codes(result)["worker:1"] == 1, line
    assert job.log("worker:1", "stdout") == "", "worker:1 trained"


def _completed(jobs, folder: Path, steps: int = 20) -> Job:
    job = jobs(f"train.steps={steps}", folder=folder)
    code, _ = job.finish()
    assert code == 0, job.output()
    return job


def _resign(ck: Path, name: str, forged: bool = False) -> None:
    """Make the newest checkpoint's index (in its payload) and manifest hold the new
    bytes of ``name``, one of its shard files, as a forger would."""
    manifest_path = sorted(ck.glob("ckpt-*.json"))[-1]
    manifest = json.loads(manifest_path.read_text())
    payload_path = ck / manifest["file"]
    payload = torch.load(payload_path, weights_only=True)
    digest = hashlib.sha256((ck / name).read_bytes()).hexdigest()
    for entry in payload["ps"]["files"]:
        if entry["file"] == name:
            entry["sha256"] = digest
    torch.save(payload, payload_path)
    for path in (ck / name, payload_path):
        for entry in [manifest, *manifest.get("files", [])]:
            if entry["file"] == path.name:
                entry.update(sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
                             bytes=path.stat().st_size)
    manifest_path.write_text(json.dumps(manifest))


@pytest.mark.timeout(400)
def test_a_chief_failing_on_a_truncated_checkpoint_is_named_by_every_task(jobs, tmp_path):
    _completed(jobs, tmp_path / "job")
    newest = sorted((tmp_path / "job" / "ck").glob("ckpt-*.pt"))[-1]
    newest.write_bytes(newest.read_bytes()[:1000])
    job = jobs("train.steps=40", "--resume", folder=tmp_path / "job")
    code, result = job.finish()
    assert code == 1, job.output()
    assert result["failed_task"] == "worker:0", job.output()
    chief = job.last_line("worker:0")
    assert newest.name in chief, chief
    assert_clean(job)
    for task in ("ps:0", "ps:1", "worker:1"):
        line = job.last_line(task)
        assert line.startswith("error: the chief ended the job: worker:0 failed: "), \
            f"{task}: {line}"
        assert newest.name in line, f"{task}: {line}"


@pytest.mark.timeout(400)
def test_a_shard_file_whose_table_lost_a_row_is_refused_naming_file_and_field(jobs,
                                                                               tmp_path):
    import safetensors
    import safetensors.torch

    _completed(jobs, tmp_path / "job")
    ck = tmp_path / "job" / "ck"
    name = sorted(ck.glob("ckpt-*.ps-0.safetensors"))[-1].name
    with safetensors.safe_open(ck / name, "pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    tensors = {k: t[:999].clone() if t.dim() and t.shape[0] == 1000 else t
               for k, t in tensors.items()}  # the table and its Adagrad sums: 999 rows
    safetensors.torch.save_file(tensors, ck / name, metadata=metadata)
    _resign(ck, name)
    job = jobs("train.steps=40", "--resume", folder=tmp_path / "job")
    code, result = job.finish()
    assert code == 1, job.output()
    assert_clean(job)
    lines = {task: job.last_line(task) for task in TASKS}
    for task, line in lines.items():
        assert name in line and "999" in line and "s0" in line, f"{task}: {line}"
        assert "stopped answering" not in line, f"{task}: {line}"


@pytest.mark.timeout(300)
def test_an_exception_in_a_ps_handler_reaches_the_worker_and_ends_the_job(jobs, tmp_path):
    # ps:1 cannot put its checkpoint file in place: a directory holds the name
    (tmp_path / "job" / "ck" / "ckpt-00000010.ps-1.safetensors").mkdir(parents=True)
    job = jobs(folder=tmp_path / "job")
    code, result = job.finish()
    assert code == 1, job.output()
    assert_clean(job)
    said = re.compile(r"^error: (the chief ended the job: )?ps:1 failed on a request of "
                      r"worker:0: IsADirectoryError: .*ckpt-00000010\.ps-1\.safetensors")
    for task in TASKS:
        assert said.match(job.last_line(task)), f"{task}: {job.last_line(task)}"
        assert codes(result)[task] == 1, job.output()
    assert result["failed_task"] in ("ps:1", "worker:0"), job.output()


@pytest.mark.timeout(400)
def test_a_worker_restarted_by_hand_rejoins_and_launch_agrees_with_the_chief(jobs):
    """docs/parameter-server.md's restart by hand: the launched task's own environment
    (its CSRUN_LAUNCHER_PID included, which once made it exit 143 as if stopped)."""
    job = jobs("train.steps=1000", env={"STEP_SLEEP_S": "0.05"})  # the chief: 50 s
    job.wait_for(lambda: "step 20/" in job.log("worker:1", "stdout"), "worker:1's steps")
    pid = job.pid("worker:1")
    environ = dict(line.split("=", 1) for line in
                   Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in line)
    assert environ["CSRUN_LAUNCHER_PID"] == str(job.process.pid)
    command = Path(f"/proc/{pid}/cmdline").read_text().rstrip("\0").split("\0")
    os.kill(pid, signal.SIGKILL)
    job.wait_for(lambda: "lost worker:1" in job.log("worker:0", "stdout")
                 + job.log("worker:0"), "the chief's note of the loss")
    again = subprocess.run(command, cwd=job.folder, env={**environ, "STEP_SLEEP_S": "0"},
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "continuing at step" in again.stdout + again.stderr
    assert "is not this process's parent" in again.stderr
    code, result = job.finish()
    assert code == 0, job.output()
    chief = result["result"]["cluster"]
    assert chief["rejoined_workers"] == ["worker:1"] and chief["lost_workers"] == []
    assert result["lost_workers"] == [] and result["status"] == "completed"
    assert "rejoined worker:1" in job.log("worker:0", "stdout") + job.log("worker:0")
