"""A ps applies sparse Adagrad and SGD to the pushed rows alone, bit for bit as torch."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from csrun.core.cluster.optimizer_spec import optimizer_spec
from csrun.core.cluster.row_updates import row_update_exact, row_updater
from csrun.core.cluster.shards import HeldShards

SETTINGS = [
    (torch.optim.Adagrad, {"lr": 0.05, "eps": 1e-10}),
    (torch.optim.Adagrad, {"lr": 0.3, "lr_decay": 0.01, "initial_accumulator_value": 0.1,
                           "eps": 1e-3, "maximize": True}),
    (torch.optim.SGD, {"lr": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "maximize": True}),
]


def _pushes(rows: int, steps: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.unique(torch.randint(0, rows, (rows // 3,), generator=generator))
        yield ids, torch.randn(len(ids), 33, generator=generator)


@pytest.mark.parametrize("cls,settings", SETTINGS)
def test_row_updates_equal_torchs_sparse_update_bit_for_bit(cls, settings):
    start = torch.randn(500, 33)
    ours, theirs = (torch.nn.Parameter(start.clone()) for _ in range(2))
    mine, reference = cls([ours], **settings), cls([theirs], **settings)
    assert row_update_exact(cls, mine.param_groups[0])
    for ids, grad in _pushes(500, 5):
        row_updater(mine, mine.param_groups[0], ours)(ids, grad)
        with torch.sparse.check_sparse_tensor_invariants(enable=True):
            theirs.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grad, theirs.shape,
                                                  is_coalesced=True)
            reference.step()
    assert torch.equal(ours, theirs)
    for key, value in reference.state[theirs].items():
        assert torch.equal(mine.state[ours][key], value), key


@pytest.mark.parametrize("cls,settings", [
    (torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 0.01}),  # no sparse update at all
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),            # torch's own, not ours
    (torch.optim.Adam, {"lr": 0.1}),
])
def test_settings_a_row_update_does_not_cover_are_left_to_torch(cls, settings):
    weight = torch.nn.Parameter(torch.zeros(4, 2))
    optimizer = cls([weight], **settings)
    assert not row_update_exact(cls, optimizer.param_groups[0])
    assert row_updater(optimizer, optimizer.param_groups[0], weight) is None


class _TableOps(TorchDispatchMode):
    """The aten ops that read or write ``storage`` (a table's or a slot's)."""

    def __init__(self, storages):
        super().__init__()
        self.storages, self.ops, self.largest = storages, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        if any(isinstance(t, torch.Tensor) and not t.is_sparse and
               t.untyped_storage().data_ptr() in self.storages for t in flat):
            self.ops.append(func.__name__)
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_sparse and \
                    t.untyped_storage().data_ptr() not in self.storages:
                self.largest = max(self.largest, t.numel())
        return out


def _held(rows: int, start: torch.Tensor, optimizer: torch.optim.Optimizer) -> HeldShards:
    held = HeldShards(0)
    held.register({"with_values": "per_shard", "shards": [
        {"id": 0, "var": 0, "start": 0, "shape": [rows, 33], "rows": True,
         "dtype": "float32"}]}, [start.clone().view(-1)])
    held.make_optimizer(optimizer_spec(optimizer, {0: 0}))
    return held


def test_a_push_touches_the_pushed_rows_alone_and_equals_torchs_step():
    rows = 3000
    start = torch.randn(rows, 33)
    reference = torch.nn.Parameter(start.clone())
    adagrad = torch.optim.Adagrad([reference], lr=0.05, eps=1e-10)
    held = _held(rows, start, adagrad)
    table = held._vars[0]
    storages = {table.untyped_storage().data_ptr()} | {
        v.untyped_storage().data_ptr() for p in held._optimizers[0].state.values()
        for v in p.values() if isinstance(v, torch.Tensor) and v.dim()}
    for ids, grad in _pushes(rows, 4, seed=1):
        meta = {"dense": [], "rows": [[0, len(ids), "sparse"]], "settings": []}
        with _TableOps(storages) as seen:
            held.apply(meta, ids, [grad.reshape(-1)], "worker:0")
        # one gather and one scatter of the table and of Adagrad's sums, nothing else
        assert sorted(seen.ops) == sorted(["index_select.default", "index_copy_.default"] * 2)
        assert seen.largest < rows * 33 // 2  # nothing table-sized made
        with torch.sparse.check_sparse_tensor_invariants(enable=True):
            reference.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grad, (rows, 33),
                                                     is_coalesced=True)
            adagrad.step()
    assert torch.equal(table, reference)
    assert torch.equal(held._optimizers[0].state[table]["sum"], adagrad.state[reference]["sum"])
    assert held._optimizers[0].state[table]["step"] == 4
