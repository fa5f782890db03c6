"""run's arguments reach each replica on its own device (TF's ops read an input where it
is, copying it; torch's would fail): a plain tensor is copied once per device, a tensor
on the replica's device is passed as it is; numpy leaves of
``distribute_datasets_from_function`` become tensors. The devices other than the host's
are stood in for by ``meta`` here; tests/unit/test_gpu_inputs.py has the CUDA ones."""

import numpy as np
import pytest
import torch

import csrun.core as cs
from tests.helpers.op_count import OpCount

META, CPU = torch.device("meta"), torch.device("cpu")


@pytest.fixture
def cpu_and_meta():
    """Two replicas, the second on another torch device (meta stands in for a GPU)."""
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
    extended = strategy.extended
    extended._arg_devices, extended._places_args = [CPU, META], True
    return strategy


def test_a_plain_tensor_reaches_each_replica_on_its_device(cpu_and_meta):
    x = torch.arange(4.0)
    seen = cpu_and_meta.run(lambda v, scale=None: (v.device, scale.device, v * 2),
                            args=(x,), kwargs={"scale": x})
    devices = [d for d, _, _ in cpu_and_meta.experimental_local_results(seen)]
    assert devices == [CPU, META]
    kw_devices = [s for _, s, _ in cpu_and_meta.experimental_local_results(seen)]
    assert kw_devices == [CPU, META]


def test_each_device_gets_one_copy_and_its_own_replica_none(cpu_and_meta):
    x = torch.arange(4.0)
    got = []
    count = OpCount()
    with count.counting():
        cpu_and_meta.run(lambda a, b: got.append((a, b)), args=(x, x))
    by_device = {a.device: (a, b) for a, b in got}
    assert by_device[CPU][0] is x and by_device[CPU][1] is x  # its own: not copied
    assert by_device[META][0] is by_device[META][1]  # one copy for both arguments
    assert count.ops["_to_copy"] == 1


def test_per_replica_components_elsewhere_move_too(cpu_and_meta):
    values = cpu_and_meta.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group)))
    seen = cpu_and_meta.run(lambda v: v.device, args=(values,))
    assert list(cpu_and_meta.experimental_local_results(seen)) == [CPU, META]


def test_logical_cpu_replicas_pass_arguments_untouched():
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
    assert not strategy.extended._places_args  # nothing to check on a run: no cost
    x = torch.ones(2)
    got = strategy.run(lambda v: v, args=(x,))
    assert all(v is x for v in strategy.experimental_local_results(got))


def test_numpy_leaves_from_a_dataset_function_become_tensors():
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")

    def dataset_fn(ctx):
        return [(np.full((2, 3), float(i), dtype=np.float32), np.arange(2))
                for i in range(4)]
    batches = list(strategy.distribute_datasets_from_function(dataset_fn))
    for batch in batches:
        for part in batch:
            for value in strategy.experimental_local_results(part):
                assert isinstance(value, torch.Tensor)
    first = strategy.experimental_local_results(batches[0][0])
    assert first[0].dtype == torch.float32 and first[0].shape == (2, 3)
