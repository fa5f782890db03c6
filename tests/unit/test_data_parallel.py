"""``csrun.core.DataParallel``: torch's ``nn.DataParallel`` interface, a plain loop, and
results equal to one device (issue 25).

The loop under test is the plain one: ``loss = F.cross_entropy(model(x), y)``,
``loss.backward()``, ``optimizer.step()``, with ``model`` wrapped. It must train as the
unwrapped model on one device (tolerance 1e-5, as test_training_equivalence.py) on 2 and
3 logical CPU replicas, with even and uneven batches, for an MLP, a BatchNorm model (the
whole batch's statistics) and a Hugging Face-style model that computes its loss inside
``forward``. Dropout draws from per-replica streams, so it cannot match one device's
masks: it matches ``strategy.run`` of the same engine, and is reproducible.
"""

from __future__ import annotations

import collections
import dataclasses
import runpy
import threading
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import csrun.core as cs
from csrun.core.distribute import scatter_gather

STEPS = 8
TOL = 1e-5
SEED = 1234


def _devices(n):
    return [f"CPU:{i}" for i in range(n)]


def _mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def _bn_mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def _dropout_mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))


@dataclasses.dataclass
class Output:
    """A stand-in for Hugging Face's ModelOutput: the loss (when labels are given)."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class HFStyle(nn.Module):
    """Computes its own loss, a mean over its examples, as Hugging Face models do."""

    def __init__(self):
        super().__init__()
        self.net = _bn_mlp()

    def forward(self, input_ids, labels=None):
        logits = self.net(input_ids)
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return Output(loss=loss, logits=logits)


def _batches(batch_size, steps=STEPS):
    gen = torch.Generator().manual_seed(SEED + batch_size)
    xs = torch.randn(steps * batch_size, 8, generator=gen)
    ys = torch.randint(0, 3, (steps * batch_size,), generator=gen)
    return list(zip(xs.split(batch_size), ys.split(batch_size)))


def _make(make_model):
    torch.manual_seed(SEED)
    return make_model()


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _plain_loop(model, batches, opt_kind="sgd", hf=False):
    """The loop a PyTorch user writes; the same code trains the wrapped model."""
    opt = _optimizer(opt_kind, model.parameters())
    losses = []
    for x, y in batches:
        opt.zero_grad()
        if hf:
            loss = model(input_ids=x, labels=y).loss
        else:
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _assert_same(got: dict, want: dict):
    assert list(got) == ["module." + k for k in want]
    for key, b in want.items():
        a = got["module." + key]
        assert a.shape == b.shape and a.dtype == b.dtype, key
        if a.is_floating_point():
            diff = (a.double() - b.double()).abs().max().item()
            assert diff <= TOL, f"{key}: max abs diff {diff}"
        else:
            assert torch.equal(a, b), key


# -- results equal one device -----------------------------------------------------------
@pytest.mark.parametrize("batch_size", [12, 10])
@pytest.mark.parametrize("opt_kind", ["sgd", "adam"])
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_plain_loop_on_an_mlp_equals_one_device(replicas, opt_kind, batch_size):
    batches = _batches(batch_size)
    plain = _make(_mlp)
    initial = {k: v.clone() for k, v in plain.state_dict().items()}
    want_losses = _plain_loop(plain, batches, opt_kind)
    model = cs.DataParallel(_make(_mlp), device_ids=_devices(replicas))
    losses = _plain_loop(model, batches, opt_kind)
    assert any((initial[k] - v).abs().max() > 1e-3 for k, v in plain.state_dict().items())
    assert losses == pytest.approx(want_losses, rel=TOL, abs=TOL)
    _assert_same(model.state_dict(), plain.state_dict())


@pytest.mark.parametrize("batch_size", [12, 10])
@pytest.mark.parametrize("replicas", [2, 3])
def test_batch_norm_uses_the_whole_batch(replicas, batch_size):
    plain = _make(_bn_mlp)
    _plain_loop(plain, _batches(batch_size))
    model = cs.DataParallel(_make(_bn_mlp), device_ids=_devices(replicas))
    _plain_loop(model, _batches(batch_size))
    assert int(plain.state_dict()["1.num_batches_tracked"]) == STEPS
    _assert_same(model.state_dict(), plain.state_dict())  # running statistics included


@pytest.mark.parametrize("batch_size", [12, 10])
@pytest.mark.parametrize("replicas", [2, 3])
def test_a_loss_computed_in_forward_is_the_whole_batchs_mean(replicas, batch_size):
    plain = _make(HFStyle)
    want = _plain_loop(plain, _batches(batch_size), hf=True)
    model = cs.DataParallel(_make(HFStyle), device_ids=_devices(replicas))
    got = _plain_loop(model, _batches(batch_size), hf=True)
    assert got == pytest.approx(want, rel=TOL, abs=TOL)
    _assert_same(model.state_dict(), plain.state_dict())


def test_a_batch_smaller_than_the_replicas_leaves_one_empty():
    plain = _make(_mlp)
    want = _plain_loop(plain, _batches(2))
    model = cs.DataParallel(_make(_mlp), device_ids=_devices(3))  # 1, 1 and 0 examples
    assert _plain_loop(model, _batches(2)) == pytest.approx(want, rel=TOL, abs=TOL)
    _assert_same(model.state_dict(), plain.state_dict())


def test_an_hf_loss_with_an_empty_replica_is_left_out():
    x, y = _batches(2)[0]
    model = _make(HFStyle).eval()  # eval: BatchNorm's running statistics, any batch size
    wrapped = cs.DataParallel(model, device_ids=_devices(3))
    out = wrapped(input_ids=x, labels=y)
    want = model(input_ids=x, labels=y)
    assert torch.isfinite(out.loss)
    torch.testing.assert_close(out.loss, want.loss, rtol=TOL, atol=TOL)
    torch.testing.assert_close(out.logits, want.logits, rtol=TOL, atol=TOL)


def test_gradients_are_in_grad_after_backward_for_clipping_and_logging():
    x, y = _batches(10)[0]
    plain, model = _make(_mlp), cs.DataParallel(_make(_mlp), device_ids=_devices(3))
    F.cross_entropy(plain(x), y).backward()
    F.cross_entropy(model(x), y).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=TOL, atol=1e-7)
    want = nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    got = nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    torch.testing.assert_close(got, want, rtol=TOL, atol=1e-7)
    assert got > 0.1  # it clipped


def test_gradients_accumulate_over_two_backwards_as_in_a_plain_loop():
    (x1, y1), (x2, y2) = _batches(10, steps=2)
    plain, model = _make(_mlp), cs.DataParallel(_make(_mlp), device_ids=_devices(2))
    for m in (plain, model):
        F.cross_entropy(m(x1), y1).backward()
        F.cross_entropy(m(x2), y2).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=TOL, atol=1e-7)


def test_grad_scaler_unscales_and_steps_as_in_a_plain_loop():
    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for x, y in _batches(10, steps=3):
            opt.zero_grad()
            scaler.scale(F.cross_entropy(model(x), y)).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
        return model.state_dict()
    want = train(_make(_mlp))
    _assert_same(train(cs.DataParallel(_make(_mlp), device_ids=_devices(2))), want)


def test_inputs_split_along_dim_1():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 5, 8, generator=gen)  # (time, batch, features)
    plain = _make(_mlp)
    model = cs.DataParallel(_make(_mlp), device_ids=_devices(2), dim=1)
    out = model(x)
    torch.testing.assert_close(out, plain(x), rtol=TOL, atol=1e-6)
    out.square().mean().backward()
    plain(x).square().mean().backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=TOL, atol=1e-7)


# -- dropout: per-replica streams ------------------------------------------------------------
def _dropout_train(step_kind, replicas=2):
    batches = _batches(10)
    torch.manual_seed(SEED)
    if step_kind == "run":
        strategy = cs.CentralStorageStrategy(_devices(replicas), "CPU:0")
        with strategy.scope():
            model = _make(_dropout_mlp)
            opt = _optimizer("sgd", model.parameters())
        dist = strategy.experimental_distribute_dataset(batches)
        torch.manual_seed(7)
        for (x, y), (gx, _) in zip(dist, batches):
            opt.zero_grad()
            strategy.run(lambda a, b, n=len(gx): F.cross_entropy(
                model(a), b, reduction="sum").div(n).backward(), args=(x, y))
            opt.step()
        return model.state_dict()
    model = cs.DataParallel(_make(_dropout_mlp), device_ids=_devices(replicas))
    torch.manual_seed(7)
    _plain_loop(model, batches)
    return {k.removeprefix("module."): v for k, v in model.state_dict().items()}


def test_dropout_draws_the_same_masks_as_strategy_run_and_repeats():
    want = _dropout_train("run")
    got = _dropout_train("dp")
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=TOL, atol=1e-6)
    again = _dropout_train("dp")
    assert all(torch.equal(again[k], got[k]) for k in got)  # bit for bit


class _Checkpointed(nn.Module):
    def __init__(self, checkpointed: bool):
        super().__init__()
        self.checkpointed = checkpointed
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5))
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        hidden = checkpoint(self.body, x, use_reentrant=False) if self.checkpointed \
            else self.body(x)
        return self.head(hidden)


def test_gradient_checkpointing_recomputes_each_replicas_dropout_masks():
    def grads(checkpointed):
        torch.manual_seed(0)
        model = cs.DataParallel(_Checkpointed(checkpointed), device_ids=_devices(2))
        x, y = _batches(10)[0]
        torch.manual_seed(5)
        F.cross_entropy(model(x), y).backward()
        return [p.grad for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads(False), grads(True)))


def test_dropout_masks_differ_between_replicas():
    model = cs.DataParallel(nn.Dropout(0.5), device_ids=_devices(2))
    out = model(torch.ones(2, 64))  # one row per replica
    assert not torch.equal(out[0], out[1])


def test_one_replica_calls_the_module_itself_with_any_arguments():
    model = cs.DataParallel(_Sum(), device_ids=["CPU:0"])
    assert model(torch.tensor(2.0)).item() == 2.0  # a 0-dim input: nothing is split


def test_dropout_on_one_replica_is_the_plain_module():
    x = torch.ones(6, 32)
    torch.manual_seed(3)
    want = nn.Dropout(0.5)(x)
    torch.manual_seed(3)
    assert torch.equal(cs.DataParallel(nn.Dropout(0.5), device_ids=["CPU:0"])(x), want)


# -- inputs and outputs -------------------------------------------------------------------
Pair = collections.namedtuple("Pair", "a b")


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, batch, pair, scale=1.0, extra=None):
        out = self.lin(batch["x"] + pair.a + pair.b[0]) * scale
        return {"out": out, "nested": (out.sum(-1), [batch["ids"]]), "tag": "same",
                "extra": extra}


def test_dicts_and_nested_tuples_scatter_and_gather_unevenly():
    gen = torch.Generator().manual_seed(0)
    x, a, b = (torch.randn(5, 4, generator=gen) for _ in range(3))
    ids = torch.arange(5)
    module = Structured()
    want = module({"x": x, "ids": ids}, Pair(a, (b,)), scale=2.0)
    model = cs.DataParallel(module, device_ids=_devices(3))
    got = model({"x": x, "ids": ids}, Pair(a, (b,)), scale=2.0)
    assert set(got) == set(want) and got["tag"] == "same" and got["extra"] is None
    torch.testing.assert_close(got["out"], want["out"])
    torch.testing.assert_close(got["nested"][0], want["nested"][0])
    assert torch.equal(got["nested"][1][0], ids) and not got["nested"][1][0].requires_grad
    assert got["out"].requires_grad


def test_a_dataclass_output_keeps_its_type():
    x, y = _batches(10)[0]
    out = cs.DataParallel(_make(HFStyle), device_ids=_devices(2))(input_ids=x)
    assert type(out) is Output and out.loss is None and out.logits.shape == (10, 3)


def test_other_scalars_are_gathered_into_a_vector_with_a_warning():
    summed = cs.DataParallel(_Sum(), device_ids=_devices(2))
    with pytest.warns(UserWarning, match="0-dim"):
        total = summed(torch.arange(5.0).view(5, 1))
    assert total.tolist() == [3.0, 7.0]


class _Sum(nn.Module):
    def forward(self, x):
        return x.sum()


# -- eval and inference ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_eval_inference_equals_the_module(mode):
    module = _make(_bn_mlp)
    _plain_loop(module, _batches(12, steps=2))
    module.eval()
    x = _batches(10)[0][0]
    model = cs.DataParallel(module, device_ids=_devices(3))
    with getattr(torch, mode)():
        out = model(x)
        want = module(x)
    assert not out.requires_grad and out.grad_fn is None
    torch.testing.assert_close(out, want, rtol=TOL, atol=1e-6)


# -- the interface: torch's ---------------------------------------------------------------
def test_state_dict_keys_and_module_are_nn_data_parallels():
    module = _make(_bn_mlp)
    model = cs.DataParallel(module, device_ids=_devices(2))
    assert model.module is module
    assert list(model.state_dict()) == list(nn.DataParallel(_make(_bn_mlp)).state_dict())
    copy = cs.DataParallel(_make(_bn_mlp), device_ids=_devices(2))
    copy.load_state_dict(model.state_dict())
    assert model.device_ids == ["CPU:0", "CPU:1"] and model.dim == 0
    assert model.output_device == torch.device("cpu")


def test_parameters_and_optimizer_state_live_once_on_the_parameter_device():
    module = _make(_mlp)
    params = list(module.parameters())
    pointers = [p.data_ptr() for p in params]
    model = cs.DataParallel(module, device_ids=_devices(2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for x, y in _batches(10, steps=3):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    assert list(model.parameters()) == params  # the same tensors, updated in place
    assert [p.data_ptr() for p in params] == pointers
    assert model.strategy.extended.store.copies == [False, False]  # aliases, no copies
    assert scatter_gather._ANCHOR.grad is None  # the gather's anchor gathers nothing
    # the backward run reads nothing: the next forward is served what the last one read
    assert [len(ids) for ids in model.strategy.extended.store._last_read] == [6, 6]
    assert all(len(opt.state[p]) == 3 for p in params)  # one Adam state per parameter


def test_replicas_run_forward_and_backward_concurrently():
    seen = {"forward": set(), "backward": set()}

    class Recorder(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen["forward"].add(threading.get_ident())
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen["backward"].add(threading.get_ident())
            return g

    class Big(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(256, 512), nn.Linear(512, 10)

        def forward(self, x):
            return self.b(torch.relu(Recorder.apply(self.a(x))))

    model = cs.DataParallel(Big(), device_ids=_devices(2))
    x, y = torch.randn(256, 256), torch.randint(0, 10, (256,))
    for _ in range(6):  # the engine probes the work before it runs replicas at once
        seen = {"forward": set(), "backward": set()}
        F.cross_entropy(model(x), y).backward()
    assert model.strategy.extended.execution == "concurrent"
    assert len(seen["forward"]) == 2 and len(seen["backward"]) == 2


def test_a_second_backward_through_the_same_output_is_refused():
    model = cs.DataParallel(_make(_mlp), device_ids=_devices(2))
    loss = model(torch.randn(4, 8)).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


@pytest.mark.parametrize("kwargs,error,match", [
    ({"module": "not a module"}, TypeError, "torch.nn.Module"),
    ({"dim": -1}, TypeError, "dim must be an int"),
    ({"dim": 1.0}, TypeError, "dim must be an int"),
    ({"device_ids": "CPU:0"}, TypeError, "did you mean"),
    ({"device_ids": ["CPU:0", "CPU:0"]}, cs.DeviceError, "twice"),
    ({"device_ids": ["TPU:0"]}, cs.DeviceError, "TPU"),
    ({"device_ids": []}, cs.DeviceError, "empty"),
    ({"device_ids": 3.5}, TypeError, "list of devices"),
    ({"device_ids": [True]}, TypeError, "a device must be"),
    ({"device_ids": [0, 1]} if not torch.cuda.is_available() else {"device_ids": [99]},
     cs.DeviceError, "GPU:"),  # ints are CUDA indices, as in torch
    ({"device_ids": _devices(2), "output_device": "XPU:0"}, cs.DeviceError, "XPU"),
])
def test_bad_arguments_say_what_is_wrong(kwargs, error, match):
    kwargs = {"module": nn.Linear(2, 2), **kwargs}
    with pytest.raises(error, match=match):
        cs.DataParallel(**kwargs)


@pytest.mark.parametrize("args,match", [
    ((), "has none"),
    ((torch.tensor(1.0),), "shape \\(\\)"),
    ((torch.ones(0, 2),), "empty batch"),
])
def test_bad_inputs_say_what_is_wrong(args, match):
    model = cs.DataParallel(nn.Linear(2, 2), device_ids=_devices(2))
    with pytest.raises(ValueError, match=match):
        model(*args)


def test_a_module_on_several_devices_needs_a_parameter_device():
    module = nn.Linear(2, 2)
    module.register_buffer("meta", torch.empty(1, device="meta"))
    with pytest.raises(cs.DeviceError, match="several devices"):
        cs.DataParallel(module, device_ids=_devices(2))


# -- the example ----------------------------------------------------------------------------
def test_the_example_trains_both_models(capsys):
    path = Path(__file__).resolve().parents[2] / "examples" / "data_parallel.py"
    example = runpy.run_path(str(path))  # __name__ is not "__main__": nothing runs yet
    results = example["main"](["--epochs", "1"])
    assert set(results) == {"mlp", "hf_style"}
    assert all(value > 0.5 for value in results.values())  # chance is 0.1
    assert capsys.readouterr().out.count("held-out accuracy") == 2


def test_a_collectives_backward_outside_any_run_says_how_to_get_one():
    # strategy.run's outputs backpropagated in cross-replica context: the synchronized
    # BatchNorm's replicas cannot meet there; DataParallel's backward is a run
    strategy = cs.CentralStorageStrategy(_devices(2), "CPU:0")
    with strategy.scope():
        model = _make(_bn_mlp)
    x = _batches(10)[0][0]
    out = strategy.run(model, args=(cs.PerReplica([x[:5], x[5:]]),))
    loss = sum(o.sum() for o in strategy.experimental_local_results(out))
    with pytest.raises(RuntimeError, match="DataParallel"):
        loss.backward()
