"""The runner's edges that once gave a silently wrong run: resuming a run that stopped
early, and a schedule that steps on a metric (``ReduceLROnPlateau``)."""

from __future__ import annotations

import json
import threading

import pytest

from csrun.core.config.problems import ConfigError
from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.session import Outputs
from csrun.core.runner.train import train

TINY = """\
strategy: {compute_devices: [CPU:0, CPU:1]}
dataset:
  source: {kind: synthetic, examples: 160, features: 6, classes: 3}
  holdout: 0.25
  steps: [{op: shuffle, buffer: 256}, {op: batch, size: 16}]
model: {kind: mlp, hidden: [16]}
optimizer: {name: Adam, lr: 0.01}
train: {epochs: 10, log_every: 4}
"""
EARLY = ["train.eval_every=2", "checkpoint.export=safetensors",
         "train.early_stopping={metric: eval_loss, patience: 1, min_delta: 0.05}"]


def config(*overrides):
    return load_config_text(TINY, None, list(overrides))


# -- resume after an early stop ----------------------------------------------------------
def test_a_run_that_stopped_early_resumes_to_nothing_to_train(tmp_path):
    whole = train(config(*EARLY, f"checkpoint.dir={tmp_path}"))
    assert whole.early_stopped and whole.steps < whole.total_steps
    notices = []
    resumed = train(config(*EARLY, f"checkpoint.dir={tmp_path}"), resume=True,
                    on_event=lambda e: notices.append(getattr(e, "message", "")))
    assert resumed.steps == whole.steps and resumed.early_stopped == whole.early_stopped
    assert resumed.params_sha256 == whole.params_sha256
    assert resumed.checkpoint["export"] == whole.checkpoint["export"]
    assert any("stopped early" in n and "nothing to train" in n for n in notices), notices


def test_a_larger_patience_on_resume_trains_on(tmp_path):
    whole = train(config(*EARLY, f"checkpoint.dir={tmp_path}"))
    patient = EARLY[:2] + ["train.early_stopping={metric: eval_loss, patience: 50}"]
    resumed = train(config(*patient, f"checkpoint.dir={tmp_path}"), resume=True)
    assert resumed.steps > whole.steps and resumed.early_stopped is None


# -- ReduceLROnPlateau ---------------------------------------------------------------------
# a 50% threshold: short of halving, the loss has stalled
PLATEAU = ("optimizer.schedule={name: ReduceLROnPlateau, "
           "kwargs: {factor: 0.5, patience: 0, threshold: 0.5}}")


def _rates(metrics) -> list[float]:
    return [json.loads(line)["learning_rate"] for line in metrics.read_text().splitlines()
            if '"learning_rate"' in line]


@pytest.mark.parametrize("overrides, every", [
    ((), 1),                                      # on each step's loss
    (("optimizer.schedule.interval=epoch",), 8),  # on each pass's mean loss (8 steps)
    (("train.eval_every=4",), 4)])                # on eval_loss after each evaluation
def test_reduce_lr_on_plateau_steps_on_its_metric(tmp_path, overrides, every):
    metrics = tmp_path / "m.jsonl"
    result = train(config(PLATEAU, *overrides), outputs=Outputs(metrics=str(metrics)))
    rates = _rates(metrics)
    assert result.status == "completed" and len(rates) == 80
    assert rates[0] == 0.01 and rates[-1] < 0.01  # the loss stalled: the rate fell
    changes = [i for i in range(1, 80) if rates[i] != rates[i - 1]]
    assert changes and all(i % every == 0 for i in changes), changes


def test_reduce_lr_on_plateau_resumes_exactly(tmp_path):
    metrics = tmp_path / "whole.jsonl"
    whole = train(config(PLATEAU, f"checkpoint.dir={tmp_path / 'a'}",
                         "optimizer.schedule.interval=epoch"),
                  outputs=Outputs(metrics=str(metrics)))
    stop, part = threading.Event(), tmp_path / "part.jsonl"
    overrides = (PLATEAU, f"checkpoint.dir={tmp_path / 'b'}", "optimizer.schedule.interval=epoch")
    train(config(*overrides), stop=stop, outputs=Outputs(metrics=str(part)),
          on_event=lambda e: stop.set() if getattr(e, "step", 0) == 29 else None)
    resumed = train(config(*overrides), resume=True, outputs=Outputs(metrics=str(part)))
    assert resumed.params_sha256 == whole.params_sha256
    assert _rates(part) == _rates(metrics)  # mid-pass: the pass's loss so far was kept


def test_reduce_lr_on_plateau_cannot_be_chained():
    with pytest.raises(ConfigError) as caught:
        config("optimizer.schedule=[{name: LinearLR, steps: 5}, {name: ReduceLROnPlateau}]")
    (problem,) = caught.value.problems
    assert problem.path == "optimizer.schedule.1.name" and "chain" in problem.message
