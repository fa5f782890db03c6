"""Variables: placement and the aggregation of updates made inside replicas.

Golden cases: ``variable_placement``, ``variable_seen_inside_run``,
``assign_in_run_aggregations``, ``assign_in_run_R1_and_eager``, ``assign_cross_replica``,
``assign_multiple_in_one_step``, ``variable_aggregation_invalid``.

``csrun.core.Variable(initial_value, aggregation=...)`` plays ``tf.Variable`` (intended
deviation 10). ``tf.constant(x)`` created inside the replica function is
``torch.tensor(x)`` (a new object per replica); TF's Python float literal -- the very same
object on every replica -- is a Python float literal in the replica function.
``assign_in_run_aggregations`` was recorded inside tf.function; csrun runs eagerly and the
recorded values are the spec (``assign_in_run_R1_and_eager`` shows the eager TF run agrees).

Every run-based case also runs with ``StrategyOptions(copy_parameters=True)``, the copy
path GPU replicas use.

Not applicable: TF's wrapper class names (``ResourceVariable``, ``AggregatingVariable``,
``_UnreadVariable``, ``inner_type``); ``isinstance_tf_Variable``; the tf.function half of
``variable_seen_inside_run`` beyond its values; ``distribute_strategy_is_s`` for R=1 and the
default strategy: TF leaves single-replica variables unwrapped, so their
``distribute_strategy`` is not the strategy -- an artifact of TF's wrapping, not pinned
(csrun's Variable always knows the strategy it was created under; pinned for R=2, 3).
"""

from __future__ import annotations

import pytest
import torch

import csrun.core as cs

COPY_MODES = pytest.mark.parametrize("copy", [False, True], ids=["alias", "copy"])


def _rid():
    return cs.get_replica_context().replica_id_in_sync_group


@pytest.mark.parametrize("which", ["R1", "R2", "R3", "default_ctor"])
def test_variable_placement(which, golden, strategy, expect_golden):
    rec = golden["variable_placement"]["outputs"][which]
    if which == "default_ctor":
        if torch.cuda.is_available():
            pytest.skip("recorded on a CPU-only machine (default compute device CPU:0)")
        s = cs.CentralStorageStrategy()
    else:
        s = strategy(int(which[1:]))
    with s.scope():
        w = cs.Variable(1.0, name="w")
    assert w.device == rec["device"]
    assert w.name == rec["name"]
    assert f"VariableAggregation.{w.aggregation.name}" == rec["aggregation"]
    assert f"VariableSynchronization.{w.synchronization.name}" == rec["synchronization"]
    assert w.trainable is rec["trainable"]
    assert isinstance(w, cs.DistributedValues) is rec["is_distributed_values"]
    local = s.experimental_local_results(w)
    assert len(local) == len(rec["local_results"]["result"]) == 1 and local[0] is w
    assert s.extended.variable_created_in_scope(w) is rec["variable_created_in_scope"]["result"]
    assert (s.extended.value_container(w) is w) is rec["value_container_is_self"]["result"]
    assert s.extended.read_var(w).device == s.extended.parameter_device.torch_device
    assert rec["read_var_device"] == rec["read_value_device"] == rec["device"]
    assert w.read_value().device == torch.device("cpu")
    assert rec["values_attr"]["error"]["type"] == "AttributeError"
    assert not hasattr(w, "values")
    if which in ("R2", "R3"):
        assert (w.distribute_strategy is s) is rec["distribute_strategy_is_s"]["result"]


def test_variable_placement_outside_scope_and_kinds(golden, strategy):
    out = golden["variable_placement"]["outputs"]
    s = strategy(2)
    plain = cs.Variable(1.0)
    assert plain.device == out["outside_scope"]["device"]
    assert s.extended.variable_created_in_scope(plain) is \
        out["outside_scope"]["variable_created_in_scope_S2"]
    with s.scope():
        ints = cs.Variable([1, 2])
        frozen = cs.Variable(1.0, trainable=False)
        inside = cs.Variable(1.0)
    assert ints.device == out["int64_var"]["device"]
    assert ints.dtype == torch.int64 and ints.tensor.tolist() == \
        out["int64_var"]["value"]["value"]
    assert frozen.trainable is out["non_trainable"]["trainable"] is False
    assert frozen.device == out["non_trainable"]["device"]
    assert s.extended.variable_created_in_scope(inside)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_variable_placement_under_device_context_goes_to_parameter_device(golden, strategy):
    # variable_placement "scope_inside_tf_device_cpu3" / "tf_device_cpu3_inside_scope":
    # a device context does not move variables off the parameter device.
    out = golden["variable_placement"]["outputs"]
    s = strategy(2)
    with torch.device("cuda:0"), s.scope():
        a = cs.Variable(1.0)
        lin = torch.nn.Linear(2, 2)
    with s.scope(), torch.device("cuda:0"):
        b = cs.Variable(1.0)
    assert a.device == b.device == out["scope_inside_tf_device_cpu3"]["device"]
    assert a.tensor.is_cpu and b.tensor.is_cpu and lin.weight.is_cpu


@COPY_MODES
def test_variable_seen_inside_run(copy, golden, strategy, expect_golden):
    rec = golden["variable_seen_inside_run"]["outputs"]["eager"]
    s = strategy(2, copy_parameters=copy)
    with s.scope():
        v = cs.Variable(3.0)
    seen = []

    def fn(captured):
        value = v.read_value()
        seen.append({"is_same_object": captured is v, "device": v.device,
                     "read_value_device": value.device,
                     "identity_device": torch.mul(v, 1).device, "rid": _rid()})
        return value

    out = s.run(fn, args=(v,))
    expect_golden(list(s.experimental_local_results(out)), rec["returned"])
    assert s.extended.worker_devices == rec["returned_devices"]
    for got, want in zip(seen, rec["per_replica_seen"]):
        assert got["is_same_object"] is want["is_same_object"]
        assert got["device"] == want["device"]
        assert got["rid"] == want["rid"]
        assert got["read_value_device"] == got["identity_device"] == torch.device("cpu")
    assert [w["read_value_device"] for w in rec["per_replica_seen"]] == s.extended.worker_devices


_OPS = {
    "assign_add(1.0)": lambda v, k: v.assign_add(1.0),
    "assign_add(k+1)": lambda v, k: v.assign_add(float(k + 1)),
    "assign_sub(1.0)": lambda v, k: v.assign_sub(1.0),
    "assign(5.0)": lambda v, k: v.assign(5.0),
    "assign(k+1)": lambda v, k: v.assign(float(k + 1)),
    "assign_add(tf.constant(1.0))": lambda v, k: v.assign_add(torch.tensor(1.0)),
    "assign(tf.constant(5.0))": lambda v, k: v.assign(torch.tensor(5.0)),
}
_AGGS = ["NONE", "SUM", "MEAN", "ONLY_FIRST_REPLICA"]
_ASSIGN_KEYS = [f"R{r} {agg} {op}" for r in (2, 3) for agg in _AGGS for op in _OPS]


def test_assign_in_run_keys_cover_golden(golden):
    assert set(golden["assign_in_run_aggregations"]["outputs"]) == set(_ASSIGN_KEYS)


def _run_assign(s, agg, op):
    with s.scope():
        v = cs.Variable(100.0, aggregation=agg)
    fn = _OPS[op]
    return v, (lambda: s.run(lambda: fn(v, _rid())))


@COPY_MODES
@pytest.mark.parametrize("key", _ASSIGN_KEYS)
def test_assign_in_run_aggregations(key, copy, golden, strategy, expect_golden):
    rec = golden["assign_in_run_aggregations"]["outputs"][key]["result"]
    r_name, agg, op = key.split(" ", 2)
    s = strategy(int(r_name[1:]), copy_parameters=copy)
    v, run = _run_assign(s, agg, op)
    returned = rec["run_returned"]
    if "error" in returned:
        assert returned["error"]["type"] == "ValueError"
        # NONE: "specify an aggregation"; SUM of one identical object: not per-replica
        with pytest.raises(ValueError, match="aggregation" if agg == "NONE" else "same"):
            run()
    else:
        out = run()
        expect_golden(list(s.experimental_local_results(out)), returned["result"])
    expect_golden(v.tensor, rec["final_value"])


@COPY_MODES
@pytest.mark.parametrize("key", ["R1 NONE assign_add(1.0)", "R1 NONE assign(5.0)",
                                 "R1 SUM assign_add(1.0)", "R1 SUM assign(5.0)",
                                 "R1 MEAN assign_add(1.0)", "R1 MEAN assign(5.0)",
                                 "R2 SUM assign_add(1.0) eager", "R2 NONE assign_add(1.0) eager"])
def test_assign_in_run_R1_and_eager(key, copy, golden, strategy, expect_golden):
    rec = golden["assign_in_run_R1_and_eager"]["outputs"][key]["result"]
    r_name, agg, op = key.removesuffix(" eager").split(" ", 2)
    s = strategy(int(r_name[1:]), copy_parameters=copy)
    v, run = _run_assign(s, agg, op)
    returned = rec["run_returned"]
    if "error" in returned:
        with pytest.raises(ValueError, match="aggregation" if agg == "NONE" else "same"):
            run()
    else:
        expect_golden(list(s.experimental_local_results(run())), returned["result"])
    expect_golden(v.tensor, rec["final_value"])


def test_assign_in_run_R1_and_eager_keys_cover_golden(golden):
    assert len(golden["assign_in_run_R1_and_eager"]["outputs"]) == 8


@pytest.mark.parametrize("agg", ["NONE", "SUM"])
def test_assign_cross_replica(agg, golden, strategy, expect_golden):
    out = golden["assign_cross_replica"]["outputs"]
    s = strategy(2)
    with s.scope():
        v = cs.Variable(10.0, aggregation=agg)
        returned = v.assign_add(1.0)
        expect_golden(v.tensor, out[f"{agg} after assign_add(1.0)"]["value"])
        assert returned is v
        v.assign(7.0)
        expect_golden(v.tensor, out[f"{agg} after assign(7.0)"])
        s.extended.update(v, lambda var, d: var.assign_add(d), args=(2.0,))
        expect_golden(v.tensor, out[f"{agg} after extended.update(+2)"]["value"])
    v.assign_add(100.0)  # outside the scope
    expect_golden(v.tensor, out[f"{agg} after assign_add(100) outside scope"])


@COPY_MODES
def test_assign_multiple_in_one_step(copy, golden, strategy, expect_golden):
    out = golden["assign_multiple_in_one_step"]["outputs"]
    s = strategy(2, copy_parameters=copy)
    with s.scope():
        v = cs.Variable(0.0, aggregation="SUM")

    def fn():
        v.assign_add(torch.tensor(1.0))
        return v.read_value()

    result = s.run(fn)
    expect_golden(list(s.experimental_local_results(result)), out["returned"])
    expect_golden(v.tensor, out["final"])

    with s.scope():
        w = cs.Variable(0.0, aggregation="SUM")
    assert out["python_float_variant"]["error"]["type"] == "ValueError"
    with pytest.raises(ValueError):
        s.run(lambda: (w.assign_add(1.0), w.read_value())[1])
    expect_golden(w.tensor, out["python_float_variant_final"])


@COPY_MODES
def test_read_before_and_after_assign_in_one_step(copy, strategy):
    # TF semantics: an aggregated update is visible to every replica right after it.
    s = strategy(2, copy_parameters=copy)
    with s.scope():
        v = cs.Variable(0.0, aggregation="SUM")

    def fn():
        before = v.read_value().clone()
        v.assign_add(torch.tensor(1.0))
        return before, v.read_value()

    before, after = s.run(fn)
    assert [float(t.detach()) for t in before.values] == [0.0, 0.0]
    assert [float(t.detach()) for t in after.values] == [2.0, 2.0]
    assert float(v.tensor) == 2.0


@pytest.mark.parametrize("bad", ["bogus", 5])
def test_variable_aggregation_invalid_is_value_error(bad, golden, strategy):
    # Intended deviation 10 (variable_aggregation_invalid): TF raises a garbage TypeError
    # ("can only concatenate str ..."); csrun raises ValueError listing the valid choices.
    key = "aggregation_bogus_string" if bad == "bogus" else "aggregation_int_5"
    assert golden["variable_aggregation_invalid"]["outputs"][key]["error"]["type"] == "TypeError"
    s = strategy(2)
    with s.scope():
        with pytest.raises(ValueError, match="ONLY_FIRST_REPLICA"):
            cs.Variable(1.0, aggregation=bad)


def test_variable_synchronization_settings(golden, strategy):
    out = golden["variable_aggregation_invalid"]["outputs"]
    s = strategy(2)
    with s.scope():
        on_read = cs.Variable(1.0, synchronization="ON_READ", aggregation="SUM")
        on_write = cs.Variable(1.0, synchronization=cs.VariableSynchronization.ON_WRITE)
    rec = out["synchronization_ON_READ_agg_SUM"]["result"]
    assert on_read.device == rec["device"]
    assert on_read.aggregation is cs.VariableAggregation.SUM
    assert rec["aggregation"].endswith(".SUM")
    assert f"VariableSynchronization.{on_read.synchronization.name}" == rec["synchronization"]
    assert on_read.trainable is False  # TF: ON_READ variables default to non-trainable
    rec = out["synchronization_ON_WRITE"]["result"]
    assert on_write.device == rec["device"]
    assert f"VariableAggregation.{on_write.aggregation.name}" == rec["aggregation"]
    assert f"VariableSynchronization.{on_write.synchronization.name}" == rec["synchronization"]


def test_variable_created_inside_run_lives_on_parameter_device(golden, strategy):
    rec = golden["variable_aggregation_invalid"]["outputs"]["create_in_run_eager"]["result"]
    s = strategy(2)
    out = s.run(lambda: cs.Variable(1.0))
    created = s.experimental_local_results(out)
    assert len(created) == len(rec) == 2
    assert [f"AggregatingVariable@{v.device}" for v in created] == rec
    assert all(v.tensor.device == s.extended.parameter_device.torch_device for v in created)


def test_aggregation_members(golden):
    assert [f"{m.name}={m.value!r}" for m in cs.VariableAggregation] == \
        golden["api_availability"]["outputs"]["VariableAggregation members"]
    assert cs.VariableAggregation.resolve("sum") is cs.VariableAggregation.SUM
    assert cs.VariableAggregation.resolve(3) is cs.VariableAggregation.ONLY_FIRST_REPLICA
