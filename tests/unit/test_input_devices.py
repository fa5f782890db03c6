"""Every replica's input reaches its own device, wherever the batch was (TF's
``experimental_fetch_to_device``).

This machine has only the CPU, so a second device is simulated: replica 1 of the
engine's replica -> device table is pointed at torch's ``meta`` device, which has no data
but a device of its own, so a slice left on the host shows. The real thing, a batch on
``cuda:0`` over ``[GPU:0, CPU:0]``, is in ``test_gpu_inputs.py``.
"""

from __future__ import annotations

import pytest
import torch

import csrun.core as cs
from csrun.core.distribute.scatter_gather import scatter, to_device

META = torch.device("meta")


@pytest.fixture
def strategy(monkeypatch):
    """Two replicas, replica 1's device ``meta`` in the engine's table."""
    s = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
    monkeypatch.setitem(s.extended.compute_devices[1].__dict__, "torch_device", META)
    return s


def _devices(s, value) -> list:
    return [v.device for v in s.experimental_local_results(value)]


def _table(s) -> list:
    return [d.torch_device for d in s.extended.compute_devices]


def test_a_distributed_datasets_slices_go_to_their_replicas_devices(strategy):
    x, y = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    step = next(iter(strategy.experimental_distribute_dataset([(x, {"y": y})])))
    assert _table(strategy) == [torch.device("cpu"), META]
    assert _devices(strategy, step[0]) == _devices(strategy, step[1]["y"]) == _table(strategy)
    first = strategy.experimental_local_results(step[0])
    assert first[0].data_ptr() == x.data_ptr()  # on its device already: a view, no copy
    assert first[1].shape == (3, 2)


def test_fetch_to_device_false_leaves_slices_where_the_dataset_made_them(strategy):
    options = cs.InputOptions(experimental_fetch_to_device=False)
    step = next(iter(strategy.experimental_distribute_dataset([torch.ones(4)], options)))
    assert _devices(strategy, step) == [torch.device("cpu")] * 2


@pytest.mark.parametrize("mode", ["PER_WORKER", "PER_REPLICA"])
def test_datasets_from_a_function_reach_their_replicas_devices(strategy, mode):
    options = cs.InputOptions(experimental_replication_mode=mode)
    dist = strategy.distribute_datasets_from_function(
        lambda ctx: [torch.ones(2, 3)] * 4, options)
    assert _devices(strategy, next(iter(dist))) == _table(strategy)


def test_values_from_a_function_move_to_their_replicas_devices(strategy):
    made = [torch.ones(2), torch.zeros(2)]
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: {"x": made[ctx.replica_id_in_sync_group], "n": 3})
    assert _devices(strategy, value["x"]) == _table(strategy)
    assert strategy.experimental_local_results(value["x"])[0] is made[0]  # not copied
    assert strategy.experimental_local_results(value["n"]) == (3, 3)


def test_dataparallels_scatter_puts_each_part_on_its_replica(monkeypatch):
    devices = [torch.device("cpu"), META]
    args, kwargs, counts = scatter((torch.ones(5, 2),), {"m": torch.ones(5)}, devices, 0)
    assert counts == [3, 2]
    assert [a[0].device for a in args] == [k["m"].device for k in kwargs] == devices
    args, _, counts = scatter((torch.ones(8, 2),), {}, devices, 0, lambda n: [n - 1, 1])
    assert counts == [7, 1] and [a[0].shape[0] for a in args] == [7, 1]
    assert to_device({"x": torch.ones(1)}, META)["x"].device == META
