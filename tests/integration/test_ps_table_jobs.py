"""Jobs with embedding tables through `csrun launch` (real processes on loopback): a
sparse, partitioned job trains and reports what it moved; one worker's job ends on the
same `params_sha256` whatever the shard count, and on central storage's values; a
checkpoint of one sharding resumes in another."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.helpers.tiny_config import TABLE_JOB, ps_config

pytestmark = pytest.mark.process  # csrun launch starts the tasks

RANKER = """\
import torch


class Ranker(torch.nn.Module):
    \"\"\"Feature buckets looked up in two tables (one a bag), then a linear head.\"\"\"

    def __init__(self, sparse=True, rows=5000):
        super().__init__()
        self.rows = rows
        self.a = torch.nn.Embedding(rows, 8, sparse=sparse)
        self.b = torch.nn.EmbeddingBag(rows, 8, mode="mean", sparse=sparse)
        self.head = torch.nn.Linear(16, 3)

    def forward(self, x):
        ids = (x.abs() * 977).long() % self.rows
        return self.head(torch.cat([self.a(ids[:, 0]), self.b(ids[:, 1:])], 1))
"""


def table_job(*overrides: str) -> str:
    """The tables' job: 30 steps of the Ranker, with ``overrides``."""
    return ps_config(*TABLE_JOB, "train.steps=30", *overrides)


CONFIG = table_job()
CENTRAL = "strategy={kind: central_storage, compute_devices: [CPU:0]}"  # the same, unclustered


def launch(folder: Path, *args: str, config: str = CONFIG, timeout: float = 240):
    folder.mkdir(exist_ok=True)
    (folder / "c.yaml").write_text(config)
    (folder / "ranker.py").write_text(RANKER)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TF_CONFIG", "RANK", "WORLD_SIZE", "MASTER_", "CSRUN_"))}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, "-m", "csrun.cli", *args], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=timeout)


EXPORT = ("checkpoint.dir=ckpt", "checkpoint.export=safetensors")


def shards(n: int) -> str:
    return f"strategy.variable_partitioner={{kind: fixed, num_shards: {n}}}"


@pytest.mark.timeout(300)
def test_a_sparse_partitioned_job_trains_and_reports_what_it_moved(tmp_path):
    done = launch(tmp_path / "job", "launch", "c.yaml", "--workers", "2", "--ps", "2",
                  "--json", "r.json", shards(3), "optimizer.lr=0.5")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((tmp_path / "job" / "r.json").read_text())["result"]
    cluster = report["cluster"]
    assert cluster["updates"] == {"worker:0": 30, "worker:1": 30}
    assert cluster["global_step"] == 60
    assert len(cluster["variables"]["a.weight"].split(",")) == 3  # three shards
    table_bytes = 2 * 5000 * 8 * 4
    # each ps holds its shards and their Adagrad sums: together twice the tables (and
    # the head), never a table more
    held = sum(ps["held_bytes"] for ps in cluster["ps"].values())
    assert 2 * table_bytes < held < 2 * table_bytes + 4096
    for moved in cluster["worker_transfers"].values():
        # 16 examples a step touch at most 16 + 16 * 5 rows of 32 bytes: both ways with
        # their ids, six messages' headers and the head: far from the tables' 320 KB
        per_step = moved["pushed_bytes_per_step"] + moved["pulled_bytes_per_step"]
        assert moved["steps"] == 30 and per_step < 2 * 96 * (32 + 8) + 8192, moved
    # it learns (lr 0.5: 1.7 -> 0.16 when measured): the last ten steps' mean loss below
    # the first ten's (one step's loss, on one batch of 16, was too noisy to compare)
    losses = report["losses"]
    assert len(losses) == 30, losses
    assert sum(losses[-10:]) < sum(losses[:10]), losses
    assert "moved" in done.stdout and "ps hold" in done.stdout


@pytest.mark.timeout(400)
def test_one_workers_job_ends_the_same_whatever_the_sharding_and_as_central_storage(
        tmp_path):
    digests, weights = [], []
    for n in (1, 4):
        folder = tmp_path / f"shards{n}"
        done = launch(folder, "launch", "c.yaml", "--workers", "1", "--ps", "2",
                      "--json", "r.json", shards(n), *EXPORT)
        assert done.returncode == 0, done.stdout + done.stderr
        digests.append(json.loads((folder / "r.json").read_text())["result"]["params_sha256"])
        weights.append(safetensors.torch.load_file(folder / "ckpt" / "model.safetensors"))
    assert digests[0] == digests[1]
    assert weights[0]["a.weight"].shape == (5000, 8)  # the model's own keys and shapes
    done = launch(tmp_path / "central", "train", "c.yaml", *EXPORT,
                  config=table_job(CENTRAL))
    assert done.returncode == 0, done.stdout + done.stderr
    expected = safetensors.torch.load_file(tmp_path / "central" / "ckpt" /
                                           "model.safetensors")
    assert set(expected) == set(weights[0])
    for key, value in expected.items():
        torch.testing.assert_close(weights[0][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.timeout(400)
def test_a_checkpoint_of_one_sharding_resumes_in_another(tmp_path):
    folder = tmp_path / "job"
    steps = ("train.steps=15", "checkpoint.dir=ckpt", "checkpoint.every_steps=15")
    done = launch(folder, "launch", "c.yaml", "--workers", "1", "--ps", "1", "--json",
                  "a.json", *steps)
    assert done.returncode == 0, done.stdout + done.stderr
    done = launch(folder, "launch", "c.yaml", "--workers", "1", "--ps", "2", "--resume",
                  "--json", "b.json", shards(3), "checkpoint.dir=ckpt",
                  "checkpoint.every_steps=15")
    assert done.returncode == 0, done.stdout + done.stderr
    resumed = json.loads((folder / "b.json").read_text())["result"]
    straight = launch(tmp_path / "straight", "launch", "c.yaml", "--workers", "1", "--ps",
                      "1", "--json", "c.json")
    assert straight.returncode == 0, straight.stdout + straight.stderr
    whole = json.loads((tmp_path / "straight" / "c.json").read_text())["result"]
    assert resumed["params_sha256"] == whole["params_sha256"]


SLOW = """\
import json, os, time

import torch


class Slow(torch.nn.Module):
    \"\"\"An MLP whose forward on worker:1 takes 50 ms longer: that worker finishes last.\"\"\"

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(),
                                       torch.nn.Linear(8, 3))
        task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
        self.delay = 0.05 if task == {"type": "worker", "index": 1} else 0.0

    def forward(self, x):
        time.sleep(self.delay)
        return self.net(x)
"""


@pytest.mark.timeout(420)
def test_a_completed_jobs_last_checkpoint_holds_a_slow_workers_last_updates(tmp_path):
    folder = tmp_path / "job"
    folder.mkdir()
    (folder / "slow.py").write_text(SLOW)
    config = table_job('model={kind: import, target: "slow:Slow"}')
    done = launch(folder, "launch", "c.yaml", "--workers", "2", "--ps", "1",
                  "checkpoint={dir: ckpt, every_steps: 10}", config=config, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    manifests = sorted((folder / "ckpt").glob("ckpt-*.json"))
    manifest = json.loads(manifests[-1].read_text())
    assert manifest["step"] == 30
    payload = torch.load(folder / "ckpt" / manifest["file"], weights_only=True)
    # written again once worker:1 (slower) finished: every worker's 30 steps are in it
    assert payload["ps"]["steps"] == {"worker:0": 30, "worker:1": 30}
    again = launch(folder, "launch", "c.yaml", "--workers", "2", "--ps", "1",
                   "checkpoint={dir: ckpt, every_steps: 10}", "--resume", config=config,
                   timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "the checkpoint's run is complete (step 30 of 30): nothing to train" in again.stdout
    assert "step 1/" not in again.stdout and "step 31" not in again.stdout


HALVED = """\
import torch


class HalvedSGD(torch.optim.SGD):
    \"\"\"A user's subclass: its steps take half the gradient.\"\"\"

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)
        return super().step(closure)
"""


@pytest.mark.timeout(400)
def test_a_users_optimizer_subclass_from_the_config_runs_as_itself_on_the_ps(tmp_path):
    """optimizer.target names a subclass: every task imports it while checking the
    config, so the ps builds it (not torch's SGD); one worker's job then ends on
    central storage's values."""
    halved = ('optimizer={target: "halved:HalvedSGD", lr: 0.1}', "train.steps=8")
    plain = ("optimizer={name: SGD, lr: 0.1}", "train.steps=8")
    weights = {}
    for name, text, args in [("ps", table_job(*halved),
                              ("launch", "c.yaml", "--workers", "1", "--ps", "1")),
                             ("central", table_job(*halved, CENTRAL), ("train", "c.yaml")),
                             ("plain", table_job(*plain, CENTRAL), ("train", "c.yaml"))]:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "halved.py").write_text(HALVED)
        done = launch(folder, *args, *EXPORT, config=text)
        assert done.returncode == 0, done.stdout + done.stderr
        weights[name] = safetensors.torch.load_file(folder / "ckpt" / "model.safetensors")
    assert not torch.allclose(weights["plain"]["head.weight"],
                              weights["central"]["head.weight"])
    for key, value in weights["central"].items():
        torch.testing.assert_close(weights["ps"][key], value, rtol=1e-5, atol=1e-6, msg=key)
