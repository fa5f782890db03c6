"""The chief's final report agrees with what happened: a worker killed and restarted
rejoins and is not "lost"; the global steps the tasks report say what they count."""

import re
import signal
import subprocess
from pathlib import Path

import pytest

from csrun.core.runner.launch import free_ports
from tests.helpers.cluster_tasks import ClusterTasks
from tests.helpers.tiny_config import ps_config

pytestmark = pytest.mark.process  # cluster tasks as csrun processes

def config(steps: int) -> str:
    return ps_config("~dataset.holdout", f"train.steps={steps}")


SLOW_MLP = """\
import time
import torch


class SlowMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 3))

    def forward(self, x):
        time.sleep(0.03)
        return self.net(x)
"""


class Job(ClusterTasks):
    """A chief, a worker and a ps as `csrun train` processes with their TF_CONFIG."""

    def __init__(self, folder: Path, steps: int):
        (folder / "c.yaml").write_text(config(steps))
        ports = free_ports(3)
        super().__init__(folder, {"chief": [f"127.0.0.1:{ports[0]}"],
                                  "worker": [f"127.0.0.1:{ports[1]}"],
                                  "ps": [f"127.0.0.1:{ports[2]}"]})

    def start(self, job: str, name: str, overrides: tuple = ()) -> subprocess.Popen:
        return self.spawn(job, 0, name, overrides)


@pytest.fixture
def job(tmp_path):
    made = []

    def make(steps):
        made.append(Job(tmp_path, steps))
        return made[-1]
    yield make
    for each in made:  # a failed test must not leave a cluster running
        each.kill_all()


@pytest.mark.timeout(300)
def test_a_restarted_worker_rejoins_and_is_not_reported_lost(job):
    # every task runs the same config (a task whose settings differ is refused), long
    # enough that the chief outlives the restart; Ctrl-C ends the job
    cluster = job(steps=1_000_000)
    ps = cluster.start("ps", "ps")
    chief = cluster.start("chief", "chief")
    first = cluster.start("worker", "worker")
    cluster.wait_log("worker", "step 20/")
    first.send_signal(signal.SIGKILL)
    first.wait()
    cluster.wait_log("chief", "lost worker:0")  # the chief saw it go
    again = cluster.start("worker", "again")
    cluster.wait_log("again", "continuing at step")  # where it was, not at step 0
    resumed_at = int(re.search(r"continuing at step (\d+)", cluster.log("again")).group(1))
    cluster.wait_log("again", f"step {(resumed_at // 10 + 2) * 10}/")  # 10+ steps more
    again.send_signal(signal.SIGINT)  # it stops after its step and says goodbye
    assert again.wait(timeout=180) == 130, cluster.log("again")
    chief.send_signal(signal.SIGINT)  # the chief stops, saves and ends the job
    assert chief.wait(timeout=120) == 130, cluster.log("chief")
    assert ps.wait(timeout=60) == 0, cluster.log("ps")
    report = cluster.result("chief")["cluster"]
    assert report["lost_workers"] == []           # it came back and left cleanly
    assert report["rejoined_workers"] == ["worker:0"]
    assert cluster.result("again")["steps"] >= resumed_at + 10
    assert "rejoined worker:0" in cluster.log("chief")
    assert "lost workers   none" in cluster.log("chief")


@pytest.mark.timeout(300)
def test_the_global_steps_in_the_final_reports_agree(job):
    cluster = job(steps=60)  # the same for both: a task whose settings differ is refused
    ps = cluster.start("ps", "ps")
    chief = cluster.start("chief", "chief")
    worker = cluster.start("worker", "worker")
    assert worker.wait(timeout=180) == 0, cluster.log("worker")
    assert chief.wait(timeout=180) == 0, cluster.log("chief")
    assert ps.wait(timeout=60) == 0
    mine, final = cluster.result("worker")["cluster"], cluster.result("chief")["cluster"]
    # the job's global step is every applied update; the chief reports it at the end
    assert final["global_step"] == sum(final["updates"].values()) == 120
    # the worker left earlier: its report says the step is the one when it finished
    assert mine["global_step_when"] == "this worker finished"
    assert final["global_step_when"] == "the job ended"
    assert mine["global_step"] <= final["global_step"]
    assert "when this worker finished" in cluster.log("worker")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("resume", [False, True])
def test_a_restarted_worker_continues_at_its_step_and_the_counts_agree(job, resume):
    """A restarted worker trains no step twice (with or without --resume): the chief
    reports each worker's train.steps updates, and the global step is their sum."""
    cluster = job(steps=60)
    (cluster.folder / "slow_mlp.py").write_text(SLOW_MLP)  # steps long enough to kill one
    slow = ("model={kind: import, target: 'slow_mlp:SlowMLP'}",)
    ps = cluster.start("ps", "ps", slow)
    chief = cluster.start("chief", "chief", slow + ("train.log_every=1",))
    first = cluster.start("worker", "worker", slow + ("train.log_every=1",))
    cluster.wait_log("worker", "step 20/")
    chief.send_signal(signal.SIGSTOP)  # the job must outlive the restart
    first.send_signal(signal.SIGKILL)
    first.wait()
    again = cluster.start("worker", "again", slow + ("train.log_every=1",) +
                          (("--resume", "checkpoint.dir=ck") if resume else ()))
    cluster.wait_log("again", "continuing at step")
    chief.send_signal(signal.SIGCONT)
    assert again.wait(timeout=180) == 0, cluster.log("again")
    assert chief.wait(timeout=180) == 0, cluster.log("chief")
    assert ps.wait(timeout=60) == 0, cluster.log("ps")
    assert "continuing at step" in cluster.log("again")
    assert "step 1/" not in cluster.log("again")
    report = cluster.result("chief")["cluster"]
    assert report["updates"] == {"chief:0": 60, "worker:0": 60}
    assert report["global_step"] == 120
