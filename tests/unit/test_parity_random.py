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


# -- gradient checkpointing replays each replica's stream ------------------------------
class _Net(nn.Module):
    """A Hugging Face-style model: ``gradient_checkpointing`` wraps each block in
    ``torch.utils.checkpoint.checkpoint`` (what ``gradient_checkpointing_enable()`` does)."""

    def __init__(self, p: float = 0.5, batch_norm: bool = False):
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(16, 16), *([nn.BatchNorm1d(16)] if batch_norm else []),
                          nn.GELU(), nn.Dropout(p)) for _ in range(2))
        self.head = nn.Linear(16, 3)
        self.gradient_checkpointing = None  # None, or use_reentrant True/False

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            if self.gradient_checkpointing is None:
                h = block(h)
            else:
                h = checkpoint(block, h, use_reentrant=self.gradient_checkpointing)
        return self.head(h)


def _data(steps=3, batch=24):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(steps)]


def _train(strategy, reentrant, p=0.5, batch_norm=False, late=False):
    """Parameters (and BatchNorm statistics) after SGD steps; the gradients of the first."""
    torch.manual_seed(0)
    with strategy.scope():
        model = _Net(p, batch_norm)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.gradient_checkpointing = reentrant
    data = _data()

    def step(x, y):
        loss = F.cross_entropy(model(x), y, reduction="sum") / len(data[0][0])
        if late:
            return loss
        loss.backward()
    torch.manual_seed(2)
    first = None
    for x, y in strategy.experimental_distribute_dataset(data):
        opt.zero_grad()
        losses = strategy.run(step, args=(x, y))
        if late:  # backward through run's outputs, after run returned
            strategy.reduce("SUM", losses, axis=None).backward()
        first = first or [p.grad.clone() for p in model.parameters()]
        opt.step()
    state = torch.cat([t.detach().flatten() for t in model.state_dict().values()
                       if t.is_floating_point()])
    return state, first, torch.rand(2)  # and where the global generator was left


@pytest.mark.parametrize("execution", EXECUTIONS)
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_recomputes_each_replicas_dropout_masks(reentrant, execution):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to replicas in order
        # (torch 2.4's checkpoint calls its own deprecated torch.cpu.amp.autocast)
        warnings.filterwarnings("ignore", r"`torch\.cpu\.amp\.autocast", FutureWarning)
        plain = _train(_strategy(2, execution=execution), None)
        strategy = _strategy(2, execution=execution)
        checkpointed = _train(strategy, reentrant)
    for a, b in zip(plain[1], checkpointed[1]):
        assert torch.equal(a, b)  # gradients bit for bit: the forward's masks
    assert torch.equal(plain[0], checkpointed[0]) and torch.equal(plain[2], checkpointed[2])
    if execution != "ordered":
        assert strategy.extended.execution == "concurrent"  # the streams took the draws


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_on_one_replica_is_plain_pytorch(reentrant):
    # one replica draws from the global generator, as a plain loop
    ours = _train(_strategy(1), reentrant)
    torch.manual_seed(0)
    model = _Net()
    model.gradient_checkpointing = reentrant
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(2)
    for x, y in _data():
        opt.zero_grad()
        (F.cross_entropy(model(x), y, reduction="sum") / len(x)).backward()
        opt.step()
    assert torch.equal(ours[0], torch.cat([t.detach().flatten()
                                           for t in model.state_dict().values()]))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_with_a_backward_after_run_replays_the_masks(reentrant):
    plain = _train(_strategy(2, execution="ordered"), None, late=True)
    checkpointed = _train(_strategy(2, execution="ordered"), reentrant, late=True)
    for a, b in zip(plain[1], checkpointed[1]):
        assert torch.equal(a, b)
    assert torch.equal(plain[2], checkpointed[2])


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointed_synchronized_batch_norm_on_two_replicas_is_one_device(reentrant):
    # no dropout: two replicas then equal one device (BatchNorm's statistics are updated
    # again by the recomputation, in csrun as in plain PyTorch)
    one = _train(_strategy(1), reentrant, p=0.0, batch_norm=True)
    two = _train(_strategy(2), reentrant, p=0.0, batch_norm=True)
    torch.testing.assert_close(two[0], one[0], atol=1e-6, rtol=1e-5)
    for a, b in zip(two[1], one[1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_fork_rng_in_a_replica_leaves_its_stream_as_it_found_it():
    strategy = _strategy(2)

    def step():
        first = torch.rand(3)
        with torch.random.fork_rng():
            torch.rand(5)
        state = torch.get_rng_state()
        second = torch.rand(3)
        torch.set_rng_state(state)
        return first, second, torch.rand(3)
    torch.manual_seed(0)
    forked = strategy.run(step)

    def plain():
        first = torch.rand(3)
        return first, torch.rand(3)
    torch.manual_seed(0)
    straight = strategy.run(plain)
    for r in range(2):
        assert torch.equal(forked[0].values[r], straight[0].values[r])
        assert torch.equal(forked[1].values[r], straight[1].values[r])
        assert torch.equal(forked[2].values[r], straight[1].values[r])  # replayed
