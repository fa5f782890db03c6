"""ParameterServerStrategy with real processes on loopback: 1 ps + 2 workers."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from csrun.core.runner.launch import free_ports
from tests.helpers import ps_task

pytestmark = pytest.mark.process  # cluster tasks as processes


def _steps_done(path: Path) -> int:
    """The count in a task's progress file; 0 while there is none. Read once: the task
    rewrites it (truncate, then write), so a second read may find it empty."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return 0
    return int(text) if text.strip().isdigit() else 0


class Cluster:
    def __init__(self, tmp_path: Path, workers: int = 2, ps: int = 1):
        ports = free_ports(workers + ps)
        self.spec = {"worker": [f"localhost:{p}" for p in ports[:workers]],
                     "ps": [f"localhost:{p}" for p in ports[workers:]]}
        self.tmp = tmp_path
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, job: str, index: int, steps: int = 30, die_at: int = -1,
              sleep: float = 0.01, tag: str = "", hold: str = "",
              go: str = "") -> subprocess.Popen:
        env = dict(os.environ, PS_STEPS=str(steps), PS_DIE_AT=str(die_at), PS_SLEEP=str(sleep),
                   PS_HOLD=hold, PS_GO=go,
                   PS_RESULT=str(self.tmp / f"{job}{index}{tag}.json"),
                   TF_CONFIG=json.dumps({"cluster": self.spec,
                                         "task": {"type": job, "index": index}}))
        proc = subprocess.Popen([sys.executable, ps_task.__file__], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        self.procs[f"{job}{index}{tag}"] = proc
        return proc

    def wait_progress(self, name: str, steps: int, timeout: float = 90) -> None:
        """Wait until task ``name`` has finished ``steps`` training steps."""
        path = self.tmp / f"{name}.json.progress"
        deadline = time.monotonic() + timeout
        while _steps_done(path) < steps:
            assert time.monotonic() < deadline, f"{name} made no progress"
            assert self.procs[name].poll() is None, self.procs[name].communicate()[1]
            time.sleep(0.05)

    def result(self, name: str) -> dict:
        return json.loads((self.tmp / f"{name}.json").read_text())

    def wait(self, name: str, timeout: float = 90) -> tuple[int, str]:
        out, err = self.procs[name].communicate(timeout=timeout)
        return self.procs[name].returncode, err

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.kill_all()


@pytest.mark.timeout(180)
def test_loss_falls_variables_on_ps_updates_interleave(cluster, tmp_path):
    # The workers start their steps together: on a loaded machine one of them could
    # otherwise connect seconds after the other had done most of its steps.
    go = tmp_path / "go"
    cluster.start("ps", 0)
    cluster.start("worker", 0, steps=40, go=str(go))
    cluster.start("worker", 1, steps=40, go=str(go))
    deadline = time.monotonic() + 90
    while not all((tmp_path / f"worker{i}.json.ready").exists() for i in (0, 1)):
        assert time.monotonic() < deadline, "the workers did not connect"
        for name in ("worker0", "worker1"):
            assert cluster.procs[name].poll() is None, cluster.procs[name].communicate()[1]
        time.sleep(0.02)
    go.touch()
    for name in ("worker0", "worker1", "ps0"):
        code, err = cluster.wait(name)
        assert code == 0, err
    chief, other = cluster.result("worker0"), cluster.result("worker1")
    # The untrained model's loss is the larger first loss: a worker that starts late
    # already sees the other's updates. One batch of 16 is noisy, so compare a mean.
    start = max(chief["losses"][0], other["losses"][0])
    for result in (chief, other):
        assert sum(result["losses"][-5:]) / 5 < 0.25 * start
        assert result["placement"] == ["/job:ps/replica:0/task:0/device:CPU:0"] * 4
    (log,) = chief["logs"]
    workers = [w for w, _ in log]
    assert workers.count("worker:0") == 40 and workers.count("worker:1") == 40
    assert [v for _, v in log] == list(range(1, 81))
    # Asynchronous and interleaved: each worker's first push lands before the other's
    # last one, and the ps switches between them many times.
    def last(w):
        return len(workers) - 1 - workers[::-1].index(w)
    assert workers.index("worker:1") < last("worker:0")
    assert workers.index("worker:0") < last("worker:1")
    assert sum(a != b for a, b in zip(workers, workers[1:])) >= 10
    assert chief["lost"] == []


@pytest.mark.timeout(180)
def test_killed_worker_lets_the_others_finish(cluster):
    cluster.start("ps", 0)
    cluster.start("worker", 0, steps=40, sleep=0.02)
    cluster.start("worker", 1, steps=40, die_at=5, sleep=0.02)
    assert cluster.wait("worker1")[0] == 3
    code, err = cluster.wait("worker0")
    assert code == 0, err
    assert cluster.wait("ps0")[0] == 0
    chief = cluster.result("worker0")
    assert chief["lost"] == ["worker:1"] and chief["reported"] == ["worker:1"]
    assert len(chief["losses"]) == 40


@pytest.mark.timeout(180)
def test_dead_ps_stops_workers_with_a_clear_error(cluster):
    ps = cluster.start("ps", 0)
    cluster.start("worker", 0, steps=100000, sleep=0.02)
    cluster.start("worker", 1, steps=100000, sleep=0.02)
    cluster.wait_progress("worker0", 5)
    cluster.wait_progress("worker1", 5)
    ps.kill()
    for name in ("worker0", "worker1"):
        code, err = cluster.wait(name)
        assert code == 1
        assert "parameter server ps:0" in err and "cannot go on" in err
        assert "Traceback" not in err


@pytest.mark.timeout(180)
def test_restarted_worker_rejoins(cluster, tmp_path):
    hold = tmp_path / "release-chief"
    cluster.start("ps", 0)
    cluster.start("worker", 0, steps=20, sleep=0.02, hold=str(hold))
    cluster.start("worker", 1, steps=60, die_at=4, sleep=0.02)
    assert cluster.wait("worker1")[0] == 3
    cluster.start("worker", 1, steps=10, sleep=0.02, tag="b")
    assert cluster.wait("worker1b")[0] == 0
    hold.touch()
    code, err = cluster.wait("worker0")
    assert code == 0, err
    chief = cluster.result("worker0")
    (log,) = chief["logs"]
    # The first incarnation pushed 5 updates before dying, the restarted one 10.
    assert [w for w, _ in log].count("worker:1") == 15 and len(log) == 35
    assert chief["lost"] == []  # it finished after all


# What a ps runs for each worker incarnation it serves: the channel's own thread (its
# rendezvous connection made on it) and gloo's threads of that channel's pair group
CHANNEL_THREADS = 3


def _threads(proc: subprocess.Popen) -> int:
    return len(os.listdir(f"/proc/{proc.pid}/task"))


def _settle(proc: subprocess.Popen, count: int, timeout: float = 60) -> int:
    """The process's thread count once it is ``count`` (or what it is after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while _threads(proc) != count and time.monotonic() < deadline:
        time.sleep(0.05)
    return _threads(proc)


@pytest.mark.timeout(240)
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_each_worker_incarnation_costs_the_ps_a_fixed_set_of_threads_and_leaves_none(
        cluster, tmp_path):
    """A worker restarted again and again (by hand, or by a scheduler) must not grow the
    ps: each incarnation it serves costs CHANNEL_THREADS threads while it lives, and
    none once it died (a bounded store call per channel left one behind for good)."""
    hold = tmp_path / "release-chief"
    ps = cluster.start("ps", 0)
    cluster.start("worker", 0, steps=3, sleep=0.02, hold=str(hold))
    cluster.wait_progress("worker0", 3)
    time.sleep(1.0)  # the chief's channel made and served: the ps's threads settle
    base, costs = _threads(ps), []
    for tag in ("a", "b", "c"):
        cluster.start("worker", 1, steps=1000, die_at=3, sleep=0.3, tag=tag)
        cluster.wait_progress(f"worker1{tag}", 1)
        costs.append(_threads(ps) - base)
        assert cluster.wait(f"worker1{tag}")[0] == 3
        assert _settle(ps, base) == base, f"incarnation {tag} left threads behind"
    assert costs == [CHANNEL_THREADS] * 3
    hold.touch()
    code, err = cluster.wait("worker0")
    assert code == 0, err
    assert cluster.wait("ps0")[0] == 0
    assert cluster.result("worker0")["lost"] == ["worker:1"]
