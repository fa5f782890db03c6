"""A model built outside ``strategy.scope()`` ("build, then wrap") trains exactly as one
built inside (issue 24): from its first call inside a replica on it is served as in-scope
modules are (central parameters, per-replica buffers, synchronized BatchNorm), or refused
naming it when it cannot be (another device, another strategy)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import csrun.core as cs
from csrun.core.distribute import context, parameters, torch_internals
from csrun.core.distribute.broadcast import DeviceMirror

TORCH_MODULE_CALL = nn.Module.__call__
TORCHS_DICT = type(nn.Module().__dict__["_parameters"])  # dict (OrderedDict before torch 2.5)


def _strategy(n=2, **options):
    return cs.CentralStorageStrategy([f"CPU:{i}" for i in range(n)], "CPU:0",
                                     options=cs.StrategyOptions(**options))


def _net():
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _train(strategy, inside: bool, steps: int = 3, model=None):
    torch.manual_seed(0)
    if inside:
        with strategy.scope():
            model = _net()
    else:
        model = model if model is not None else _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # made before the first run
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(16, 4, generator=g), torch.randint(0, 2, (16,), generator=g))
            for _ in range(steps)]
    grads = []
    for x, y in strategy.experimental_distribute_dataset(data):
        opt.zero_grad()
        strategy.run(lambda a, b: F.cross_entropy(model(a), b, reduction="sum").div(16)
                     .backward(), args=(x, y))
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return model, grads


def _assert_same(a, b):
    (ma, ga), (mb, gb) = a, b
    for (name, x), y in zip(ma.state_dict().items(), mb.state_dict().values()):
        torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5, msg=name)
    for step_a, step_b in zip(ga, gb):
        for x, y in zip(step_a, step_b):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("execution", ["auto", "ordered", "concurrent"])
def test_a_batch_norm_model_built_outside_trains_as_one_built_inside(execution, copy):
    one_device = _train(_strategy(1), inside=True)
    outside = _train(_strategy(2, execution=execution, copy_parameters=copy), inside=False)
    _assert_same(outside, one_device)  # num_batches_tracked counted once, statistics global
    inside = _train(_strategy(2, execution=execution, copy_parameters=copy), inside=True)
    _assert_same(outside, inside)


def test_it_is_served_from_its_first_call_with_its_own_tensors():
    strategy = _strategy(2)
    model = _net()
    tensors = [*model.parameters(), *model.buffers()]
    strategy.run(lambda: None)  # a run that does not call it leaves it alone
    assert type(torch_internals.tensor_dicts(model[0])[0]) is not parameters.ServedDict
    strategy.run(lambda x: model(x).sum(), args=(torch.ones(4, 4),))
    for module in (model[0], model[1], model[3]):
        assert all(isinstance(d, parameters.ServedDict) and d.store is strategy.extended.store
                   for d in torch_internals.tensor_dicts(module))
    assert "forward" in model[1].__dict__  # BatchNorm synchronized, as in scope
    assert [*model.parameters(), *model.buffers()] == tensors  # the same objects
    assert all(strategy.extended.variable_created_in_scope(p) for p in model.parameters())


def test_a_module_first_used_in_a_later_run_is_served_too():
    strategy = _strategy(2)
    with strategy.scope():
        body = nn.Linear(4, 8)
    x = torch.ones(4, 4)
    for _ in range(3):
        strategy.run(lambda v: body(v).sum(), args=(x,))
    head = nn.BatchNorm1d(8)
    strategy.run(lambda v: head(body(v)).sum(), args=(x,))
    assert isinstance(torch_internals.tensor_dicts(head)[1], parameters.ServedDict)
    assert int(head.num_batches_tracked) == 1  # once, not once per replica


def test_a_module_added_to_an_in_scope_model_is_served():
    strategy = _strategy(2)
    with strategy.scope():
        model = nn.Sequential(nn.Linear(4, 4))
    model.append(nn.BatchNorm1d(4))  # built outside, joined later
    strategy.run(lambda v: model(v).sum(), args=(torch.randn(4, 4),))
    assert int(model[1].num_batches_tracked) == 1


def test_module_calls_outside_runs_are_torchs_unchanged():
    # csrun's Module.__call__ stands while a strategy lives (it goes with the last one:
    # test_torch_internals); outside a replica it is torch's call and nothing else
    strategy = _strategy(2)
    model = nn.Linear(2, 2)
    seen = []
    strategy.run(lambda x: seen.append(nn.Module.__call__ is not TORCH_MODULE_CALL)
                 or model(x), args=(torch.ones(1, 2),))
    assert seen == [True, True]
    with pytest.raises(ZeroDivisionError):
        strategy.run(lambda: 1 / 0)
    x, other = torch.ones(3, 2), nn.Linear(2, 2)
    assert torch.equal(other(x), TORCH_MODULE_CALL(other, x))
    assert type(other.__dict__["_parameters"]) is TORCHS_DICT  # not adopted by a call outside


def test_a_module_of_another_strategy_is_refused_naming_it():
    other, strategy = _strategy(2), _strategy(2)
    with other.scope():
        norm = nn.BatchNorm1d(3)
    model = nn.Sequential(nn.Linear(3, 3), norm)
    with pytest.raises(RuntimeError, match=r"BatchNorm1d\(3, eps=1e-05.*\) was built in "
                                           "another strategy's scope"):
        strategy.run(lambda x: model(x), args=(torch.ones(4, 3),))
    owner = nn.Linear(3, 3)  # a module with tensors of its own: named with its path
    owner.norm = norm
    with pytest.raises(RuntimeError, match=r"Linear\.norm \(BatchNorm1d\) was built in "
                                           "another strategy's scope"):
        strategy.run(lambda x: owner(x), args=(torch.ones(4, 3),))


def test_a_module_on_another_device_is_refused_naming_it():
    strategy = _strategy(2)
    model = nn.Sequential(nn.ReLU(), nn.Linear(3, 3, device="meta"))
    with pytest.raises(RuntimeError, match=r"Linear\(in_features=3, out_features=3, bias=True"
                                           r"\) was built outside strategy\.scope\(\) and "
                                           "lives on meta"):
        strategy.run(lambda x: model(x), args=(torch.ones(4, 3),))
    assert type(model[1].__dict__["_parameters"]) is TORCHS_DICT  # left as it was


def test_a_compiled_model_built_outside_is_served():
    strategy = _strategy(2)
    model = _net()
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(8, 4)
    strategy.run(lambda v: compiled(v).sum().backward(), args=(x,))
    assert int(model[1].num_batches_tracked) == 1
    assert isinstance(torch_internals.tensor_dicts(model[1])[1], parameters.ServedDict)


@pytest.mark.parametrize("copy", [False, True])
def test_a_replica_calling_a_module_that_another_is_adopting_waits_for_it(copy, monkeypatch):
    """Concurrent replicas both make the first call of a module built outside: one adopts
    it, and the other must not run it before it is served (its tensors tracked, BatchNorm
    synchronized). The adopting replica holds still in the middle of adopting until the
    other has called the module: the interleaving a loaded machine makes now and then."""
    strategy = _strategy(2, execution="concurrent", copy_parameters=copy)
    norm = nn.BatchNorm1d(4)
    arrived, cond = {}, threading.Condition()

    def arrive(how):
        replica_id = cs.get_replica_context().replica_id_in_sync_group
        with cond:
            arrived.setdefault(replica_id, how)  # each replica's first call of norm
            cond.notify_all()

    adopt_in_use = parameters.ParameterStore.adopt_in_use
    register_tensor = parameters.ParameterStore.register_tensor

    def adopting(store, module):
        arrive("waited for its adoption")
        adopt_in_use(store, module)

    def registering(store, tensor):
        if context.current_serving() is not None:  # a replica adopting norm
            with cond:  # a guard against a hang, not a timing: the other comes at once
                assert cond.wait_for(lambda: len(arrived) == 2, timeout=60)
        register_tensor(store, tensor)

    monkeypatch.setattr(parameters.ParameterStore, "adopt_in_use", adopting)
    monkeypatch.setattr(parameters.ParameterStore, "register_tensor", registering)
    norm.register_forward_pre_hook(lambda module, args: arrive("ran it unserved"))
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    strategy.run(lambda v: norm(v).sum(), args=(x,))
    assert arrived == {0: "waited for its adoption", 1: "waited for its adoption"}
    assert int(norm.num_batches_tracked) == 1
    # synchronized: the variance of the global batch, x on each replica (a replica's own
    # would differ)
    torch.testing.assert_close(norm.running_var, 0.9 + 0.1 * torch.cat([x, x]).var(0))


def test_a_mirror_finds_a_tensor_registered_while_it_was_laid_out(monkeypatch):
    """A replica adopting a module registers its tensors at any moment, also while another
    replica's mirror lists the store's tensors: that replica's next read of them (one
    refresh when a tensor is missing) must find them."""
    strategy = _strategy(2, copy_parameters=True)
    store = strategy.extended.store
    with strategy.scope():
        nn.Linear(2, 2)
    late = nn.Parameter(torch.arange(3.0))
    listed = store.tensors

    def listing():  # the other replica registers `late` just after the listing
        tensors = listed()
        if not store.owns(late):
            store.register_tensor(late)
        return tensors

    monkeypatch.setattr(store, "tensors", listing)
    mirror = DeviceMirror(torch.device("cpu"), torch.device("cpu"))
    mirror.refresh(store, force=True)  # a run's first read
    mirror.refresh(store, reset_grads=False)  # a read that missed refreshes once
    assert torch.equal(mirror.leaf(late), late)
