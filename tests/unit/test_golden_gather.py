"""strategy.gather (with its docstring examples).

Golden cases: ``gather_doc_example_1``, ``gather_edge_cases``.
Not applicable: ``tf_function_axis0`` (tf.function; its value equals the eager one, which is
pinned). TF's ``InvalidArgumentError`` (concat of scalars, axis out of range) is a
``ValueError`` in csrun (deviation 11).
"""

from __future__ import annotations

import pytest
import torch


def _doc1_values(s):
    return s.experimental_distribute_values_from_function(
        lambda _: torch.tensor([[1], [2]], dtype=torch.int32).clone())


@pytest.mark.parametrize("key,axis", [("eager_axis0", 0), ("eager_axis1", 1),
                                      ("eager_axis_minus1", -1)])
def test_gather_doc_example_1(key, axis, golden, strategy, expect_golden):
    out = golden["gather_doc_example_1"]["outputs"]
    s = strategy(2)
    got = s.gather(_doc1_values(s), axis=axis)
    expect_golden(got, out[key]["result"])
    assert out["tf_function_axis0"]["result"] == out["eager_axis0"]["result"]


def test_gather_doc_example_1_out_of_range_axis(golden, strategy):
    assert golden["gather_doc_example_1"]["outputs"]["eager_axis2_out_of_range"]["error"]
    s = strategy(2)
    with pytest.raises(ValueError, match="axis"):
        s.gather(_doc1_values(s), axis=2)


def test_gather_doc_example_1_result_device(golden, strategy):
    out = golden["gather_doc_example_1"]["outputs"]["result_device"]["result"]
    assert out == "/job:localhost/replica:0/task:0/device:CPU:0"
    s = strategy(2)
    assert s.gather(_doc1_values(s), axis=0).device == torch.get_default_device()


@pytest.mark.parametrize("axis,shape", [(0, (4, 2, 3)), (1, (1, 8, 3)), (2, (1, 2, 12))])
def test_gather_doc_example_2_four_replicas(axis, shape, strategy):
    # Docstring: 4 replicas, single_tensor = reshape(range(6), (1, 2, 3)); axis=0 gives
    # shape (4, 2, 3) with the block repeated; axis 1 and 2 concatenate along those axes.
    s = strategy(4)
    single_tensor = torch.arange(6, dtype=torch.int32).reshape(1, 2, 3)
    dist = s.experimental_distribute_values_from_function(lambda _: single_tensor.clone())
    got = s.gather(dist, axis=axis)
    assert tuple(got.shape) == shape and got.dtype == torch.int32
    assert torch.equal(got, torch.cat([single_tensor] * 4, dim=axis))
    if axis == 0:
        assert got.tolist() == [[[0, 1, 2], [3, 4, 5]]] * 4


def test_gather_edge_cases_varying_and_ragged(golden, strategy, expect_golden):
    out = golden["gather_edge_cases"]["outputs"]
    s = strategy(2)
    varying = s.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([ctx.replica_id_in_sync_group,
                                  ctx.replica_id_in_sync_group + 10], dtype=torch.int32))
    expect_golden(s.gather(varying, axis=0), out["varying_axis0"]["result"])
    ragged = s.experimental_distribute_values_from_function(
        lambda ctx: torch.arange(2 + ctx.replica_id_in_sync_group, dtype=torch.int32))
    expect_golden(s.gather(ragged, axis=0), out["ragged_axis0"]["result"])


def test_gather_edge_cases_scalars_are_value_errors(golden, strategy):
    out = golden["gather_edge_cases"]["outputs"]
    s = strategy(2)
    assert out["rank0"]["error"]["type"] == "InvalidArgumentError"
    rank0 = s.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(ctx.replica_id_in_sync_group))
    with pytest.raises(ValueError, match="scalar|0-d"):
        s.gather(rank0, axis=0)
    assert out["python_ints"]["error"]["type"] == "InvalidArgumentError"
    ints = s.experimental_distribute_values_from_function(lambda ctx: ctx.num_replicas_in_sync)
    with pytest.raises(ValueError, match="scalar|0-d"):
        s.gather(ints, axis=0)


def test_gather_edge_cases_plain_tensor(golden, strategy, expect_golden):
    out = golden["gather_edge_cases"]["outputs"]
    s = strategy(2)
    expect_golden(s.gather(torch.tensor([1, 2], dtype=torch.int32), axis=0),
                  out["plain_tensor"]["result"])


def test_gather_edge_cases_empty_replica(golden, strategy, expect_golden):
    out = golden["gather_edge_cases"]["outputs"]
    s = strategy(2)
    (x,) = list(s.experimental_distribute_dataset([torch.arange(1)]))
    expect_golden(list(s.experimental_local_results(x)), out["empty_replica_values"])
    expect_golden(s.gather(x, axis=0), out["empty_replica_gather"]["result"])
    expect_golden(s.reduce("SUM", x, axis=0), out["empty_replica_reduce_SUM_axis0"]["result"])
    expect_golden(s.reduce("MEAN", x, axis=0),
                  out["empty_replica_reduce_MEAN_axis0"]["result"])
    assert out["empty_replica_reduce_SUM_axis_None"]["error"]["type"] == "InvalidArgumentError"
    with pytest.raises(ValueError, match="shape"):
        s.reduce("SUM", x, axis=None)


def test_gather_nest_and_replica_context(strategy):
    s = strategy(2)
    dist = s.experimental_distribute_values_from_function(
        lambda ctx: {"a": torch.tensor([ctx.replica_id_in_sync_group])})
    assert s.gather(dist, axis=0)["a"].tolist() == [0, 1]
    # docstring: gather can only be called in the cross-replica context
    with pytest.raises(RuntimeError, match="cross-replica"):
        s.run(lambda: s.gather(dist, axis=0))
