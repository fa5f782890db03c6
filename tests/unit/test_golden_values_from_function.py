"""experimental_distribute_values_from_function (with its four docstring examples).

Golden cases: ``dvff_doc1_constant``, ``dvff_doc2_numpy_index``, ``dvff_doc3_num_replicas``,
``dvff_doc4_place_on_devices``, ``dvff_value_context``.

``tf.constant(x)`` is ``torch.tensor(x)``; a tensor TF creates "on CPU:0" is created on
torch's cpu; TF's recorded component device k is ``strategy.extended.worker_devices[k]``
(deviation 12). TF's int32 for Python ints (``tf.constant(7)``) is torch's int64: values
are compared, not that dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import csrun.core as cs


def _check_distributed(s, dist, rec, check_dtype=True, expect_golden=None):
    assert type(dist).__name__ == rec["distributed_type"]
    local = s.experimental_local_results(dist)
    assert type(local).__name__ == rec["local_results_container"]
    expect_golden(list(local), rec["local_results"], check_dtype=check_dtype)
    return local


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_dvff_doc1_constant(num_replicas, golden, strategy, expect_golden):
    rec = golden["dvff_doc1_constant"]["outputs"][f"R{num_replicas}"]
    s = strategy(num_replicas)
    dist = s.experimental_distribute_values_from_function(lambda ctx: torch.tensor(1.0))
    local = _check_distributed(s, dist, rec, expect_golden=expect_golden)
    assert all(isinstance(v, torch.Tensor) for v in local)
    # TF creates them on the current device (CPU:0): torch's cpu
    assert rec["local_result_devices"] == ["/job:localhost/replica:0/task:0/device:CPU:0"] * \
        num_replicas
    assert all(v.device == torch.device("cpu") for v in local)


def test_dvff_doc1_constant_one_replica_doc_output(strategy):
    # The docstring: local_result == (<tf.Tensor ... numpy=1.0>,)
    s = strategy(1)
    local = s.experimental_local_results(
        s.experimental_distribute_values_from_function(lambda ctx: torch.tensor(1.0)))
    assert isinstance(local, tuple) and len(local) == 1 and float(local[0]) == 1.0


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_dvff_doc2_numpy_index(num_replicas, golden, strategy, expect_golden):
    rec = golden["dvff_doc2_numpy_index"]["outputs"][f"R{num_replicas}"]
    s = strategy(num_replicas)
    array_value = np.array([3.0, 2.0, 1.0])
    dist = s.experimental_distribute_values_from_function(
        lambda ctx: array_value[ctx.replica_id_in_sync_group])
    local = _check_distributed(s, dist, rec, expect_golden=expect_golden)
    assert [f"{type(v).__module__}.{type(v).__name__}" for v in local] == \
        rec["local_result_pytypes"]


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_dvff_doc3_num_replicas(num_replicas, golden, strategy, expect_golden):
    rec = golden["dvff_doc3_num_replicas"]["outputs"][f"R{num_replicas}"]
    s = strategy(num_replicas)
    dist = s.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync)
    local = _check_distributed(s, dist, rec, expect_golden=expect_golden)
    assert [f"{type(v).__module__}.{type(v).__name__}" for v in local] == \
        rec["local_result_pytypes"]


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_dvff_doc4_place_on_devices(num_replicas, golden, strategy, expect_golden):
    rec = golden["dvff_doc4_place_on_devices"]["outputs"][f"R{num_replicas}"]
    s = strategy(num_replicas)
    multiple_values = [torch.tensor(1.0 + i, device=s.extended.torch_devices[i])
                       for i in range(s.num_replicas_in_sync)]
    dist = s.experimental_distribute_values_from_function(
        lambda ctx: multiple_values[ctx.replica_id_in_sync_group])
    local = _check_distributed(s, dist, rec, expect_golden=expect_golden)
    assert all(a is b for a, b in zip(local, multiple_values))  # the very tensors
    assert s.extended.worker_devices == rec["local_result_devices"]
    assert [v.device for v in local] == s.extended.torch_devices


def test_dvff_value_context_seen(golden, strategy):
    out = golden["dvff_value_context"]["outputs"]
    s = strategy(3)
    seen = []
    s.experimental_distribute_values_from_function(lambda ctx: seen.append(ctx))
    assert len(seen) == len(out["seen"])
    for ctx, rec in zip(seen, out["seen"]):
        assert isinstance(ctx, cs.ValueContext)
        assert ctx.replica_id_in_sync_group == rec["replica_id_in_sync_group"]
        assert type(ctx.replica_id_in_sync_group).__name__ == rec["rid_type"] == "int"
        assert ctx.num_replicas_in_sync == rec["num_replicas_in_sync"]
        ours = " ".join(str(ctx).split("ValueContext", 1)[1].split())
        theirs = " ".join(rec["str"].split("ValueContext", 1)[1].split())
        assert ours == theirs


def test_dvff_value_context_returns_none(golden, strategy):
    rec = golden["dvff_value_context"]["outputs"]["returns_None_R2"]["result"]
    s = strategy(2)
    dist = s.experimental_distribute_values_from_function(lambda ctx: None)
    assert type(dist).__name__ == rec["distributed_type"]
    assert list(s.experimental_local_results(dist)) == rec["local_results"] == [None, None]


def test_dvff_value_context_returns_dict(golden, strategy, expect_golden):
    rec = golden["dvff_value_context"]["outputs"]["returns_dict_R2"]["result"]
    s = strategy(2)
    dist = s.experimental_distribute_values_from_function(
        lambda ctx: {"x": torch.tensor(ctx.replica_id_in_sync_group)})
    assert type(dist).__name__ == rec["type"]
    assert set(dist) == set(rec["enc"])
    assert type(dist["x"]).__name__ == rec["enc"]["x"]["kind"]
    # TF int32 (tf.constant of a Python int) vs torch int64: values compared
    expect_golden(list(dist["x"].values), rec["enc"]["x"]["values"], check_dtype=False)


def test_dvff_value_context_R1_tensor(golden, strategy, expect_golden):
    rec = golden["dvff_value_context"]["outputs"]["R1_tensor"]
    s = strategy(1)
    dist = s.experimental_distribute_values_from_function(lambda ctx: torch.tensor(7))
    local = _check_distributed(s, dist, rec, check_dtype=False, expect_golden=expect_golden)
    assert isinstance(dist, cs.PerReplica) and len(local) == 1


def test_dvff_same_object_every_replica_stays_per_replica(golden, strategy, expect_golden):
    rec = golden["dvff_value_context"]["outputs"]["same_object_every_replica_R2"]["result"]
    s = strategy(2)
    same = torch.tensor(3.0)
    dist = s.experimental_distribute_values_from_function(lambda ctx: same)
    assert type(dist).__name__ == rec["type"] == "PerReplica"
    expect_golden(list(dist.values), rec["enc"]["values"])


def test_dvff_values_feed_run(strategy):
    s = strategy(3)
    dist = s.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group)))
    out = s.run(lambda x: x * 2, args=(dist,))
    assert [float(v) for v in s.experimental_local_results(out)] == [0.0, 2.0, 4.0]
