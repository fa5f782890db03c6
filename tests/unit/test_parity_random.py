"""Random numbers inside replicas behave as in a plain PyTorch loop (issue 24).

* Dropout that masks nothing (p=0, eval mode) draws nothing, not even the run's seed from
  torch's global generator: an unseeded ``DataLoader(shuffle=True)`` keeps its order.
* Gradient checkpointing (``torch.utils.checkpoint``, reentrant or not) replays each
  replica's own random stream in the recomputation, as torch replays its global one, with
  the replicas still running concurrently.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import csrun.core as cs

EXECUTIONS = ["auto", "ordered", "concurrent"]


def _strategy(n=2, **options):
    return cs.CentralStorageStrategy([f"CPU:{i}" for i in range(n)], "CPU:0",
                                     options=cs.StrategyOptions(**options))


# -- dropout that masks nothing draws nothing -------------------------------------------
_NO_DRAW = {
    "Dropout(p=0)": lambda x: nn.Dropout(0.0)(x),
    "Dropout eval": lambda x: nn.Dropout(0.5).eval()(x),
    "Dropout2d eval": lambda x: nn.Dropout2d(0.5).eval()(x.view(2, -1, 2, 1)),
    "AlphaDropout(p=0)": lambda x: nn.AlphaDropout(0.0)(x),
    "F.dropout training=False": lambda x: F.dropout(x, 0.5, training=False),
    "F.feature_alpha_dropout eval": lambda x: F.feature_alpha_dropout(x, 0.3, False),
    "torch.dropout p=0": lambda x: torch.dropout(x, 0.0, True),
    "torch.dropout train=False": lambda x: torch.dropout(x, 0.4, False),
    "RReLU eval": lambda x: nn.RReLU().eval()(x),
}


@pytest.mark.parametrize("execution", EXECUTIONS)
@pytest.mark.parametrize("name", list(_NO_DRAW))
def test_dropout_that_masks_nothing_leaves_the_global_generator_alone(name, execution):
    strategy = _strategy(2, execution=execution)
    x = torch.randn(4, 8)
    layer = _NO_DRAW[name]
    for _ in range(3):  # the first run, and the runs after it (streams decided)
        torch.manual_seed(0)
        out = strategy.run(lambda v: layer(v), args=(x,))
        after = torch.rand(3)
        torch.manual_seed(0)
        assert torch.equal(after, torch.rand(3)), f"{name} drew from the global generator"
        assert all(torch.equal(o, layer(x)) for o in strategy.experimental_local_results(out))


def _loader_orders(step=None) -> list:
    """Two epochs of an unseeded shuffling DataLoader, calling ``step`` on each batch."""
    torch.manual_seed(5)
    loader = torch.utils.data.DataLoader(torch.arange(18.0).view(6, 3), batch_size=2,
                                         shuffle=True)
    seen = []
    for _ in range(2):
        for batch in loader:
            seen.append(batch[:, 0].tolist())
            if step is not None:
                step(batch)
    return seen


def test_an_unseeded_shuffling_loader_keeps_its_order_with_an_eval_model():
    strategy = _strategy(2)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(3, 3), nn.Dropout(0.2)).eval()
    assert _loader_orders(lambda b: strategy.run(lambda v: model(v).sum(), args=(b,))) \
        == _loader_orders()
