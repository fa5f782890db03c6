"""Issue 13's training options together, through the real CLI on 2 logical CPU replicas:
clipping, accumulation, bf16, a warmup-then-cosine chain, param groups, evaluation during
training with early stopping, the best checkpoint and the safetensors export."""

import json

import pytest
from safetensors.torch import load_file

pytestmark = pytest.mark.process  # the real CLI

CONFIG = """\
strategy: {compute_devices: [CPU:0, CPU:1]}
dataset:
  source: {kind: synthetic, examples: 160, features: 6, classes: 3}
  holdout: 0.25
  steps: [{op: shuffle, buffer: 256}, {op: batch, size: 8}]
model: {kind: mlp, hidden: [16]}
optimizer:
  name: AdamW
  lr: 0.01
  kwargs: {weight_decay: 0.1}
  param_groups: [{match: "bias", weight_decay: 0.0}]
  schedule:
    - {name: LinearLR, kwargs: {start_factor: 0.2, total_iters: 4}, steps: 4}
    - {name: CosineAnnealingLR, kwargs: {T_max: 200}}
train:
  steps: 200
  log_every: 10
  grad_clip_norm: 1.0
  accumulate_steps: 2
  precision: bf16
  eval_every: 2
  early_stopping: {metric: eval_loss, mode: min, patience: 2, min_delta: 0.5}
checkpoint:
  dir: ckpt                     # the config's folder: tmp_path
  every_steps: 1
  keep: 1
  keep_best: {metric: eval_loss, mode: min}
  export: safetensors
"""


def test_the_features_together_through_the_cli(csrun, tmp_path):
    (tmp_path / "run.yaml").write_text(CONFIG)
    done = csrun("train", "run.yaml", "--json", "result.json", "--metrics", "steps.jsonl")
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    lines = [json.loads(line) for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    # min_delta 0.5 is more than any change: the first evaluation stays the best
    assert result["early_stopped"] == {"step": 6, "metric": "eval_loss", "best_step": 2,
                                       "best": result["evaluations"][0]["eval_loss"]}
    assert result["status"] == "completed" and result["steps"] == 6
    assert [e["step"] for e in result["evaluations"]] == [2, 4, 6]
    evals = [line for line in lines if "eval" in line]
    assert [line["eval"] for line in evals] == result["evaluations"]
    steps = [line for line in lines if "eval" not in line]
    assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6]
    assert all(s["examples"] == 16 and s["grad_norm"] > 0 for s in steps)  # 2 x 8
    assert steps[0]["learning_rate"] < steps[4]["learning_rate"]  # warming up
    # the best (lowest eval_loss) is kept, whatever keep: 1 rotates out
    ckpt = tmp_path / "ckpt"
    best = min(result["evaluations"], key=lambda e: e["eval_loss"])
    assert result["checkpoint"]["best_step"] == best["step"]
    assert result["checkpoint"]["best"] == f"ckpt/ckpt-{best['step']:08d}.pt"
    assert (tmp_path / result["checkpoint"]["best"]).is_file()
    assert {p.name for p in ckpt.glob("*.pt")} == {f"ckpt-{best['step']:08d}.pt",
                                                   "ckpt-00000006.pt"}
    assert result["checkpoint"]["export"] == "ckpt/model.safetensors"
    weights = load_file(str(ckpt / "model.safetensors"))
    assert weights and all(k.endswith(("weight", "bias")) for k in weights)  # the model's keys
    assert "early stopping at step 6" in done.stdout
