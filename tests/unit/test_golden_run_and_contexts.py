"""strategy.run, replica/cross-replica contexts.

Golden cases: ``run_replica_ids``, ``context_predicates``, ``run_args_broadcast``,
``run_side_effect_order``, ``run_nested_and_misc``.

Not applicable: ``R*_tf_function`` entries and ``inside_run_tf_function_trace`` (tf.function
and trace-time info), ``thread_names_eager`` (TF's thread names), ``tf_function_two_runs``,
``exception_on_one_replica_tf_function``; TF's private class names (``_MirroredReplicaContext``,
``_DefaultDistributionStrategy``, ``_DefaultReplicaContext``) -- csrun's replica context is
:class:`csrun.core.ReplicaContext`.

Intended deviation 7: ``replica_id_in_sync_group`` is a Python int (TF: an int32 tensor), so
run results built from it are Python ints; run returns Python scalars unchanged; an output
that is the very same object on every replica is returned unwrapped, otherwise a PerReplica;
with one replica run returns the value itself.
"""

from __future__ import annotations

import pytest
import torch

import csrun.core as cs


def _rid():
    return cs.get_replica_context().replica_id_in_sync_group


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_run_replica_ids(num_replicas, golden, strategy):
    rec = golden["run_replica_ids"]["outputs"][f"R{num_replicas}_eager"]
    s = strategy(num_replicas)
    seen = []

    def fn():
        ctx = cs.get_replica_context()
        seen.append({
            "rid": ctx.replica_id_in_sync_group,
            "devices": [list(ctx.devices)],
            "num_replicas_in_sync": ctx.num_replicas_in_sync,
            "in_cross_replica_context": cs.in_cross_replica_context(),
            "has_strategy": cs.has_strategy(),
            "get_strategy_is_s": cs.get_strategy() is s,
            "device": ctx.device,
        })
        return ctx.replica_id_in_sync_group

    result = s.run(fn)
    local = s.experimental_local_results(result)
    assert list(local) == [r["value"] for r in rec["rid_results"]]
    assert all(type(v) is int for v in local)  # deviation 7
    if num_replicas == 1:
        assert rec["result_type"] == "EagerTensor" and result == 0
    else:
        assert type(result).__name__ == rec["result_type"] == "PerReplica"
    assert s.extended.worker_devices == rec["result_devices"]
    assert len(seen) == num_replicas
    for got, info in zip(seen, rec["trace_time_info"]):
        assert got["rid"] == info["rid_static"]
        assert got["devices"] == info["devices"]
        for key in ("num_replicas_in_sync", "in_cross_replica_context", "has_strategy",
                    "get_strategy_is_s"):
            assert got[key] == info[key], key
        assert got["device"] == torch.device("cpu")


def _predicates(s):
    replica = cs.get_replica_context()
    cross = cs.get_cross_replica_context()
    return {
        "in_cross_replica_context": cs.in_cross_replica_context(),
        "has_strategy": cs.has_strategy(),
        "get_strategy_is_S2": cs.get_strategy() is s,
        "replica_context_is_none": replica is None,
        "replica_context_is_replica": isinstance(replica, cs.ReplicaContext),
        "cross_replica_context_is_none": cross is None,
        "cross_replica_is_S2": cross is s,
    }


def _expected(rec):
    return {
        "in_cross_replica_context": rec["in_cross_replica_context"],
        "has_strategy": rec["has_strategy"],
        "get_strategy_is_S2": rec["get_strategy_is_S2"],
        "replica_context_is_none": rec["replica_context_type"] is None,
        "replica_context_is_replica": rec["replica_context_type"] is not None,
        "cross_replica_context_is_none": rec["cross_replica_context_type"] is None,
        "cross_replica_is_S2": rec["cross_replica_is_S2"],
    }


def test_context_predicates(golden, strategy):
    out = golden["context_predicates"]["outputs"]
    s = strategy(2)
    assert _predicates(s) == _expected(out["outside"])
    assert cs.get_strategy().num_replicas_in_sync == 1  # the default strategy
    with s.scope():
        assert _predicates(s) == _expected(out["inside_scope"])
        assert type(cs.get_cross_replica_context()).__name__ == \
            out["inside_scope"]["cross_replica_context_type"]
        inside = s.run(lambda: _predicates(s))
        for got, rec in zip(s.experimental_local_results(inside),
                            out["inside_run_eager_in_scope"]):
            assert got == _expected(rec)
    inside = s.run(lambda: _predicates(s))
    for got, rec in zip(s.experimental_local_results(inside),
                        out["inside_run_eager_outside_scope"]):
        assert got == _expected(rec)
    assert _predicates(s) == _expected(out["after_run_outside"])


def test_run_args_broadcast_plain_tensor(golden, strategy, expect_golden):
    out = golden["run_args_broadcast"]["outputs"]
    s = strategy(2)
    x = torch.tensor([1.0, 2.0])
    result = s.run(lambda v: (v * 2, v.device), args=(x,))
    doubled, devices = result
    expect_golden(list(s.experimental_local_results(doubled)), out["plain_tensor"])
    # TF: the input stays where it was created (CPU:0), on every replica
    assert [d["value"] for d in out["plain_tensor_input_devices"]["result"]] == \
        ["/job:localhost/replica:0/task:0/device:CPU:0"] * 2
    assert all(d == x.device for d in s.experimental_local_results(devices))


def test_run_args_broadcast_python_float(golden, strategy, expect_golden):
    out = golden["run_args_broadcast"]["outputs"]
    s = strategy(2)
    result = s.run(lambda v: v * 2, args=(3.0,))
    local = s.experimental_local_results(result)
    # deviation 7: Python scalars come back unchanged (floats, not tensors)
    assert out["python_float_run_output_type"]["result"] == "float"
    assert all(type(v) is float for v in local)
    assert list(local) == [6.0] * len(local)
    expect_golden([torch.tensor(v) for v in local], out["python_float"]["result"])


def test_run_args_broadcast_per_replica_and_kwargs(golden, strategy, expect_golden):
    out = golden["run_args_broadcast"]["outputs"]
    s = strategy(2)
    pr = s.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group)))
    expect_golden(list(s.experimental_local_results(s.run(lambda v: v * 2, args=(pr,)))),
                  out["per_replica"])
    pr1 = s.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group + 1)))
    result = s.run(lambda *, y: y, kwargs={"y": pr1})
    expect_golden(list(s.experimental_local_results(result)), out["kwargs"])


def test_run_returns_python_values(golden, strategy):
    out = golden["run_args_broadcast"]["outputs"]
    s = strategy(2)
    assert out["run_returns_None"]["result"] == "None"
    assert s.run(lambda: None) is None
    five = s.run(lambda: 5)
    assert five == out["run_returns_python_int"]["result"] == 5
    assert type(five).__name__ == out["run_returns_python_int_type"]["result"] == "int"
    varying = s.run(_rid)
    assert type(varying).__name__ == out["run_returns_replica_varying_python_int"]["result"][
        "kind"]
    assert list(varying.values) == [
        v["value"] for v in out["run_returns_replica_varying_python_int"]["result"]["values"]]
    captured = torch.tensor(1.0)
    got = s.run(lambda: captured)
    assert out["run_returns_captured_tensor_type"]["result"] == "EagerTensor"
    assert got is captured


def test_run_side_effect_order(golden, strategy):
    """TF's replica order, exactly, with execution="ordered"."""
    out = golden["run_side_effect_order"]["outputs"]
    s = strategy(3, execution="ordered")
    order = []
    for _ in range(2):
        s.run(lambda: order.append(_rid()))
    assert order == out["eager_two_runs"]


def test_run_side_effect_order_by_default(golden, strategy, work_clock):
    """By default quick replicas keep TF's order exactly. Deviation (docs/tf-parity.md):
    logical-CPU replicas with enough work each (>= 250 µs) run concurrently, so their
    side effects may interleave -- each replica still runs exactly once per run. Their
    work is the work_clock's: on a loaded machine real ones took longer, and switched."""
    out = golden["run_side_effect_order"]["outputs"]
    s = strategy(3)
    order = []
    for _ in range(2):
        s.run(lambda: order.append(_rid()))
    assert order == out["eager_two_runs"] and s.extended.execution == "ordered"

    def slow():
        work_clock.work(0.002)  # enough work per replica to be worth running at once
        order.append(_rid())
    order.clear()
    for _ in range(3):
        s.run(slow)
    assert s.extended.execution == "concurrent"
    assert sorted(order) == sorted(out["eager_two_runs"] + [0, 1, 2])


def test_run_nested_is_runtime_error(golden, strategy):
    assert golden["run_nested_and_misc"]["outputs"]["nested_run"]["error"]["type"] == \
        "RuntimeError"
    s = strategy(2)
    with pytest.raises(RuntimeError, match="cross-replica context"):
        s.run(lambda: s.run(lambda: 1))


def test_run_with_run_options(golden, strategy, expect_golden):
    out = golden["run_nested_and_misc"]["outputs"]
    s = strategy(2)
    got = s.run(lambda: torch.tensor(1.0), options=cs.RunOptions())
    expect_golden(list(s.experimental_local_results(got)), out["run_options"]["result"])
    with pytest.raises(TypeError, match="RunOptions"):
        s.run(lambda: 1, options="fast")


def test_extended_call_for_each_replica(golden, strategy):
    out = golden["run_nested_and_misc"]["outputs"]
    s = strategy(2)
    with s.scope():
        got = s.extended.call_for_each_replica(_rid)
    assert list(s.experimental_local_results(got)) == \
        [v["value"] for v in out["call_for_each_replica"]["result"]]


def test_run_exception_on_one_replica(golden, strategy):
    rec = golden["run_nested_and_misc"]["outputs"]["exception_on_one_replica_eager"]["error"]
    s = strategy(2)

    def bad():
        if _rid() == 1:
            raise ValueError("boom on replica 1")
        return torch.tensor(0.0)

    with pytest.raises(ValueError, match=rec["message"]) as info:
        s.run(bad)
    assert type(info.value).__name__ == rec["type"]
    # the strategy is usable afterwards
    assert list(s.experimental_local_results(s.run(_rid))) == [0, 1]


def test_two_strategies_scope_nesting(golden, strategy):
    rec = golden["run_nested_and_misc"]["outputs"]["two_strategies_scope_nesting"]["error"]
    assert rec["type"] == "RuntimeError"
    s1, s2 = strategy(2), strategy(2)
    with s1.scope():
        with pytest.raises(RuntimeError, match="(?i)mixing different"):
            with s2.scope():
                pass
        with s1.scope():  # the same strategy may re-enter
            assert cs.get_strategy() is s1


def test_run_inside_another_strategys_scope_is_mixing(strategy):
    # TF's run enters its strategy's scope, so it raises the same error; ours only checks
    s1, s2 = strategy(2), strategy(2)
    with s1.scope():
        with pytest.raises(RuntimeError, match="(?i)mixing different"):
            s2.run(_rid)
        assert list(s1.experimental_local_results(s1.run(_rid))) == [0, 1]
        assert cs.get_strategy() is s1
    assert list(s2.experimental_local_results(s2.run(_rid))) == [0, 1]


def test_run_args_must_match_replica_count(strategy):
    s2, s3 = strategy(2), strategy(3)
    pr = s3.experimental_distribute_values_from_function(lambda ctx: torch.tensor(1.0))
    with pytest.raises(ValueError, match="3 per-replica values"):
        s2.run(lambda v: v, args=(pr,))


def test_run_with_one_replica_returns_the_value_itself(strategy):
    # deviation 7: with one replica run returns what fn returned, not a PerReplica
    s = strategy(1)
    made = []

    def fn():
        made.append(torch.tensor([1.0, 2.0]))
        return made[-1]

    assert s.run(fn) is made[0]
    assert s.run(lambda: 3.5) == 3.5
    nest = s.run(lambda: {"a": made[0], "b": (1, None)})
    assert nest["a"] is made[0] and nest["b"] == (1, None)
