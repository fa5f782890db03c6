"""PyTorch habits on N replicas train as on one device (issue 24).

Each idiom is trained a few SGD steps by a plain loop (no strategy) and on 2 and 3 replicas
(the alias path, and the copy path GPUs take), with the backward inside ``run`` and after
it; parameters, buffers and every step's gradients must agree. Then the edges where csrun
refuses, or keeps a deviation that docs/tf-parity.md names.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

import csrun.core as cs

BATCH = 12  # splits evenly over 2 and 3 replicas (a buffer's batch mean needs it)


class Tied(nn.Module):
    """Weight tying (language models): the head is the embedding."""

    def __init__(self):
        super().__init__()
        self.embed, self.mid = nn.Embedding(10, 6), nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(torch.tanh(self.mid(self.embed(x.long().abs() % 10).mean(1))))


class BufferUpdates(nn.Module):
    """``register_buffer`` state updated in forward: counters and an EMA of batch means."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("ema", torch.zeros(4))

    def forward(self, x):
        out = self.layer(x - self.ema)
        self.steps += 1
        self.seen.add_(1.0)
        with torch.no_grad():
            self.ema.mul_(0.9).add_(x.mean(0) * 0.1)
        return out


class NoGradInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)

    def forward(self, x):
        with torch.no_grad():
            target = self.a(x)
        return self.b(self.a(x) + target)


class ModuleHooks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)
        self.a.register_forward_hook(lambda m, i, o: o * 2)
        self.b.register_forward_pre_hook(lambda m, i: (i[0] + 1,))
        self.b.register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class TensorHooks(ModuleHooks):
    """Hooks on parameters: on the gradient (a nonlinear clip too) and after accumulation."""

    def __init__(self):
        super().__init__()
        self.a.weight.register_hook(lambda g: g * 3)
        self.a.bias.register_hook(lambda g: g.clamp(-0.01, 0.01))
        self.b.weight.register_post_accumulate_grad_hook(_halve_grad)


def _halve_grad(p):
    p.grad.mul_(0.5)


class Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).T


class Parametrized(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 3)
        parametrize.register_parametrization(self.a, "weight", Symmetric())
        nn.utils.parametrizations.weight_norm(self.b)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class DataclassOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        hidden = torch.tanh(self.a(x))
        return Output(self.b(hidden), hidden)


class FunctionalCall(nn.Module):
    """``torch.func.functional_call`` with tensors derived from the module's own."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x):
        weights = {"weight": self.a.weight * 1.5, "bias": self.a.bias}
        return torch.func.functional_call(self.a, weights, (x,))


class Vmapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 3)

    def forward(self, x):
        return torch.func.vmap(lambda row: self.a(torch.sin(row)))(x)


IDIOMS = [Tied, BufferUpdates, NoGradInside, ModuleHooks, TensorHooks, Parametrized,
          DataclassOutput, FunctionalCall, Vmapped]


def _loss(out, y):
    logits = out.logits if isinstance(out, Output) else out
    return F.cross_entropy(logits, y % logits.shape[-1], reduction="sum") / BATCH


def _data(steps=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 4, generator=g), torch.randint(0, 10, (BATCH,), generator=g))
            for _ in range(steps)]


def train(make, strategy=None, late=False):
    """The trained state and every step's gradients (plain loop when no strategy)."""
    torch.manual_seed(0)
    if strategy is None:
        model = make()
    else:
        with strategy.scope():
            model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = _data()
    grads = []
    for x, y in (data if strategy is None else strategy.experimental_distribute_dataset(data)):
        opt.zero_grad()
        if strategy is None:
            _loss(model(x), y).backward()
        elif late:  # backward through run's outputs, in cross-replica context
            losses = strategy.run(lambda a, b: _loss(model(a), b), args=(x, y))
            strategy.reduce("SUM", losses, axis=None).backward()
        else:
            strategy.run(lambda a, b: _loss(model(a), b).backward(), args=(x, y))
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return model.state_dict(), grads


def assert_same(got, expected):
    for name, value in expected[0].items():
        torch.testing.assert_close(got[0][name], value, atol=1e-6, rtol=1e-5, msg=name)
    for step, (a, b) in enumerate(zip(got[1], expected[1])):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=f"step {step}")


def _strategy(n=2, **options):
    return cs.CentralStorageStrategy([f"CPU:{i}" for i in range(n)], "CPU:0",
                                     options=cs.StrategyOptions(**options))


@pytest.mark.parametrize("late", [False, True], ids=["backward in run", "backward after"])
@pytest.mark.parametrize("replicas,copy", [(2, False), (2, True), (3, False)])
@pytest.mark.parametrize("make", IDIOMS, ids=lambda m: m.__name__)
def test_an_idiom_on_replicas_trains_as_on_one_device(make, replicas, copy, late):
    expected = train(make)
    assert_same(train(make, _strategy(replicas, copy_parameters=copy), late), expected)


def test_tensor_hooks_on_concurrent_replicas():
    assert_same(train(TensorHooks, _strategy(2, execution="concurrent")), train(TensorHooks))


def test_hooks_registered_before_the_model_is_served_run_too():
    # built outside the scope with its hooks, then served at its first call in a replica
    strategy = _strategy(2)
    torch.manual_seed(0)
    model = TensorHooks()
    x, y = _data(1)[0]
    strategy.run(lambda a, b: _loss(model(a), b).backward(),
                 args=next(iter(strategy.experimental_distribute_dataset([(x, y)]))))
    torch.manual_seed(0)
    plain = TensorHooks()
    _loss(plain(x), y).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-5)


# -- parameters written outside the optimizer ----------------------------------------------
@pytest.mark.parametrize("through", ["data", "no_grad", "load_state_dict"])
def test_a_parameter_written_between_runs_reaches_every_copy(through):
    # e.g. swapping EMA weights in for an evaluation: p.data.copy_(ema) changes no version
    strategy = _strategy(2, copy_parameters=True)
    with strategy.scope():
        model = nn.Linear(3, 1, bias=False)
    x = torch.ones(2, 3)
    strategy.run(lambda v: model(v), args=(x,))
    new = torch.full((1, 3), 0.25)
    if through == "data":
        model.weight.data.copy_(new)
    elif through == "no_grad":
        with torch.no_grad():
            model.weight.copy_(new)
    else:
        model.load_state_dict({"weight": new})
    out = strategy.run(lambda v: model(v), args=(x,))
    assert all(o.tolist() == [[0.75], [0.75]] for o in strategy.experimental_local_results(out))


def test_a_data_write_in_merge_call_reaches_every_copy():
    strategy = _strategy(2, copy_parameters=True)
    with strategy.scope():
        model = nn.Linear(3, 1, bias=False)

    def fn(v):
        model(v)  # the copies are made
        cs.get_replica_context().merge_call(lambda s: model.weight.data.fill_(1.0))
        return model(v)
    out = strategy.run(fn, args=(torch.ones(1, 3),))
    assert [o.item() for o in strategy.experimental_local_results(out)] == [3.0, 3.0]


class _Clamped(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 3)

    def forward(self, x):
        with torch.no_grad():
            self.layer.weight.clamp_(-0.2, 0.2)
        return self.layer(x)


def test_a_parameter_written_in_place_inside_a_copy_replica_is_refused():
    # the write would land on the replica's copy and be lost
    with pytest.raises(RuntimeError, match=r"wrote parameter\(s\) Linear.weight in place"):
        train(_Clamped, _strategy(2, copy_parameters=True))
    embedding = _strategy(2, copy_parameters=True)
    with embedding.scope():
        table = nn.Embedding(10, 4, max_norm=0.5)
    with pytest.raises(RuntimeError, match="Embedding.weight in place"):
        embedding.run(lambda i: table(i).sum(), args=(torch.arange(4),))


def test_an_in_place_write_that_changes_nothing_is_refused_in_a_copy_replica_too():
    """Found by the version counter, never by comparing values (that would wait for the
    device every step): the renorm of an Embedding whose rows are all short enough
    writes the weight all the same, and would lose a write the first time one is not."""
    strategy = _strategy(2, copy_parameters=True)
    with strategy.scope():
        table = nn.Embedding(10, 4, max_norm=100.0)
    with pytest.raises(RuntimeError, match="Embedding.weight in place"):
        strategy.run(lambda i: table(i).sum(), args=(torch.arange(4),))


def test_in_place_writes_on_the_parameter_device_reach_it_once_per_replica():
    """The deviation docs/tf-parity.md names: a replica on the parameter's own device
    writes the central tensor itself. An idempotent write (a clamp, Embedding's max_norm)
    trains as on one device; a counting one counts once per replica."""
    assert_same(train(_Clamped, _strategy(2, execution="ordered")), train(_Clamped))
    strategy = _strategy(2)
    with strategy.scope():
        counter = nn.Parameter(torch.zeros(()), requires_grad=False)

    def count():
        with torch.no_grad():
            counter.add_(1)
    strategy.run(count)
    assert counter.item() == 2.0


def test_a_parameter_replaced_for_good_inside_a_replica_is_refused():
    strategy = _strategy(2)
    with strategy.scope():
        layer = nn.Linear(2, 2)

    def replace():
        layer.weight = nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(RuntimeError, match="cannot replace parameter Linear.weight inside a "
                                           "replica"):
        strategy.run(replace)
    assert layer.weight.abs().sum() > 0
