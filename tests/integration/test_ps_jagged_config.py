"""Jagged input and per-table optimizers end to end from a YAML config
(examples/ps_jagged.yaml): a dict of jagged features per table (EmbeddingBag's flat ids
and offsets, per-id weights) into an EmbeddingBagCollection, SparseAdam for the tables
beside AdamW, through `csrun launch` (real processes on loopback) and `csrun train`."""

import json
import subprocess
from pathlib import Path

import pytest
import safetensors.torch
import torch

from tests.helpers.cli import csrun_command

pytestmark = pytest.mark.process  # csrun launch starts the tasks

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXPORT = ("checkpoint.dir={}", "checkpoint.export=safetensors")


def csrun(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(csrun_command() + list(args), cwd=EXAMPLES, capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.timeout(360)
def test_the_jagged_example_trains_with_two_workers_and_two_ps(tmp_path):
    done = csrun("launch", "ps_jagged.yaml", "--workers", "2", "--ps", "2", "--json",
                 str(tmp_path / "r.json"), f"checkpoint={{dir: {tmp_path / 'ckpt'}}}")
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "r.json").read_text())["result"]
    assert result["status"] == "completed"
    cluster = result["cluster"]
    # every step counted once, though two optimizers pushed in it
    assert cluster["updates"] == {"worker:0": 72, "worker:1": 72}
    assert cluster["global_step"] == 144
    assert result["metrics"]["eval_accuracy"] >= 0.7
    assert result["losses"][-1] < result["losses"][0]
    # no table passes through the chief: its payload holds the dense part and an index,
    # each ps wrote its own shards of the tables (and SparseAdam's moments) beside it
    manifest = json.loads(sorted((tmp_path / "ckpt").glob("ckpt-*.json"))[-1].read_text())
    payload = torch.load(tmp_path / "ckpt" / manifest["file"], weights_only=True)
    tensors = [t for t in torch.utils._pytree.tree_leaves(payload)
               if isinstance(t, torch.Tensor)]
    assert tensors and not [t.shape for t in tensors  # no table (dim 8, >= 40 rows)
                            if t.dim() == 2 and t.shape[1] == 8 and t.shape[0] >= 40]
    shards = {}
    stem = Path(manifest["file"]).stem
    for path in (tmp_path / "ckpt").glob(f"{stem}.ps-*.safetensors"):
        shards.update(safetensors.torch.load_file(path))
    rows = sorted(t.shape[0] for k, t in shards.items() if "/" not in k and t.dim() == 2
                  and t.shape[1] == 8)
    assert sum(rows) == 200 + 500 + 40 and len(rows) == 6  # 3 tables, 2 shards each
    assert any(k.endswith("/exp_avg_sq") for k in shards)


@pytest.mark.timeout(360)
def test_one_workers_jagged_job_ends_as_central_storage_with_the_same_optimizers(tmp_path):
    """Two replicas on the worker take each batch's examples (jagged ids split by
    example); SparseAdam and AdamW on the ps tasks step as they do in one process."""
    short = ("train.epochs=2",)
    ps_dir, central_dir = tmp_path / "ps", tmp_path / "central"
    done = csrun("launch", "ps_jagged.yaml", "--workers", "1", "--ps", "2", *short,
                 "strategy.compute_devices=[CPU:0, CPU:1]",
                 *(e.format(ps_dir) for e in EXPORT))
    assert done.returncode == 0, done.stdout + done.stderr
    done = csrun("train", "ps_jagged.yaml", *short,
                 "strategy={kind: central_storage, compute_devices: [CPU:0]}",
                 *(e.format(central_dir) for e in EXPORT))
    assert done.returncode == 0, done.stdout + done.stderr
    got = safetensors.torch.load_file(ps_dir / "model.safetensors")
    expected = safetensors.torch.load_file(central_dir / "model.safetensors")
    assert set(got) == set(expected) and "tables.tables.item.weight" in got
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-4, atol=1e-5, msg=key)


@pytest.mark.timeout(420)
def test_a_resumed_job_with_per_table_optimizers_ends_as_one_straight_run(tmp_path):
    """SparseAdam's and AdamW's slots and step counts are checkpointed by shard (1 ps)
    and restored into another sharding (2 ps): the same params_sha256 as a straight run."""
    def train(steps: int) -> str:
        return f"train={{steps: {steps}, seed: 0, log_every: 6}}"

    ckpt = f"checkpoint={{dir: {tmp_path / 'ckpt'}, every_steps: 6}}"
    done = csrun("launch", "ps_jagged.yaml", "--workers", "1", "--ps", "1", train(12), ckpt,
                 "strategy.variable_partitioner=null")
    assert done.returncode == 0, done.stdout + done.stderr
    done = csrun("launch", "ps_jagged.yaml", "--workers", "1", "--ps", "2", train(24), ckpt,
                 "--resume", "--json", str(tmp_path / "resumed.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 18/24" in done.stdout and "step 6/24" not in done.stdout
    done = csrun("launch", "ps_jagged.yaml", "--workers", "1", "--ps", "2", train(24),
                 "--json", str(tmp_path / "straight.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    resumed, straight = (json.loads((tmp_path / f"{n}.json").read_text())["result"]
                         for n in ("resumed", "straight"))
    assert resumed["params_sha256"] == straight["params_sha256"]
