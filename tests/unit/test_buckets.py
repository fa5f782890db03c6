"""Buckets on the copy path: the same results whatever the bucket size, one copy per bucket.

Copy replicas (``copy_parameters=True`` on logical CPUs: the path GPU replicas take) move
parameters in and gradients out in buckets of ``bytes_per_pack`` bytes, the gradients
from a hook as the backward makes them (:mod:`csrun.core.distribute.buckets`). Training
must give bit for bit what one copy per dtype (``bytes_per_pack=0``, the path before
buckets) gives, with 1 and 2 replicas, for SGD, Adam (foreach and fused), AdamW with
weight decay, BatchNorm, gradient accumulation over two runs, ``clip_grad_norm_`` after
``run``, an LR scheduler, and with one replica also what the plain loop gives; and each
step moves one copy per bucket each way, each parameter once.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import csrun.core as cs
from csrun.core.distribute.buckets import DEFAULT_BYTES_PER_PACK, plan
from tests.helpers import copy_path as cp

def test_plan_fills_buckets_from_the_last_tensor():
    assert plan([4, 4, 4], 4, 32) == [(0, 1), (1, 3)]
    assert plan([4, 4, 4], 4, 0) == [(0, 3)]
    assert plan([100, 1, 1], 4, 8) == [(0, 1), (1, 3)]  # a big tensor alone
    assert plan([1, 1], 4, 1) == [(0, 1), (1, 2)]
    assert plan([], 4, 8) == [(0, 0)]
    assert DEFAULT_BYTES_PER_PACK == 25 * 2**20


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("kind,make,extra", cp.CASES, ids=cp.IDS)
def test_every_bucket_size_trains_alike(kind, make, extra, replicas):
    data = cp.batches()
    results = [cp.train_csrun(make, kind, data, replicas, size, **extra)[0] for size in cp.SIZES]
    for size, got in zip(cp.SIZES[:-1], results):
        assert cp.all_equal(got, results[-1]), f"bytes_per_pack={size} differs from one copy"
    if replicas == 1:  # one replica adds nothing: exactly the plain loop
        assert cp.all_equal(results[0], cp.train_plain(make, kind, data, **extra))
    else:
        want = cp.train_plain(make, kind, data, **extra)
        assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(results[0], want))


def _two_backwards(model):
    def step(x, y):  # two micro-batches, each with its own backward
        for xm, ym in zip(x.tensor_split(2), y.tensor_split(2)):
            cp.batch_loss(model, xm, ym).backward()
    return step


def _changed_after_backward(model):
    def step(x, y):
        cp.batch_loss(model, x, y).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.05)  # per replica, in place
        model[0].bias.grad = None
    return step


def _unused_read(model):
    def step(x, y):
        _ = model[4].weight * 2  # read, left out of the loss
        F.cross_entropy(model[2](model[0](x)).relu()[:, :3], y).backward()
    return step


@pytest.mark.parametrize("make_step", [_two_backwards, _changed_after_backward, _unused_read],
                         ids=["two-backwards", "changed-after-backward", "read-unused"])
def test_gradients_that_change_after_leaving_count_as_they_are_at_the_end(make_step):
    """A bucket leaves when its gradients arrive; a later change in the replica (another
    backward, an in-place clip, a gradient set to None) is what counts, as before."""
    data = cp.batches(3)
    got = []
    for size in (1, 0):
        strategy = cp.copy_strategy(2, size)
        with strategy.scope():
            torch.manual_seed(0)
            model = cp.mlp()
        step = make_step(model)
        for x, y in data:
            xs, ys = x.tensor_split(2), y.tensor_split(2)
            strategy.run(lambda: step(*cp.own_slice(xs, ys)))
        got.append([p.grad.clone() if p.grad is not None else None
                    for p in model.parameters()])
    for a, b in zip(*got):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    if make_step is _changed_after_backward:  # set to None in both replicas: none
        assert got[0][1] is None


def test_a_backward_after_run_and_a_frozen_parameter():
    data = cp.batches(2)
    got = []
    for size in (1, 0):
        strategy = cp.copy_strategy(2, size)
        with strategy.scope():
            torch.manual_seed(0)
            model = cp.mlp()
        model[2].weight.requires_grad_(False)
        for x, y in data:
            xs, ys = x.tensor_split(2), y.tensor_split(2)
            losses = strategy.run(lambda: cp.batch_loss(model, *cp.own_slice(xs, ys)))
            strategy.reduce("SUM", losses, axis=None).backward()  # outside the run
        got.append([p.grad for p in model.parameters()])
    assert got[0][2] is None and got[1][2] is None
    assert all(a is None or torch.equal(a, b) for a, b in zip(*got))


class _Copies(TorchDispatchMode):
    """Counts the copies of a step: ``cat`` into a mirror (in) and out of one (out)."""

    def __init__(self):
        super().__init__()
        self.into, self.out = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.cat.out:
            self.into.append((result.dtype, result.numel() * result.element_size()))
        elif func is torch.ops.aten.cat.default:
            self.out.append((result.dtype, result.numel() * result.element_size()))
        return result


class _Mixed(nn.Module):
    """Parameters of two dtypes: a float32 MLP, a float64 head."""

    def __init__(self):
        super().__init__()
        self.body = cp.mlp()
        self.head = nn.Linear(3, 2).double()

    def forward(self, x):
        return self.head(self.body(x).double())


@pytest.mark.parametrize("size", [1, 400, 0])
def test_a_step_moves_each_bucket_once_each_way(size):
    """Per replica and dtype, as many copies in and out as buckets, each parameter once."""
    strategy = cp.copy_strategy(2, size, execution="ordered")  # replicas on this thread
    with strategy.scope():
        torch.manual_seed(0)
        model = _Mixed()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)

    def step():
        model(x).sum().backward()

    for _ in range(3):  # the last one counted: a steady step
        copies = _Copies()
        with copies:
            strategy.run(step)
            opt.step()
            opt.zero_grad()
    mirror = strategy.extended.store.mirror(0)
    for dtype in (torch.float32, torch.float64):
        count = sum(1 for b in mirror.buckets if b.flat.dtype == dtype)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters()
                     if p.dtype == dtype)
        for moved in (copies.into, copies.out):
            mine = [n for d, n in moved if d == dtype]
            assert len(mine) == 2 * count and sum(mine) == 2 * nbytes  # 2 replicas
    assert (len(mirror.buckets) == 2) == (size == 0)  # one per dtype


def test_gradients_leave_while_the_backward_still_runs():
    """The last layer's bucket has left when the backward reaches the first layer."""
    strategy = cp.copy_strategy(1, 1, execution="ordered")
    with strategy.scope():
        model = cp.mlp()
    seen = []

    def step():
        first = model[0](torch.randn(4, 8))
        mirror = strategy.extended.store.mirror(0)
        first.register_hook(lambda g: seen.append(mirror.buckets[-1]._sent is not None))
        model[4](model[3](model[2](model[1](first)))).sum().backward()

    strategy.run(step)
    assert seen == [True]


def test_bytes_per_pack_is_checked_and_reaches_the_mirrors():
    for bad in (-1, 1.5, True, "25MB"):
        with pytest.raises(ValueError, match="bytes_per_pack must be an integer >= 0"):
            cs.StrategyOptions(bytes_per_pack=bad)
    strategy = cp.copy_strategy(1, 123)
    assert strategy.extended.store.bytes_per_pack == 123
    with strategy.scope():
        cp.mlp()
    assert strategy.extended.store.mirror(0).bytes_per_pack == 123


def test_the_config_default_is_the_library_default():
    from csrun.core.config.schema import CentralStorageConfig, ParameterServerConfig
    assert CentralStorageConfig().bytes_per_pack == DEFAULT_BYTES_PER_PACK
    assert ParameterServerConfig.model_fields["bytes_per_pack"].default == \
        DEFAULT_BYTES_PER_PACK
    assert cs.StrategyOptions().bytes_per_pack == DEFAULT_BYTES_PER_PACK


def test_one_bucket_keeps_no_hooks():
    """Under the bucket size nothing overlaps: no Python hook taxes the backward."""
    strategy = cp.copy_strategy(1, DEFAULT_BYTES_PER_PACK)
    with strategy.scope():
        model = cp.mlp()
    strategy.run(lambda: model(torch.randn(2, 8)).sum().backward())
    mirror = strategy.extended.store.mirror(0)
    assert [b.hooked for b in mirror.buckets] == [False]
    split = cp.copy_strategy(1, 1)
    with split.scope():
        model = cp.mlp()
    split.run(lambda: model(torch.randn(2, 8)).sum().backward())
    assert [b.hooked for b in split.extended.store.mirror(0).buckets] == [True] * 6


def test_a_bad_bucket_size_in_a_config_exits_2_naming_the_key(tmp_path):
    from typer.testing import CliRunner

    from csrun.cli.main import app
    from tests.helpers.tiny_config import tiny_config
    path = tmp_path / "run.yaml"
    path.write_text(tiny_config("strategy.bytes_per_pack=-1"))
    line = 1 + path.read_text().splitlines().index(next(
        n for n in path.read_text().splitlines() if n.startswith("strategy")))
    runner = CliRunner()
    result = runner.invoke(app, ["validate", str(path)], catch_exceptions=False)
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert f"{path}:{line}: strategy.bytes_per_pack" in result.stderr
    result = runner.invoke(app, ["validate", str(path), "strategy.bytes_per_pack=2MB"],
                           catch_exceptions=False)
    assert result.exit_code == 2 and "strategy.bytes_per_pack" in result.stderr
    result = runner.invoke(app, ["validate", str(path), "strategy.bytes_per_pack=4096"],
                           catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
