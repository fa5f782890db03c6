"""The tiny linear model trained 3 SGD steps: N replicas must reproduce TF's W and b.

Golden cases: ``sgd_linear_model`` (R=1, 2, 3; loss scaled by the global batch) and
``sgd_linear_model_unscaled_loss`` (R=2; each replica's mean loss, so gradients are summed
over replicas: the update is twice the single-device one).

pred = x @ W + b; per-example loss = sum((pred - y)^2, axis=1); a replica's loss is
``sum(per_example) / 8`` (TF's ``compute_average_loss`` with global batch 8); SGD lr 0.1.
The loss "reported" at each step is ``strategy.reduce(SUM, losses, axis=None)`` computed
before that step's update. Four ways to update, as TF recorded them:

* ``keras_SGD`` / ``v1_GradientDescentOptimizer`` -> ``torch.optim.SGD`` on a module
  created in scope, ``loss.backward()`` inside the replica, ``optimizer.step()`` after run;
* ``assign_sub_in_replica_SUM_agg`` -> Variables with SUM aggregation, each replica calls
  ``assign_sub(lr * its_grad)``;
* ``all_reduce_then_merge_assign`` -> ``all_reduce(SUM, grads)``, then ``merge_call`` with
  ``extended.update`` applying the summed gradient once;
* ``return_grads_reduce_assign`` -> run returns the gradients, ``reduce(SUM)`` them and
  ``assign_sub`` in cross-replica context.

Tolerance 1e-6 (float32). Not applicable: ``opt_slot_or_iter_device`` (Keras/TF optimizer
internals); the float64 numpy reference is checked loosely against the float32 runs.
"""

from __future__ import annotations

import pytest
import torch

import csrun.core as cs

LR = 0.1
TOL = 1e-6
SUM = cs.ReduceOp.SUM


def _data(golden):
    inp = golden["sgd_linear_model"]["inputs"]
    x = torch.tensor(inp["x"], dtype=torch.float32)
    y = torch.tensor(inp["y"], dtype=torch.float32)
    w0 = torch.tensor(inp["W0"], dtype=torch.float32)
    b0 = torch.tensor(inp["b0"], dtype=torch.float32)
    assert inp["lr"] == LR and inp["steps"] == 3 and x.shape == (8, 3)
    return x, y, w0, b0


def _loss(pred, y, scaled):
    per_example = ((pred - y) ** 2).sum(dim=1)
    return per_example.sum() / 8 if scaled else per_example.mean()


class _Linear(torch.nn.Module):
    def __init__(self, w0, b0):
        super().__init__()
        self.W = torch.nn.Parameter(w0.clone())
        self.b = torch.nn.Parameter(b0.clone())

    def forward(self, x):
        return x @ self.W + self.b


def _train_optimizer(s, data, scaled):
    x, y, w0, b0 = data
    with s.scope():
        model = _Linear(w0, b0)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for _ in range(3):
        (xb, yb), = list(s.experimental_distribute_dataset([(x, y)]))

        def step(xr, yr):
            loss = _loss(model(xr), yr, scaled)
            loss.backward()
            return loss

        losses = s.run(step, args=(xb, yb))
        opt.step()
        opt.zero_grad()
        history.append((s.reduce(SUM, losses, axis=None), model.W.detach().clone(),
                        model.b.detach().clone()))
    return history


def _replica_grads(W, b, xr, yr, scaled):
    wv, bv = W.read_value(), b.read_value()
    loss = _loss(xr @ wv + bv, yr, scaled)
    gw, gb = torch.autograd.grad(loss, [wv, bv])
    return loss.detach(), gw, gb


def _variables(s, data, aggregation="NONE"):
    _, _, w0, b0 = data
    with s.scope():
        return cs.Variable(w0, aggregation=aggregation), cs.Variable(b0, aggregation=aggregation)


def _train_assign_sub_in_replica(s, data, scaled):
    x, y, _, _ = data
    W, b = _variables(s, data, "SUM")
    history = []
    for _ in range(3):
        (xb, yb), = list(s.experimental_distribute_dataset([(x, y)]))

        def step(xr, yr):
            loss, gw, gb = _replica_grads(W, b, xr, yr, scaled)
            W.assign_sub(LR * gw)
            b.assign_sub(LR * gb)
            return loss

        losses = s.run(step, args=(xb, yb))
        history.append((s.reduce(SUM, losses, axis=None), W.tensor.detach().clone(),
                        b.tensor.detach().clone()))
    return history


def _train_all_reduce_then_merge(s, data, scaled):
    x, y, _, _ = data
    W, b = _variables(s, data)
    history = []

    def apply(strategy, gw, gb):
        gw0 = strategy.experimental_local_results(gw)[0]
        gb0 = strategy.experimental_local_results(gb)[0]
        strategy.extended.update(W, lambda var, g: var.assign_sub(LR * g), args=(gw0,))
        strategy.extended.update(b, lambda var, g: var.assign_sub(LR * g), args=(gb0,))

    for _ in range(3):
        (xb, yb), = list(s.experimental_distribute_dataset([(x, y)]))

        def step(xr, yr):
            loss, gw, gb = _replica_grads(W, b, xr, yr, scaled)
            ctx = cs.get_replica_context()
            gw, gb = ctx.all_reduce(SUM, [gw, gb])
            ctx.merge_call(apply, args=(gw, gb))
            return loss

        losses = s.run(step, args=(xb, yb))
        history.append((s.reduce(SUM, losses, axis=None), W.tensor.detach().clone(),
                        b.tensor.detach().clone()))
    return history


def _train_return_grads(s, data, scaled):
    x, y, _, _ = data
    W, b = _variables(s, data)
    history = []
    for _ in range(3):
        (xb, yb), = list(s.experimental_distribute_dataset([(x, y)]))
        losses, gw, gb = s.run(lambda xr, yr: _replica_grads(W, b, xr, yr, scaled),
                               args=(xb, yb))
        gw, gb = s.reduce(SUM, [gw, gb], axis=None)
        with s.scope():
            W.assign_sub(LR * gw)
            b.assign_sub(LR * gb)
        history.append((s.reduce(SUM, losses, axis=None), W.tensor.detach().clone(),
                        b.tensor.detach().clone()))
    return history


_MECHANISMS = {
    "keras_SGD": _train_optimizer,
    "v1_GradientDescentOptimizer": _train_optimizer,
    "assign_sub_in_replica_SUM_agg": _train_assign_sub_in_replica,
    "all_reduce_then_merge_assign": _train_all_reduce_then_merge,
    "return_grads_reduce_assign": _train_return_grads,
}


def _check_history(history, recorded):
    assert len(history) == len(recorded) == 3
    for i, ((loss, W, b), rec) in enumerate(zip(history, recorded)):
        reported = rec["loss_reported"]
        assert abs(float(loss.detach()) - reported) <= TOL * max(1.0, abs(reported)), \
            (i, float(loss.detach()), reported)
        assert W.dtype == torch.float32 and b.dtype == torch.float32
        w_diff = (W.flatten().double() - torch.tensor(rec["W"], dtype=torch.float64)).abs().max()
        b_diff = (b.flatten().double() - torch.tensor(rec["b"], dtype=torch.float64)).abs().max()
        assert float(w_diff) <= TOL, (i, W.flatten().tolist(), rec["W"])
        assert float(b_diff) <= TOL, (i, b.flatten().tolist(), rec["b"])


def test_sgd_linear_model_keys_cover_golden(golden):
    out = golden["sgd_linear_model"]["outputs"]
    expected = {f"R{r} {m}" for r in (1, 2, 3) for m in _MECHANISMS}
    assert set(out) - {"numpy_float64_reference", "single_device_tf_float32"} == expected


@pytest.mark.parametrize("copy", [False, True], ids=["alias", "copy"])
@pytest.mark.parametrize("mechanism", list(_MECHANISMS))
@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_sgd_linear_model(num_replicas, mechanism, copy, golden, strategy):
    rec = golden["sgd_linear_model"]["outputs"][f"R{num_replicas} {mechanism}"]["result"]
    assert rec["W_device"] == "/job:localhost/replica:0/task:0/device:CPU:0"
    s = strategy(num_replicas, copy_parameters=copy)
    history = _MECHANISMS[mechanism](s, _data(golden), scaled=True)
    _check_history(history, rec["history"])


def test_sgd_linear_model_single_device_reference(golden):
    """Plain PyTorch (no strategy) reproduces TF's single-device float32 run, and both
    agree with the float64 numpy reference to float32 accuracy."""
    out = golden["sgd_linear_model"]["outputs"]
    x, y, w0, b0 = _data(golden)
    model = _Linear(w0, b0)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    history = []
    for _ in range(3):
        loss = _loss(model(x), y, scaled=True)
        loss.backward()
        opt.step()
        opt.zero_grad()
        history.append((loss.detach(), model.W.detach().clone(), model.b.detach().clone()))
    _check_history(history, out["single_device_tf_float32"])
    for (loss, W, b), ref in zip(history, out["numpy_float64_reference"]):
        assert abs(float(loss) - ref["loss_before_step"]) < 1e-5
        assert torch.allclose(W.flatten().double(), torch.tensor(ref["W"], dtype=torch.float64),
                              atol=1e-5)


@pytest.mark.parametrize("copy", [False, True], ids=["alias", "copy"])
@pytest.mark.parametrize("mechanism", ["keras_SGD", "v1_GradientDescentOptimizer",
                                       "return_grads_reduce_assign"])
def test_sgd_linear_model_unscaled_loss(mechanism, copy, golden, strategy):
    out = golden["sgd_linear_model_unscaled_loss"]["outputs"]
    rec = out[f"R2 {mechanism}"]["result"]
    s = strategy(2, copy_parameters=copy)
    history = _MECHANISMS[mechanism](s, _data(golden), scaled=False)
    _check_history(history, rec["history"])
    # the reference: the single-device update with the gradient doubled
    for (_, W, b), ref in zip(history, out["numpy_reference_grad_times_2"]):
        assert torch.allclose(W.flatten().double(), torch.tensor(ref["W"], dtype=torch.float64),
                              atol=1e-5)
        assert torch.allclose(b.flatten().double(), torch.tensor(ref["b"], dtype=torch.float64),
                              atol=1e-5)
