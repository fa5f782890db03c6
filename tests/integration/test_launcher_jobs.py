"""``csrun train`` under the launchers clusters use: a real ``torchrun --standalone`` job
and three processes with Slurm's ``srun`` variables, no ``TF_CONFIG``.

Two asynchronous workers' pushes interleave in arrival order, so two runs of a 1 ps + 2
workers job (by any launcher) end on different ``params_sha256``; with one worker the
job is deterministic, and torchrun's then equals ``csrun launch``'s bit for bit.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.tiny_config import ps_config

pytestmark = pytest.mark.process  # jobs under launchers

CONFIG = ps_config("strategy.num_ps=1", "optimizer.kwargs={momentum: 0.9}",
                   "train.log_every=20")
TRAIN = [sys.executable, "-m", "csrun.cli", "train", "c.yaml", "--json", "r-{task}.json"]


def environment(**extra: str) -> dict:
    """No cluster variables of the calling shell; one thread each (as torchrun sets),
    so that the jobs compare bit for bit."""
    cluster = ("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CSRUN_")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", *cluster))}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def run(folder: Path, command: list[str], timeout: float = 240, **env: str):
    (folder / "c.yaml").write_text(CONFIG)
    return subprocess.run(command, cwd=folder, env=environment(**env), capture_output=True,
                          text=True, timeout=timeout)


def result(folder: Path, task: str) -> dict:
    return json.loads((folder / f"r-{task}.json").read_text())


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", *TRAIN[2:]]


@pytest.mark.timeout(300)
def test_torchrun_standalone_runs_one_ps_and_two_workers(tmp_path):
    done = run(tmp_path, torchrun(3))
    output = done.stdout + done.stderr
    assert done.returncode == 0, output
    # ps:0's store is beside torchrun's own, not on it: no store errors
    assert "failed to bind" not in output.lower() and "TCPStore" not in output, output
    assert result(tmp_path, "ps-0")["status"] == "completed"
    chief = result(tmp_path, "worker-0")
    assert chief["cluster"]["role"] == "chief"
    assert chief["cluster"]["cluster"]["ps"] and len(chief["cluster"]["cluster"]["worker"]) == 2
    assert chief["cluster"]["updates"] == {"worker:0": 40, "worker:1": 40}
    assert chief["cluster"]["global_step"] == 80 and chief["cluster"]["lost_workers"] == []
    assert result(tmp_path, "worker-1")["steps"] == 40


@pytest.mark.timeout(300)
def test_torchrun_trains_the_same_job_as_launch_bit_for_bit(tmp_path):
    (tmp_path / "torchrun").mkdir(), (tmp_path / "launch").mkdir()
    done = run(tmp_path / "torchrun", torchrun(2))
    assert done.returncode == 0, done.stdout + done.stderr
    launched = run(tmp_path / "launch", [*TRAIN[:3], "launch", "c.yaml", "--workers", "1",
                                         "--ps", "1", "--json", "r.json"])
    assert launched.returncode == 0, launched.stdout + launched.stderr
    by_launch = json.loads((tmp_path / "launch" / "r.json").read_text())["result"]
    by_torchrun = result(tmp_path / "torchrun", "worker-0")
    assert by_torchrun["params_sha256"] == by_launch["params_sha256"]
    assert by_torchrun["losses"] == by_launch["losses"]


def free_port_for_slurm() -> int:
    """A free port in Slurm's range (20000 + job id % 10000), to give a job id for."""
    for port in range(20000 + os.getpid() % 9000, 30000):
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    pytest.skip("no free port in 20000..29999")


@pytest.mark.timeout(300)
def test_three_processes_with_slurm_variables_train(tmp_path):
    (tmp_path / "c.yaml").write_text(CONFIG)
    port = free_port_for_slurm()
    slurm = {"SLURM_NTASKS": "3", "SLURM_JOB_ID": str(port - 20000 + 70000),
             # three loopback addresses in Slurm's compact syntax, one task on each
             "SLURM_STEP_NODELIST": "127.0.0.[1-3]", "SLURM_TASKS_PER_NODE": "1(x3)",
             "SLURM_LOCALID": "0"}
    tasks = [subprocess.Popen(TRAIN, cwd=tmp_path, env=environment(
        **slurm, SLURM_PROCID=str(rank)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for rank in range(3)]
    outputs = [task.communicate(timeout=240)[0] for task in tasks]
    assert [task.returncode for task in tasks] == [0, 0, 0], "\n".join(outputs)
    chief = result(tmp_path, "worker-0")
    assert chief["cluster"]["cluster"] == {"ps": [f"127.0.0.1:{port}"], "worker": [
        f"127.0.0.2:{port}", f"127.0.0.3:{port}"]}
    assert chief["cluster"]["updates"] == {"worker:0": 40, "worker:1": 40}
    assert result(tmp_path, "ps-0")["status"] == "completed"
