"""Gradients still arriving when ``run`` returns, and an optimizer that steps them as they land.

A GPU replica's gradients cross to CPU parameters in buckets that may still be in flight
when ``run`` returns (:mod:`csrun.core.distribute.offload`). Here a CPU transport stands
in for the GPU's: its copies happen only when their event is waited for, and a buffer
read before that is all NaN, so a gradient used before it landed cannot go unnoticed.
Every case must train bit for bit as the synchronous path (one copy per dtype, landed
before ``run`` returns), and ``optimizer.step()`` must step each bucket after it lands
and before the next one is waited for.
"""

from __future__ import annotations

import gc
import io
import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import csrun.core as cs
from csrun.core.distribute import broadcast, buckets
from csrun.core.distribute.offload import ArrivingGrad, split_groups
from tests.helpers import copy_path as cp


class _Later:
    """A copy's event: the copy is made when the event is waited for."""

    def __init__(self, fill, log: list):
        self._fill, self._log = fill, log

    def synchronize(self) -> None:
        if self._fill is not None:
            self._fill()
            self._fill = None
            self._log.append("land")


class _LateTransport(buckets._SameDevice):
    """Logical CPU replicas whose copies go as a GPU's: gradients asynchronously,
    parameters from the central tensors' own (here unpinned) home buffer."""

    staged = True

    def __init__(self, log: list):
        self.log = log

    def home(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def is_home(self, tensor: torch.Tensor) -> bool:
        return True

    def copy_in(self, source, flat: torch.Tensor):
        flat.copy_(source)  # at once: a GPU's copy changes the version when it is queued
        return _Later(lambda: None, [])  # done once waited for, as a GPU's

    def wait_in(self, event) -> None:
        event.synchronize()

    def send(self, grads: list):
        flat = torch.full((sum(g.numel() for g in grads),), float("nan"), dtype=grads[0].dtype)

        def fill():
            torch.cat([g.reshape(-1) for g in grads], out=flat)
        return flat, _Later(fill, self.log)

    def buffers_out(self, flat: torch.Tensor):
        """A replica's written buffers, copied when waited for (a sentinel before)."""
        out = torch.full_like(flat, float("nan") if flat.is_floating_point() else -7)
        return out, _Later(lambda: out.copy_(flat), self.buffer_log)

    buffer_log: list = []  # the buffers' landings (not the gradients' log)


@pytest.fixture
def late(monkeypatch):
    """Copy replicas made from now on send gradients late; the log of their landings."""
    log: list = []
    monkeypatch.setattr(broadcast, "transport_for", lambda device, param: _LateTransport(log))
    return log


@pytest.mark.parametrize("replicas", [1, 2])
@pytest.mark.parametrize("kind,make,extra", cp.CASES, ids=cp.IDS)
def test_late_gradients_train_as_the_synchronous_path(kind, make, extra, replicas,
                                                      monkeypatch):
    data = cp.batches()
    want = cp.train_csrun(make, kind, data, replicas, 0, **extra)[0]
    log: list = []
    monkeypatch.setattr(broadcast, "transport_for", lambda device, param: _LateTransport(log))
    got = cp.train_csrun(make, kind, data, replicas, 1, **extra)[0]
    assert cp.all_equal(got, want)
    assert log  # the gradients did arrive late


class _Kernels(TorchDispatchMode):
    """Logs the optimizer's kernels into the landing log."""

    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))  # lands its gradients first
        if func is torch.ops.aten._fused_adam_.default:
            self.log.append(f"adam {len(args[0])}")
        return out


def _trained_once(kind="adam_fused", size=1):
    strategy = cp.copy_strategy(1, size, execution="ordered")
    with strategy.scope():
        torch.manual_seed(0)
        model = cp.mlp()
        opt = cp.make_optimizer(kind, model.parameters())
    x, y = cp.batches(1)[0]
    strategy.run(lambda: cp.batch_loss(model, x, y).backward())
    return model, opt


def test_written_buffers_land_when_the_central_ones_are_next_read(late):
    """From a GPU, a run's written buffers (BatchNorm's statistics) land when the central
    buffers are next read, not when ``run`` returns (that would wait for the GPU's whole
    backward): a read of the module's buffers outside replicas, ``state_dict()``, the
    next run. Nothing sees them unlanded."""
    torch.manual_seed(0)
    plain = cp.bn_mlp()
    strategy = cp.copy_strategy(2, 0)
    with strategy.scope():
        torch.manual_seed(0)
        model = cp.bn_mlp()
    x, y = cp.batches(1)[0]
    store = strategy.extended.store
    for read in ("first run", "attribute", "state_dict", "next run"):
        plain(x)
        strategy.run(lambda: model(cp.own_slice(x.tensor_split(2), y.tensor_split(2))[0]))
        bn = model[1]
        if read == "first run":  # each buffer copied by itself: new to the layout
            assert store._landing is None
            continue
        assert store._landing is not None
        assert not torch.equal(dict.__getitem__(bn._buffers, "running_mean"),
                               plain[1].running_mean)  # not there yet
        if read == "attribute":
            got = bn.running_mean
        elif read == "state_dict":
            got = model.state_dict()["1.running_mean"]
        else:
            strategy.run(lambda: None)
            got = dict.__getitem__(bn._buffers, "running_mean")
        assert store._landing is None
        # the global batch's statistics (synchronized BatchNorm), up to rounding
        torch.testing.assert_close(got, plain[1].running_mean)
        if read == "next run":
            plain.train()
    assert int(model[1].num_batches_tracked) == 4


def test_the_step_steps_each_bucket_when_it_lands(late):
    model, opt = _trained_once()
    assert all(type(p.grad) is ArrivingGrad for p in model.parameters())
    assert late == []  # nothing landed yet
    groups = opt.param_groups
    with _Kernels(late):
        opt.step()
    # six buckets (one tensor each), each stepped once it landed, before the next lands
    assert late == ["land", "adam 1"] * 6
    assert opt.param_groups is groups and opt.param_groups[0]["params"] == \
        list(model.parameters())
    assert all(type(p.grad) is torch.Tensor for p in model.parameters())


def test_the_pieces_follow_the_order_the_buckets_left_in(late):
    model, opt = _trained_once()
    arrival = model[0].weight.grad._arrival
    pieces = split_groups(opt, arrival)
    last_first = list(model.parameters())[::-1]  # a backward's order
    assert [piece["params"] for piece in pieces] == [[p] for p in last_first]
    assert all(piece["lr"] == opt.param_groups[0]["lr"] for piece in pieces)


def test_arriving_gradients_read_before_the_step_are_whole(late):
    want, _ = _synchronous_grads()
    model, opt = _trained_once()
    late.clear()
    weight = model[0].weight
    assert weight.grad.shape == weight.shape and weight.grad.dtype == weight.dtype
    assert late == []  # shape and dtype need nothing to land
    assert torch.equal(weight.grad.clone(), want[0])
    assert "nan" not in repr(model[2].bias.grad)
    buffer = io.BytesIO()
    torch.save(model[4].weight.grad, buffer)
    assert torch.equal(torch.load(io.BytesIO(buffer.getvalue())), want[4])
    norm = nn.utils.clip_grad_norm_(model.parameters(), 1e9)
    assert torch.equal(norm, torch.linalg.vector_norm(torch.stack(
        [torch.linalg.vector_norm(g) for g in want])))
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), want))


def _synchronous_grads():
    """The gradients of :func:`_trained_once`'s run, landed (its model too)."""
    strategy = cp.copy_strategy(1, 0)
    with strategy.scope():
        torch.manual_seed(0)
        model = cp.mlp()
    x, y = cp.batches(1)[0]
    strategy.run(lambda: cp.batch_loss(model, x, y).backward())
    return [p.grad.clone() for p in model.parameters()], model


def test_reads_outside_torch_ops_see_them_landed_and_zero_grad_drops_them(late):
    want, _ = _synchronous_grads()
    model, opt = _trained_once()
    late.clear()
    assert (model[0].weight.grad.numpy() == want[0].numpy()).all()
    assert model[0].bias.grad.tolist() == want[1].tolist()
    assert model[2].weight.grad.data_ptr() == model[2].weight.grad.data_ptr() != 0
    model[2].bias.grad.data.clamp_(-1e-4, 1e-4)  # the old habit, on the landed gradient
    assert torch.equal(model[2].bias.grad, want[3].clamp(-1e-4, 1e-4))
    assert late == ["land"] * 4
    late.clear()
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    opt.step()  # nothing to step, nothing lands into .grad again
    assert all(p.grad is None for p in model.parameters()) and late == []


def test_a_run_before_the_step_lands_the_last_one_first(monkeypatch):
    """Gradient accumulation: the second run's gradients add to the first's, in order."""
    data = cp.batches(2)
    got = []
    for transport in (None, _LateTransport([])):
        if transport is not None:
            monkeypatch.setattr(broadcast, "transport_for", lambda device, param: transport)
        strategy = cp.copy_strategy(2, 1)
        with strategy.scope():
            torch.manual_seed(0)
            model = cp.mlp()
        for x, y in data:
            xs, ys = x.tensor_split(2), y.tensor_split(2)
            strategy.run(lambda: cp.batch_loss(model, *cp.own_slice(xs, ys)).backward())
        got.append([p.grad for p in model.parameters()])
    assert transport.log == ["land"] * 24  # 6 buckets x 2 replicas x 2 runs
    assert all(type(g) is torch.Tensor and torch.equal(g, want) for g, want in zip(*got))


class _OwnSGD(torch.optim.Optimizer):
    """An optimizer of the user's own: no per-bucket stepping for it."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def test_other_optimizers_wait_for_every_gradient_with_a_warning(late):
    strategy = cp.copy_strategy(1, 1)
    with strategy.scope():
        torch.manual_seed(0)
        model = cp.mlp()
        own = _OwnSGD(model.parameters(), 0.1)
    x, y = cp.batches(1)[0]
    grads, reference = _synchronous_grads()
    late.clear()
    strategy.run(lambda: cp.batch_loss(model, x, y).backward())
    with pytest.warns(UserWarning, match="_OwnSGD.step is not one of torch's"):
        own.step()
    assert late == ["land"] * 6 and own.param_groups[0]["params"] == list(model.parameters())
    with torch.no_grad():
        for p, g in zip(reference.parameters(), grads):
            p.add_(g, alpha=-0.1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))


def test_step_hooks_see_whole_groups(late):
    model, opt = _trained_once()
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append(len(o.param_groups)))
    with pytest.warns(UserWarning, match="step hooks"):
        opt.step()
    assert seen == [1]


def test_a_hook_on_a_parameter_lands_before_run_returns(late):
    strategy = cp.copy_strategy(1, 1)
    with strategy.scope():
        model = cp.mlp()
    calls = []
    model[0].weight.register_hook(lambda g: calls.append(g.clone()))
    x, y = cp.batches(1)[0]
    strategy.run(lambda: cp.batch_loss(model, x, y).backward())
    assert len(calls) == 1 and type(model[0].weight.grad) is torch.Tensor


def test_a_scheduler_and_state_dict_see_the_users_groups(late):
    model, opt = _trained_once("adam_foreach")
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
    opt.step()
    sched.step()
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["lr"] == 0.005
    state = opt.state_dict()
    assert state["param_groups"][0]["params"] == list(range(6)) and len(state["state"]) == 6
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # nothing on its way: no warning, nothing split


_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _gpu_training(size: int, kind: str = "adam_fused", steps: int = 4):
    strategy = cs.CentralStorageStrategy(
        ["GPU:0"], "CPU:0", options=cs.StrategyOptions(bytes_per_pack=size))
    with strategy.scope():
        torch.manual_seed(0)
        model = cp.mlp()
        opt = cp.make_optimizer(kind, model.parameters())
    for x, y in cp.batches(steps):
        x, y = x.cuda(), y.cuda()
        strategy.run(lambda: cp.batch_loss(model, x, y).backward())
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    return cp.state_of(model, opt)


@pytest.mark.gpu
@_cuda
@pytest.mark.parametrize("kind", ["sgd", "adam_fused", "adamw"])
def test_a_gpu_replica_of_cpu_parameters_trains_as_one_copy(kind):
    """The real thing: pinned buffers, side streams, events; bit for bit one copy's."""
    assert cp.all_equal(_gpu_training(1, kind), _gpu_training(0, kind))


@pytest.mark.gpu
@_cuda
def test_a_gpu_step_moves_each_bucket_once_each_way(monkeypatch):
    moved = {"in": [], "out": []}
    real_in, real_out = buckets._Offload.copy_in, buckets._Offload.send

    def copy_in(self, source, flat):
        moved["in"].append(flat.numel() * flat.element_size())
        return real_in(self, source, flat)

    def send(self, grads):
        moved["out"].append(sum(g.numel() * g.element_size() for g in grads))
        return real_out(self, grads)
    monkeypatch.setattr(buckets._Offload, "copy_in", copy_in)
    monkeypatch.setattr(buckets._Offload, "send", send)
    strategy = cs.CentralStorageStrategy(
        ["GPU:0"], "CPU:0", options=cs.StrategyOptions(bytes_per_pack=400))
    with strategy.scope():
        model = cp.mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, device="cuda")
    for _ in range(3):
        moved["in"].clear()
        moved["out"].clear()
        strategy.run(lambda: model(x).sum().backward())
        opt.step()
        opt.zero_grad()
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    count = len(strategy.extended.store.mirror(0).buckets)
    # copied straight from the parameters: they live in one pinned buffer
    assert all(p.is_pinned() for p in model.parameters())
    assert len({p.untyped_storage().data_ptr() for p in model.parameters()}) == 1
    assert count > 1 and len(moved["in"]) == len(moved["out"]) == count
    assert sum(moved["in"]) == sum(moved["out"]) == nbytes


def test_central_tensors_move_to_one_home_and_a_new_data_is_seen(late):
    """The GPU copies from the central tensors' own buffer: the first run moves them
    there (values, optimizer and modules kept); one given other storage later is
    copied there before the next copy in."""
    strategy = cp.copy_strategy(2, 1)
    with strategy.scope():
        torch.manual_seed(0)
        model = cp.mlp()
    before = [p.detach().clone() for p in model.parameters()]
    params = list(model.parameters())
    x, y = cp.batches(1)[0]
    strategy.run(lambda: cp.batch_loss(model, x, y).backward())
    assert list(model.parameters()) == params  # the same tensors
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    homes = {p.untyped_storage().data_ptr() for p in params}
    assert len(homes) == 1  # one buffer, shared by both replicas' mirrors
    address = params[0].data_ptr()
    for p in params:
        assert p.data_ptr() == address
        address += p.numel() * p.element_size()
    model[2].weight.data = torch.full_like(model[2].weight, 0.5)
    seen = []
    strategy.run(lambda: seen.append(model[2].weight.detach().clone()))
    assert len(seen) == 2 and all(torch.equal(s, model[2].weight) for s in seen)


def test_groups_come_back_when_the_strategy_is_collected_during_the_step(late):
    keep = cp.copy_strategy(1, 0)  # another strategy: csrun's step hook stays
    strategy = cp.copy_strategy(1, 1, execution="ordered")
    with strategy.scope():
        model = cp.mlp()
        opt = torch.optim.Adam(model.parameters(), fused=True)
    x, y = cp.batches(1)[0]
    strategy.run(lambda: cp.batch_loss(model, x, y).backward())
    holder = [strategy]
    del strategy

    class _Collect(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if holder:  # the strategy goes in the middle of the step
                holder.clear()
                gc.collect()
            return func(*args, **(kwargs or {}))
    with _Collect():
        opt.step()
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["params"] == \
        list(model.parameters())
    assert late == ["land"] * 6 and keep is not None


def test_a_run_returns_once_its_copies_in_are_done(late):
    """Code between run and step may write parameters: every copy in has read them by
    then, also a bucket the forward never waited for."""
    strategy = cp.copy_strategy(1, 1)
    with strategy.scope():
        model = cp.mlp()
    x, y = cp.batches(1)[0]
    strategy.run(lambda: model[0](x).sum().backward())  # model[2], model[4]: unread
    assert type(model[0].weight.grad) is ArrivingGrad
    mirror = strategy.extended.store.mirror(0)
    assert all(b._copied._fill is None for b in mirror.buckets)
