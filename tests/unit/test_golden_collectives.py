"""Collectives inside run: ReplicaContext.all_reduce, all_gather, merge_call.

Golden cases: ``all_reduce_in_run``, ``all_gather_in_run``, ``merge_call``.
TF recorded R2/R3 inside tf.function and ``R2_eager`` eagerly; csrun has no graph mode, so
the recorded values are the spec for its (eager) run. Not applicable: the ``tf_function``
entry of ``merge_call`` beyond its values (identical to ``eager``, which is pinned).
TF's int32 for ``tf.constant(int)`` is kept by creating int32 tensors explicitly.
"""

from __future__ import annotations

import pytest
import torch

import csrun.core as cs

SUM, MEAN = cs.ReduceOp.SUM, cs.ReduceOp.MEAN


def _ctx():
    return cs.get_replica_context()


def _all_reduce_outputs():
    ctx = _ctx()
    k = ctx.replica_id_in_sync_group
    kf = float(k)
    return {
        "sum_f": ctx.all_reduce(SUM, torch.tensor(kf + 1)),
        "mean_f": ctx.all_reduce(MEAN, torch.tensor(kf + 1)),
        "sum_i": ctx.all_reduce(SUM, torch.tensor(k + 1, dtype=torch.int32)),
        "mean_i": ctx.all_reduce(MEAN, torch.tensor(k + 1, dtype=torch.int32)),
        "sum_vec": ctx.all_reduce("sum", torch.tensor([kf, 10 * kf])),
        "nested": ctx.all_reduce(SUM, {"a": torch.tensor(kf),
                                       "b": [torch.tensor(2 * kf), torch.tensor(3 * kf)]}),
    }


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_all_reduce_in_run(num_replicas, golden, strategy, expect_golden):
    rec = golden["all_reduce_in_run"]["outputs"][f"R{num_replicas}"]
    s = strategy(num_replicas)
    out = s.run(_all_reduce_outputs)
    for key in ("sum_f", "mean_f", "sum_i", "mean_i", "sum_vec"):
        assert type(out[key]).__name__ == rec[key]["type"] == "PerReplica", key
        expect_golden(list(out[key].values), rec[key]["local"], path=key)
    assert type(out["nested"]["a"]).__name__ == rec["nested"]["a"]["kind"]
    expect_golden(list(out["nested"]["a"].values), rec["nested"]["a"]["values"])
    for got, enc in zip(out["nested"]["b"], rec["nested"]["b"]):
        assert type(got).__name__ == enc["kind"]
        expect_golden(list(got.values), enc["values"])
    # every replica holds its own copy, on its own device
    for key in ("sum_f", "sum_vec"):
        values = out[key].values
        assert len({id(v) for v in values}) == num_replicas
        assert [v.device for v in values] == s.extended.torch_devices


def test_all_reduce_eager_R2(golden, strategy, expect_golden):
    rec = golden["all_reduce_in_run"]["outputs"]["R2_eager"]["result"]
    s = strategy(2)
    out = s.run(lambda: _ctx().all_reduce(SUM, torch.tensor(float(_ctx()
                                                                  .replica_id_in_sync_group + 1))))
    expect_golden(list(s.experimental_local_results(out)), rec)


def test_all_reduce_python_scalar_is_value_error(golden, strategy):
    assert golden["all_reduce_in_run"]["outputs"]["R2_python_scalar"]["error"]["type"] == \
        "ValueError"
    s = strategy(2)
    with pytest.raises(ValueError, match="tensor"):
        s.run(lambda: _ctx().all_reduce(SUM, 1.0))


def test_all_reduce_outside_run_and_in_scope(golden, strategy, expect_golden):
    out = golden["all_reduce_in_run"]["outputs"]
    # outside any strategy: the default replica context returns the value
    expect_golden(cs.get_replica_context().all_reduce(SUM, torch.tensor(1.0)),
                  out["all_reduce_outside_run"]["result"])
    s = strategy(2)
    with s.scope():
        assert out["all_reduce_in_scope_cross_replica"]["result"] == "None"
        assert cs.get_replica_context() is None


def test_all_reduce_is_differentiable(strategy):
    s = strategy(2)

    def fn():
        k = float(_ctx().replica_id_in_sync_group)
        x = torch.tensor(k + 1.0, requires_grad=True)
        total = _ctx().all_reduce(SUM, x * 2)
        total.backward()
        return x.grad

    grads = s.run(fn)
    # d(sum_r 2 x_r)/dx_k summed over both replicas' backward passes: 2 * 2
    assert [float(g) for g in grads.values] == [4.0, 4.0]


@pytest.mark.parametrize("key", ["equal_shapes", "ragged"])
def test_all_gather_in_run(key, golden, strategy, expect_golden):
    rec = golden["all_gather_in_run"]["outputs"][key]["result"]
    s = strategy(3)

    def fn():
        k = _ctx().replica_id_in_sync_group
        value = (torch.tensor([float(k), float(k)]) if key == "equal_shapes"
                 else torch.arange(k + 1, dtype=torch.int32))
        return _ctx().all_gather(value, axis=0)

    out = s.run(fn)
    assert isinstance(out, cs.PerReplica)
    expect_golden(list(out.values), rec)


def test_merge_call_eager(golden, strategy, expect_golden):
    rec = golden["merge_call"]["outputs"]["eager"]
    s = strategy(2)
    calls = []

    def merge_fn(strat, x):
        calls.append({"strategy_is_S2": strat is s,
                      "x_type": type(x).__name__,
                      "in_cross_replica_context": cs.in_cross_replica_context(),
                      "n_local": len(strat.experimental_local_results(x))})
        return strat.reduce(SUM, x, axis=None)

    def fn():
        x = torch.tensor(float(_ctx().replica_id_in_sync_group + 1))
        return _ctx().merge_call(merge_fn, args=(x,))

    result = s.run(fn)
    assert calls == rec["merge_fn_calls"]
    assert type(result).__name__ == "Tensor" and rec["result_type"] == "EagerTensor"
    expect_golden(list(s.experimental_local_results(result)), rec["local"])
    # the tf.function recording agrees
    assert golden["merge_call"]["outputs"]["tf_function"]["local"] == rec["local"]


def test_merge_call_returns_per_replica(golden, strategy, expect_golden):
    out = golden["merge_call"]["outputs"]
    s = strategy(2)
    calls = []

    def merge_fn(strat, x):
        calls.append(1)
        return strat.experimental_distribute_values_from_function(
            lambda ctx: torch.tensor(10.0 * ctx.replica_id_in_sync_group))

    result = s.run(lambda: _ctx().merge_call(merge_fn, args=(torch.tensor(1.0),)))
    expect_golden(list(s.experimental_local_results(result)),
                  out["merge_fn_returns_per_replica"]["result"])
    assert len(calls) == out["merge_fn2_num_calls"] == 1


def test_merge_call_in_cross_replica_context(golden, strategy):
    rec = golden["merge_call"]["outputs"]["merge_call_in_cross_replica"]["error"]
    assert rec["type"] == "AttributeError"
    s = strategy(2)
    with s.scope():
        with pytest.raises(AttributeError, match="merge_call"):
            cs.get_replica_context().merge_call(lambda strat: None)


def test_mismatched_collective_calls_are_errors(strategy):
    s = strategy(2)

    def mismatched():
        if _ctx().replica_id_in_sync_group == 0:
            return _ctx().all_reduce(SUM, torch.tensor(1.0))
        return torch.tensor(0.0)

    with pytest.raises(RuntimeError, match="same collective calls|every replica"):
        s.run(mismatched)
    # still usable
    out = s.run(lambda: _ctx().all_reduce(SUM, torch.tensor(1.0)))
    assert [float(v) for v in out.values] == [2.0, 2.0]


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_all_reduce_and_all_gather_for_one_two_three_replicas(num_replicas, strategy):
    s = strategy(num_replicas)

    def fn():
        k = _ctx().replica_id_in_sync_group
        return (_ctx().all_reduce(SUM, torch.tensor(float(k + 1))),
                _ctx().all_reduce(MEAN, torch.tensor(float(k + 1))),
                _ctx().all_gather(torch.tensor([k]), axis=0))

    total, mean, gathered = s.run(fn)
    n = num_replicas
    assert [float(v) for v in s.experimental_local_results(total)] == [n * (n + 1) / 2] * n
    assert [float(v) for v in s.experimental_local_results(mean)] == [(n + 1) / 2] * n
    assert [v.tolist() for v in s.experimental_local_results(gathered)] == [list(range(n))] * n
