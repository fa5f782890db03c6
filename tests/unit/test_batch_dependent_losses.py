"""Losses that depend on the whole batch, through the runner (issue 38): the worked
example of docs/own-training.md (examples/toypkg/pairs.py) trains the same with 1, 2 and
3 replicas; the mistake it fixes (in-batch negatives from a replica's slice) does not;
the class-weighted loss is ``F.cross_entropy(weight=...)`` of the whole batch exactly."""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import csrun.core as cs
from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.session import Outputs, Session, run_session

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@pytest.fixture
def pairs(monkeypatch):
    """examples/toypkg importable, as from the examples folder; its pairs module."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.chdir(EXAMPLES)
    for name in [n for n in sys.modules if n == "toypkg" or n.startswith("toypkg.")]:
        monkeypatch.delitem(sys.modules, name)
    import toypkg.pairs
    return toypkg.pairs


def _config(loss: str, replicas: int) -> str:
    devices = ", ".join(f"CPU:{i}" for i in range(replicas))
    return f"""
strategy: {{compute_devices: [{devices}]}}
dataset:
  source: {{kind: import, target: "toypkg.pairs:Pairs", kwargs: {{size: 40}}}}
  steps: [{{op: batch, size: 10}}]
model: {{kind: import, target: "toypkg.pairs:Encoder", loss: "toypkg.pairs:{loss}"}}
optimizer: {{name: SGD, lr: 0.5}}
train: {{epochs: 3, seed: 0}}
"""


def _trained(loss: str, replicas: int) -> tuple[torch.Tensor, float]:
    session = Session(load_config_text(_config(loss, replicas)), Outputs(), lambda e: None)
    result = run_session(session, False, threading.Event())
    assert result.status == "completed" and result.steps == 12
    flat = torch.cat([p.detach().flatten() for p in session.model.parameters()])
    return flat, result.losses[-1]


@pytest.mark.parametrize("loss", ["contrastive_loss", "weighted_loss"])
def test_the_worked_example_trains_the_same_with_one_two_and_three_replicas(pairs, loss):
    one, loss_one = _trained(loss, 1)
    for replicas in (2, 3):
        got, loss_got = _trained(loss, replicas)
        torch.testing.assert_close(got, one, rtol=0, atol=1e-5)
        assert loss_got == pytest.approx(loss_one, rel=1e-5)


def test_negatives_from_the_replicas_slice_only_train_differently(pairs):
    one, _ = _trained("sliced_contrastive_loss", 1)
    two, _ = _trained("sliced_contrastive_loss", 2)
    assert (two - one).abs().max() > 1e-3


def _whole_batch(pairs):
    data = pairs.Pairs(size=10)
    return {key: torch.stack([data[i][key] for i in range(10)]) for key in data[0]}


@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_the_weighted_loss_is_torchs_weighted_mean_of_the_whole_batch(pairs, replicas):
    batch = _whole_batch(pairs)
    strategy = cs.CentralStorageStrategy([f"CPU:{i}" for i in range(replicas)], "CPU:0")
    with strategy.scope():
        torch.manual_seed(0)
        model = pairs.Encoder()
    want = F.cross_entropy(model.classify(batch["anchor"]), batch["label"],
                           weight=pairs.WEIGHTS)
    slices = next(iter(strategy.experimental_distribute_dataset([batch])))
    summed = strategy.run(lambda b: pairs.weighted_loss(model, b).sum(), args=(slices,))
    got = strategy.reduce("SUM", summed, axis=None) / len(batch["label"])
    torch.testing.assert_close(got, want.detach())


def test_the_contrastive_loss_outside_a_run_is_the_one_device_loss(pairs):
    batch = _whole_batch(pairs)
    torch.manual_seed(0)
    model = pairs.Encoder()
    anchors, positives = model(batch["anchor"]), model(batch["positive"])
    want = F.cross_entropy(anchors @ positives.T / pairs.TEMPERATURE, torch.arange(10))
    torch.testing.assert_close(pairs.contrastive_loss(model, batch).mean(), want)


def test_the_docs_show_the_example_as_it_is():
    doc = (ROOT / "docs" / "own-training.md").read_text(encoding="utf-8")
    source = (EXAMPLES / "toypkg" / "pairs.py").read_text(encoding="utf-8")
    for name in ("contrastive_loss", "weighted_loss"):
        shown = re.search(rf"^def {name}\(.*?(?=^\S|\Z)", doc, re.M | re.S).group(0)
        for line in shown.splitlines():
            code = line.split("#")[0].strip()
            assert not code or code in source, f"{name}: {code!r} is not in pairs.py"
