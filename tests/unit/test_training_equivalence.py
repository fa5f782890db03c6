"""Training on 1, 2 or 3 replicas equals training on one device.

The README's rule (and ``sgd_linear_model``, pinned in test_golden_sgd_linear_model.py):
N-replica training with the loss scaled by the *global* batch equals single-device training.
Here with an MLP 8-16-16-3 (ReLU), 20 steps, SGD (with momentum) and Adam, on global
batches of 12 (splits evenly over 1, 2, 3 replicas) and 10 (uneven over 3: 4, 4, 2), loss =
cross-entropy with sum reduction / global batch, ``loss.backward()`` inside the replica
function and ``optimizer.step()`` after ``strategy.run``. Every case runs with the default
options and with ``StrategyOptions(copy_parameters=True)`` (the copy path GPU replicas use).

BatchNorm created in scope is synchronized across replicas by default, so parameters AND
running statistics match the single-device loop (checked with 2 and 3 replicas, and with 1,
where the layer runs its own forward); with ``sync_batch_norm=False`` the running
mean of a BatchNorm over the inputs still matches when the batch splits evenly (MEAN of the
replicas' running means over equal-size slices).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import csrun.core as cs

STEPS = 20
TOL = 1e-5
SEED = 1234


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def _bn_mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 3))


def _input_bn_model():
    return torch.nn.Sequential(torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))


def _optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return torch.optim.Adam(params, lr=0.01)


def _batches(batch_size):
    gen = torch.Generator().manual_seed(SEED + batch_size)
    xs = torch.randn(STEPS * batch_size, 8, generator=gen)
    ys = torch.randint(0, 3, (STEPS * batch_size,), generator=gen)
    return list(zip(xs.split(batch_size), ys.split(batch_size)))


def _reference(make_model, opt_kind, batches):
    torch.manual_seed(SEED)
    model = make_model()
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    opt = _optimizer(opt_kind, model.parameters())
    model.train()
    for x, y in batches:
        loss = F.cross_entropy(model(x), y, reduction="sum") / len(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return initial, model.state_dict()


def _distributed(make_model, opt_kind, batches, num_replicas, initial, **options):
    s = cs.CentralStorageStrategy([f"CPU:{i}" for i in range(1, num_replicas + 1)], "CPU:0",
                                  options=cs.StrategyOptions(**options))
    with s.scope():
        torch.manual_seed(SEED)
        model = make_model()
        model.load_state_dict(initial)
        opt = _optimizer(opt_kind, model.parameters())
    model.train()
    dist = s.experimental_distribute_dataset(batches)
    for (x, y), (gx, _) in zip(dist, batches):
        global_batch = len(gx)

        def step(xr, yr):
            loss = F.cross_entropy(model(xr), yr, reduction="sum") / global_batch
            loss.backward()
            return loss

        losses = s.run(step, args=(x, y))
        opt.step()
        opt.zero_grad()
        total = s.reduce(cs.ReduceOp.SUM, losses, axis=None)
        assert torch.isfinite(total)
    for p in model.parameters():
        assert p.device == s.extended.parameter_device.torch_device
    return model.state_dict()


def _assert_same(got, want, keys=None):
    keys = list(want) if keys is None else keys
    assert set(keys) <= set(got)
    for key in keys:
        a, b = got[key], want[key]
        assert a.shape == b.shape and a.dtype == b.dtype, key
        if a.is_floating_point():
            diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            assert diff <= TOL, f"{key}: max abs diff {diff}"
        else:
            assert torch.equal(a, b), f"{key}: {a} != {b}"


@pytest.mark.parametrize("copy", [False, True], ids=["alias", "copy"])
@pytest.mark.parametrize("batch_size", [12, 10])
@pytest.mark.parametrize("opt_kind", ["sgd", "adam"])
@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_mlp_matches_single_device(num_replicas, opt_kind, batch_size, copy):
    batches = _batches(batch_size)
    initial, want = _reference(_mlp, opt_kind, batches)
    got = _distributed(_mlp, opt_kind, batches, num_replicas, initial, copy_parameters=copy)
    # the training moved the parameters (the comparison is not vacuous)
    assert any((initial[k] - want[k]).abs().max() > 1e-3 for k in want)
    _assert_same(got, want)


@pytest.mark.parametrize("copy", [False, True], ids=["alias", "copy"])
@pytest.mark.parametrize("batch_size", [12, 10])
@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_batch_norm_synchronized_matches_single_device(num_replicas, batch_size, copy):
    batches = _batches(batch_size)
    initial, want = _reference(_bn_mlp, "sgd", batches)
    got = _distributed(_bn_mlp, "sgd", batches, num_replicas, initial, copy_parameters=copy)
    assert {"1.running_mean", "1.running_var", "1.num_batches_tracked"} <= set(want)
    assert int(want["1.num_batches_tracked"]) == STEPS
    _assert_same(got, want)  # parameters and running_mean/var/num_batches_tracked


@pytest.mark.parametrize("copy", [False, True], ids=["alias", "copy"])
@pytest.mark.parametrize("num_replicas", [2, 3])
def test_batch_norm_unsynchronized_running_mean_on_even_split(num_replicas, copy):
    batches = _batches(12)  # 12 splits evenly over 2 and 3 replicas
    initial, want = _reference(_input_bn_model, "sgd", batches)
    got = _distributed(_input_bn_model, "sgd", batches, num_replicas, initial,
                       copy_parameters=copy, sync_batch_norm=False)
    _assert_same(got, want, keys=["0.running_mean", "0.num_batches_tracked"])


def test_sync_batch_norm_is_on_by_default():
    assert cs.StrategyOptions().sync_batch_norm is True
    assert cs.StrategyOptions().copy_parameters is False
