"""Hand-started parameter-server tasks (one ``csrun train`` per task, each with its own
TF_CONFIG) against the faults of issue 15: a frozen ps, a dead or absent chief, tasks
that disagree on the model or the config, and what a dying ps prints.

Every wait of the tasks has a bound; so does every wait here.
"""

import contextlib
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from csrun.core.cluster.client import ParameterServerClient
from csrun.core.cluster.coordinator import JobCoordinator
from csrun.core.cluster.resolvers import SimpleClusterResolver
from csrun.core.cluster.server import ParameterServer
from csrun.core.cluster.plan import Shard
from csrun.core.cluster.transport import ClusterMismatch
from csrun.core.runner.launch import free_ports
from tests.helpers.tiny_config import ps_config

pytestmark = pytest.mark.process  # cluster tasks as csrun processes

def job_config(timeout: float) -> str:
    return ps_config(f"strategy.timeout_s={timeout}", "~dataset.holdout",
                     "dataset.steps=[{op: batch, size: 32}]", "train.steps=100000")


class Task:
    """One ``csrun train`` task of ``cluster`` in ``folder``; output in TASK.out/.err."""

    def __init__(self, folder: Path, cluster: dict, job: str, index: int, timeout: float,
                 *overrides: str):
        self.name = f"{job}:{index}"
        config = folder / "c.yaml"
        config.write_text(job_config(timeout))
        env = {k: v for k, v in os.environ.items() if k != "CSRUN_TRACEBACK"}
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": job,
                                                                     "index": index}})
        stem = folder / f"{job}-{index}"
        self.out, self.err = stem.with_suffix(".out"), stem.with_suffix(".err")
        self.metrics = stem.with_suffix(".jsonl")
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "csrun.cli", "train", str(config), *overrides,
                 "--metrics", str(self.metrics)], cwd=folder, env=env, stdout=out,
                stderr=err)

    def text(self) -> str:
        return self.out.read_text(errors="replace") + self.err.read_text(errors="replace")

    def wait_for(self, predicate, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            assert self.process.poll() is None, f"{self.name} ended early: {self.text()}"
            assert time.monotonic() < deadline, f"{self.name}: no {what}: {self.text()}"
            time.sleep(0.05)

    def trained(self) -> bool:
        return self.metrics.exists() and self.metrics.stat().st_size > 0

    def finish(self, timeout: float) -> int:
        """The exit code; still running after ``timeout`` seconds (a hang) fails the test."""
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()


@pytest.fixture
def tasks():
    started: list[Task] = []

    def start(*args, **kwargs) -> Task:
        started.append(Task(*args, **kwargs))
        return started[-1]

    yield start
    for task in started:
        task.kill()


def loopback(ports: list[int], workers: int) -> dict:
    return {"worker": [f"127.0.0.1:{p}" for p in ports[:workers]],
            "ps": [f"127.0.0.1:{ports[workers]}"]}


class FrozenPs:
    """A ps address that accepts connections and never answers (a frozen ps)."""

    def __init__(self, port: int):
        self.server = socket.create_server(("127.0.0.1", port))
        self.accepted = threading.Event()
        self.connections: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self.server.accept()
            except OSError:
                return
            self._took(connection)

    def _took(self, connection: socket.socket) -> None:
        self.connections.append(connection)
        self.accepted.set()

    def close(self) -> None:
        self.server.close()
        for connection in self.connections:
            connection.close()


class ResettingPs(FrozenPs):
    """A ps address whose program reads what a worker says, then resets the connection
    (another program on the port)."""

    def _took(self, connection: socket.socket) -> None:
        self.accepted.set()
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        connection.settimeout(5)
        with contextlib.suppress(OSError):
            connection.recv(100)
        connection.close()  # with SO_LINGER 0: a reset


@pytest.fixture
def fake_ps():
    """``fake_ps(FrozenPs, port)``: a fake ps address, closed when the test ends."""
    made: list[FrozenPs] = []

    def make(kind: type, port: int) -> FrozenPs:
        made.append(kind(port))
        return made[-1]
    yield make
    for server in made:
        server.close()


@pytest.fixture
def serving_ps():
    """An in-process ps for library tests: its cluster spec (two workers), served until
    the test ends."""
    port = free_ports(1)[0]
    spec = {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": [f"127.0.0.1:{port}"]}
    server = ParameterServer(SimpleClusterResolver(spec, "ps", 0), timeout=30)
    stop = threading.Event()
    threading.Thread(target=server.serve, kwargs={"stop": stop, "grace": 0},
                     daemon=True).start()
    yield spec
    stop.set()


# -- 1. a frozen ps ----------------------------------------------------------------------
@pytest.mark.timeout(180)
def test_a_worker_against_a_frozen_ps_gives_up_after_timeout_s_naming_it(tmp_path, tasks,
                                                                         fake_ps):
    ports = free_ports(2)
    frozen = fake_ps(FrozenPs, ports[1])
    worker = tasks(tmp_path, loopback(ports, 1), "worker", 0, 3)
    assert frozen.accepted.wait(120), worker.text()
    code = worker.finish(timeout=60)
    assert code == 1, worker.text()
    assert f"ps:0 (127.0.0.1:{ports[1]}) did not answer within 3 s" in worker.text()
    assert "Traceback" not in worker.text()


@pytest.mark.timeout(180)
def test_sigterm_while_waiting_for_a_frozen_ps_exits_143_promptly(tmp_path, tasks, fake_ps):
    ports = free_ports(2)
    frozen = fake_ps(FrozenPs, ports[1])
    worker = tasks(tmp_path, loopback(ports, 1), "worker", 0, 120)
    assert frozen.accepted.wait(120), worker.text()
    time.sleep(0.5)  # in the wait, its signal handlers installed
    worker.process.send_signal(signal.SIGTERM)
    code = worker.finish(timeout=30)  # unheard, it would wait its 120 s timeout_s
    assert code == 143, worker.text()
    assert "stopped by SIGTERM" in worker.text() and "waiting for" in worker.text()


@pytest.mark.timeout(180)
def test_a_ps_address_that_resets_connections_ends_the_worker_with_one_line(tmp_path, tasks,
                                                                           fake_ps):
    ports = free_ports(2)
    resetting = fake_ps(ResettingPs, ports[1])
    worker = tasks(tmp_path, loopback(ports, 1), "worker", 0, 3)
    assert resetting.accepted.wait(120), worker.text()
    code = worker.finish(timeout=60)
    # it printed csrun's line, then "terminate called without an active exception": 134
    assert code == 1, worker.text()
    lines = [line for line in worker.err.read_text().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert f"cannot reach the cluster's store at ps:0 (127.0.0.1:{ports[1]}) within 3 s " \
           "(strategy.timeout_s): the program there accepts connections and closes them" \
           in lines[0], lines


@pytest.mark.timeout(180)
def test_a_store_address_where_nothing_listens_is_unreachable_not_frozen(tmp_path, tasks):
    ports = free_ports(2)  # nothing listens on ports[1]
    worker = tasks(tmp_path, loopback(ports, 1), "worker", 0, 3)
    code = worker.finish(timeout=60)
    assert code == 1, worker.text()
    text = " ".join(worker.text().split())
    assert "nothing accepts connections there (connection refused): is ps:0 running" in text
    assert "frozen" not in text and "Traceback" not in text


# -- 2. a dead or absent chief -----------------------------------------------------------
@pytest.mark.timeout(240)
def test_a_dead_chief_ends_the_ps_and_the_other_workers(tmp_path, tasks):
    ports = free_ports(3)
    cluster = loopback(ports, 2)
    ps = tasks(tmp_path, cluster, "ps", 0, 4)
    chief = tasks(tmp_path, cluster, "worker", 0, 4)
    worker = tasks(tmp_path, cluster, "worker", 1, 4)
    worker.wait_for(worker.trained, "training step")
    chief.kill()
    for task in (ps, worker):
        code = task.finish(timeout=60)
        assert code == 1, task.text()
        assert "the chief worker:0 sent no heartbeat" in task.text(), task.text()
        assert "Traceback" not in task.text()


@pytest.mark.timeout(180)
def test_a_worker_waiting_for_an_absent_chief_says_so_and_hears_sigterm(tmp_path, tasks):
    ports = free_ports(3)
    cluster = loopback(ports, 2)
    ps = tasks(tmp_path, cluster, "ps", 0, 30)
    worker = tasks(tmp_path, cluster, "worker", 1, 30)
    worker.wait_for(lambda: "waiting for the chief worker:0" in worker.text(),
                    "waiting message")
    assert "(until " in worker.text()
    worker.process.send_signal(signal.SIGTERM)
    code = worker.finish(timeout=30)  # unheard, it would end at its 30 s timeout_s with 1
    assert code == 143, worker.text()
    ps.process.send_signal(signal.SIGTERM)
    assert ps.finish(timeout=60) == 143, ps.text()


# -- 4. tasks that disagree --------------------------------------------------------------
@pytest.mark.timeout(180)
def test_a_task_with_another_config_is_refused_naming_the_keys(tmp_path, tasks):
    ports = free_ports(2)
    cluster = loopback(ports, 1)
    ps = tasks(tmp_path, cluster, "ps", 0, 30)
    worker = tasks(tmp_path, cluster, "worker", 0, 30, "train.steps=200",
                   "model.hidden=[32]")
    code = worker.finish(timeout=120)
    assert code == 2, worker.text()
    text = worker.text()
    assert "train.steps" in text and "model.hidden.0" in text, text
    assert "worker:0's config differs from ps:0's" in text, text
    assert "100000" in text and "200" in text
    assert not worker.trained()
    ps.process.send_signal(signal.SIGTERM)
    ps.finish(timeout=60)


def _client(resolver, timeout: float) -> ParameterServerClient:
    return ParameterServerClient(resolver, JobCoordinator(resolver, timeout), timeout)


@pytest.mark.timeout(120)
def test_a_worker_with_another_model_is_told_what_differs(serving_ps):
    """Through the library (no config to compare): the ps compares shapes at
    registration instead of failing the push ("ps:0 stopped answering")."""
    spec = serving_ps
    first, second = (_client(SimpleClusterResolver(spec, "worker", i), 30) for i in (0, 1))
    def shards(rows):
        return [[(Shard(0, 0, 0, rows, 0), torch.zeros(rows, 8), {"rows": False}),
                 (Shard(1, 1, 0, rows, 0), torch.zeros(rows), {"rows": False})]]
    first.register(shards(16), [[]])
    with pytest.raises(ClusterMismatch, match=r"shard 0 on ps:0 is variable 0 from row 0: "
                                              r"float32 \[16, 8\] in the job, variable 0 "
                                              r"from row 0: float32 \[32, 8\] here"):
        second.register(shards(32), [[]])
    second.register(shards(16), [[]])  # same: fine


# -- 3. what a dying ps prints -----------------------------------------------------------
@pytest.mark.timeout(180)
def test_a_worker_whose_ps_dies_prints_csruns_one_line_without_cpp_frames(tmp_path, tasks):
    """torch's C++ layer logged a warning and 10-50 frames for the broken store first."""
    ports = free_ports(3)
    cluster = loopback(ports, 2)
    ps = tasks(tmp_path, cluster, "ps", 0, 10)
    worker = tasks(tmp_path, cluster, "worker", 1, 10)  # polls the store for its chief
    worker.wait_for(lambda: "waiting for the chief" in worker.text(), "waiting message")
    ps.kill()
    code = worker.finish(timeout=60)
    assert code == 1, worker.text()
    lines = [line for line in worker.err.read_text().splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"error: ps:0 (127.0.0.1:{ports[2]}) stopped answering: ")


# -- 5. a worker that stops (SIGSTOP) before the chief is done ----------------------------
def _chief_waiting_for_a_stopped_worker(tmp_path, tasks) -> tuple[Task, Task]:
    ports = free_ports(3)
    cluster = loopback(ports, 2)
    steps = ("train.steps=150", "checkpoint={dir: ck, every_steps: 1000}")
    tasks(tmp_path, cluster, "ps", 0, 5, *steps)
    chief = tasks(tmp_path, cluster, "worker", 0, 5, *steps, "--json", "chief.json")
    worker = tasks(tmp_path, cluster, "worker", 1, 5, *steps)
    worker.wait_for(worker.trained, "training step")
    worker.process.send_signal(signal.SIGSTOP)  # its connection stays open: no ps sees it go
    chief.wait_for(lambda: _last_step(chief) == 150, "the chief's last step")
    time.sleep(1)  # waiting by now
    return chief, worker


def _last_step(task: Task) -> int:
    lines = task.metrics.read_text().splitlines() if task.trained() else []
    try:
        return json.loads(lines[-1])["step"] if lines else 0
    except ValueError:  # a line being written
        return 0


@pytest.mark.timeout(240)
def test_the_chief_counts_a_silent_worker_lost_after_timeout_s(tmp_path, tasks):
    chief, worker = _chief_waiting_for_a_stopped_worker(tmp_path, tasks)
    code = chief.finish(timeout=90)  # it waited 600 s in silence
    assert code == 0, chief.text()
    result = json.loads((tmp_path / "chief.json").read_text())
    assert result["status"] == "completed" and result["cluster"]["lost_workers"] == ["worker:1"]
    assert result["checkpoint"]["last"].endswith("ckpt-00000150.pt")
    assert "waiting for worker:1 to finish" in chief.text()
    assert "lost worker:1" in chief.text() and "neither pushed an update nor finished for " \
        "5 s" in " ".join(chief.text().split()), chief.text()


@pytest.mark.timeout(240)
def test_sigterm_while_the_chief_waits_for_a_silent_worker_saves_and_exits_143(tmp_path,
                                                                               tasks):
    chief, worker = _chief_waiting_for_a_stopped_worker(tmp_path, tasks)
    chief.process.send_signal(signal.SIGTERM)
    code = chief.finish(timeout=60)  # deaf, it waited on
    assert code == 143, chief.text()
    result = json.loads((tmp_path / "chief.json").read_text())
    assert result["status"] == "interrupted" and result["signal"] == "SIGTERM"
    assert result["checkpoint"]["last"].endswith("ckpt-00000150.pt")
    assert "stopped waiting for the other workers" in chief.text()


# -- 6. a task started twice ---------------------------------------------------------------
@pytest.mark.timeout(240)
def test_a_second_process_started_as_the_same_worker_is_refused(tmp_path, tasks):
    ports = free_ports(3)
    cluster = loopback(ports, 2)
    ps = tasks(tmp_path, cluster, "ps", 0, 30)
    chief = tasks(tmp_path, cluster, "worker", 0, 30)
    worker = tasks(tmp_path, cluster, "worker", 1, 30)
    worker.wait_for(worker.trained, "training step")
    (tmp_path / "twin").mkdir()
    twin = tasks(tmp_path / "twin", cluster, "worker", 1, 30)
    code = twin.finish(timeout=90)  # it trained beside the first, counted as one worker
    assert code == 1, twin.text()
    said = " ".join(twin.text().split())
    assert "error: worker:1 is already running in this job: another process was started as " \
           "worker:1 and trains; start each task once (stop that one first to replace it)" \
           in said and "heard of" not in said  # no checkpoint of its own is at stake
    assert not twin.trained() and "Traceback" not in twin.text()
    time.sleep(1)
    for task in (chief, worker, ps):
        task.process.send_signal(signal.SIGTERM)
    assert chief.finish(timeout=60) == 143, chief.text()
    assert "lost worker:1" not in chief.text()  # the refused process never joined


# -- 7. a ps that goes silent mid-run ------------------------------------------------------
@pytest.mark.timeout(240)
def test_a_second_sigterm_is_heard_while_a_push_waits_for_a_silent_ps(tmp_path, tasks):
    ports = free_ports(2)
    cluster = loopback(ports, 1)
    ps = tasks(tmp_path, cluster, "ps", 0, 60)
    chief = tasks(tmp_path, cluster, "worker", 0, 60)
    chief.wait_for(lambda: _last_step(chief) >= 20, "training steps")
    ps.process.send_signal(signal.SIGSTOP)  # silent, its connections open
    time.sleep(1)  # the chief waits in a push by now
    chief.process.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    chief.process.send_signal(signal.SIGTERM)
    code = chief.finish(timeout=20)  # deaf in gloo's wait, it waited out its 60 s
    assert code == 143, chief.text()
    assert "aborted (second SIGTERM)" in chief.text()


@pytest.mark.timeout(240)
def test_a_silent_ps_ends_a_worker_within_timeout_s_naming_it(tmp_path, tasks):
    ports = free_ports(2)
    cluster = loopback(ports, 1)
    ps = tasks(tmp_path, cluster, "ps", 0, 3)
    chief = tasks(tmp_path, cluster, "worker", 0, 3)
    chief.wait_for(lambda: _last_step(chief) >= 20, "training steps")
    ps.process.send_signal(signal.SIGSTOP)
    code = chief.finish(timeout=60)
    assert code == 1, chief.text()
    # a push, or the step's count in the store (on ps:0 too): whichever waits first
    assert re.search(rf"parameter server ps:0 \(127\.0\.0\.1:{ports[1]}\)(, which holds "
                     r"the job's store,)? did not answer within 3 s \(strategy\.timeout_s\)",
                     " ".join(chief.text().split())), chief.text()


@pytest.mark.timeout(240)
def test_a_second_process_started_as_the_same_ps_is_refused(tmp_path, tasks):
    ports = free_ports(4)
    cluster = {"worker": [f"127.0.0.1:{ports[0]}"],
               "ps": [f"127.0.0.1:{ports[1]}", f"127.0.0.1:{ports[2]}"]}
    tasks(tmp_path, cluster, "ps", 0, 30)
    tasks(tmp_path, cluster, "ps", 1, 30)
    chief = tasks(tmp_path, cluster, "worker", 0, 30)
    chief.wait_for(chief.trained, "training step")
    (tmp_path / "twin").mkdir()
    twin = tasks(tmp_path / "twin", cluster, "ps", 1, 30)
    code = twin.finish(timeout=90)  # it served beside the first until the job ended
    assert code == 1, twin.text()
    assert "ps:1 is already running in this job: another process was started as ps:1; " \
           "start each task once" in " ".join(twin.text().split())


@pytest.mark.timeout(120)
def test_a_worker_that_finished_or_runs_is_not_played_again(serving_ps):
    """Through the library: a second client as worker:1 is refused while the first runs
    (after min(CLAIM_GRACE_S, timeout)), and once the first finished."""
    from csrun.core.cluster.transport import DuplicateTask
    spec = serving_ps
    first = _client(SimpleClusterResolver(spec, "worker", 1), 30)
    with pytest.raises(DuplicateTask, match="worker:1 is already running in this job"):
        JobCoordinator(SimpleClusterResolver(spec, "worker", 1), timeout=1)
    first.finish()  # its goodbye: the ps marks worker:1 finished
    deadline = time.monotonic() + 30
    while True:  # "already running" until the ps has read the goodbye
        with pytest.raises(DuplicateTask) as refused:
            JobCoordinator(SimpleClusterResolver(spec, "worker", 1), timeout=1)
        if "worker:1 already did its part of this job" in str(refused.value):
            break
        assert time.monotonic() < deadline, refused.value
