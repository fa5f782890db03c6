"""A parameter-server job over a network: ps:0, worker:0 (the chief) and worker:1 each in
a network namespace of its own, joined by veth pairs (benchmarks/netns.py).

Asynchronous workers interleave their pushes in arrival order, so the digest of a
two-worker job is reproducible only when the workers take turns: worker:1 starts once
the chief has done its steps (the chief waits for it at the end), and trains from the
chief's values. Run that way over the namespaces and on loopback, the job must end on
the same ``params_sha256``: the network moves every value bit for bit.
"""

import importlib.util
import signal
import subprocess
from pathlib import Path

import pytest

from csrun.core.runner.launch import free_ports
from tests.helpers.cluster_tasks import ClusterTasks
from tests.helpers.tiny_config import ps_config

_NETNS = Path(__file__).resolve().parents[2] / "benchmarks" / "netns.py"
_spec = importlib.util.spec_from_file_location("csrun_bench_netns", _NETNS)
netns = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(netns)

pytestmark = pytest.mark.process  # tasks in network namespaces

def config(steps: int) -> str:
    return ps_config("optimizer.kwargs={momentum: 0.9}", f"train.steps={steps}")


@pytest.fixture
def hosts():
    reason = netns.unavailable()
    if reason:
        pytest.skip(reason)
    made = netns.Hosts(3)
    try:
        yield made
    finally:  # namespaces and their links go even when the test fails
        made.close()
    assert not set(made.names) & set(subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


class Job(ClusterTasks):
    """ps:0, worker:0 (chief), worker:1 as `csrun train` processes; ``place(task)`` wraps
    a command to run it on its host (or leaves it on loopback)."""

    def __init__(self, folder: Path, addresses: list[str], place, steps: int):
        folder.mkdir(exist_ok=True)
        (folder / "c.yaml").write_text(config(steps))
        super().__init__(folder, {"ps": [addresses[0]], "worker": addresses[1:]})
        self.place, self.steps = place, steps

    def start(self, job: str, index: int, name: str) -> subprocess.Popen:
        return self.spawn(job, index, name, place=self.place, env={"OMP_NUM_THREADS": "1"})

    def in_turns(self) -> dict:
        """The chief trains its steps, then worker:1 trains its own; the chief's result."""
        ps, chief = self.start("ps", 0, "ps"), self.start("worker", 0, "chief")
        self.wait_log("chief", f"step {self.steps}/{self.steps}")  # it waits for worker:1
        worker = self.start("worker", 1, "worker")
        for proc, name in ((worker, "worker"), (chief, "chief"), (ps, "ps")):
            assert proc.wait(timeout=180) == 0, self.log(name)
        return self.result("chief")


def on_hosts(hosts):
    host = {"ps": 0, "worker": 1}
    return lambda job, index, argv: hosts.command(host[job] + index, argv)


@pytest.mark.timeout(400)
def test_a_job_across_namespaces_ends_on_the_loopback_digest(hosts, tmp_path):
    addresses = [f"{a}:2222" for a in hosts.addresses]
    loopback = [f"127.0.0.1:{p}" for p in free_ports(3)]
    jobs = [Job(tmp_path / "net", addresses, on_hosts(hosts), 30),
            Job(tmp_path / "lo", loopback, lambda job, index, argv: argv, 30)]
    try:
        over_net, on_loopback = (job.in_turns() for job in jobs)
    finally:
        for job in jobs:
            job.kill_all()
    assert over_net["cluster"]["updates"] == {"worker:0": 30, "worker:1": 30}
    assert over_net["params_sha256"] == on_loopback["params_sha256"]
    assert over_net["cluster"]["cluster"]["ps"] == [f"{netns.SUBNET}.1:2222"]


@pytest.mark.timeout(400)
def test_a_worker_killed_in_its_namespace_restarts_and_rejoins(hosts, tmp_path):
    job = Job(tmp_path, [f"{a}:2222" for a in hosts.addresses], on_hosts(hosts), 200)
    try:
        ps, chief = job.start("ps", 0, "ps"), job.start("worker", 0, "chief")
        first = job.start("worker", 1, "worker")
        job.wait_log("worker", "step 20/200")
        chief.send_signal(signal.SIGSTOP)  # the chief holds still while worker:1 restarts
        first.kill()
        first.wait()
        again = job.start("worker", 1, "again")
        job.wait_log("again", "continuing at step")  # where it was: no step twice
        chief.send_signal(signal.SIGCONT)
        for proc, name in ((again, "again"), (chief, "chief"), (ps, "ps")):
            assert proc.wait(timeout=180) == 0, job.log(name)
    finally:
        job.kill_all()
    report = job.result("chief")["cluster"]
    assert report["lost_workers"] == [] and report["rejoined_workers"] == ["worker:1"]
    assert report["updates"] == {"worker:0": 200, "worker:1": 200}
    assert report["global_step"] == 400
    assert job.result("again")["steps"] == 200


RANKER = """\
import torch


class Ranker(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.EmbeddingBag(20000, 16, mode="sum", sparse=True)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.a((x.abs() * 977).long() % 20000))
"""
TABLES = ps_config("strategy.variable_partitioner={kind: fixed, num_shards: 3}",
                   "model={kind: import, target: 'ranker:Ranker'}",
                   "optimizer={name: Adagrad, lr: 0.1}", "train.steps=30")


class TableJob(ClusterTasks):
    """ps:0, ps:1 and one worker, the chief, training a sparse table in 3 shards."""

    def __init__(self, folder: Path, addresses: list[str], place):
        folder.mkdir(exist_ok=True)
        (folder / "c.yaml").write_text(TABLES)
        (folder / "ranker.py").write_text(RANKER)
        super().__init__(folder, {"ps": addresses[:2], "worker": addresses[2:]})
        self.place = place

    def run(self) -> dict:
        env = {"OMP_NUM_THREADS": "1"}
        procs = [(self.spawn(job, index, f"{job}{index}", place=self.place, env=env),
                  f"{job}{index}") for job, index in (("ps", 0), ("ps", 1), ("worker", 0))]
        for proc, name in procs:
            assert proc.wait(timeout=180) == 0, self.log(name)
        return self.result("worker0")


@pytest.mark.timeout(400)
def test_a_sparse_partitioned_job_across_namespaces_ends_on_the_loopback_digest(hosts,
                                                                              tmp_path):
    """Lookups and row pushes go to the ps that owns each shard, over the network."""
    place = {"ps": 0, "worker": 2}
    jobs = [TableJob(tmp_path / "net", [f"{a}:2222" for a in hosts.addresses],
                     lambda job, index, argv: hosts.command(place[job] + index, argv)),
            TableJob(tmp_path / "lo", [f"127.0.0.1:{p}" for p in free_ports(3)],
                     lambda job, index, argv: argv)]
    try:
        over_net, on_loopback = (job.run() for job in jobs)
    finally:
        for job in jobs:
            job.kill_all()
    assert over_net["params_sha256"] == on_loopback["params_sha256"]
    devices = over_net["cluster"]["variables"]["a.weight"].split(",")
    assert [d.split("/task:")[1][0] for d in devices] == ["0", "1", "0"]
    assert over_net["cluster"]["transfers"]["pulled_bytes_per_step"] < 20000 * 16 * 4 / 20
