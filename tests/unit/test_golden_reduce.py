"""strategy.reduce and extended.reduce_to / batch_reduce_to.

Golden cases: ``reduce_mean_partial_batch_float``, ``reduce_int64_mean``,
``reduce_shape_mismatch_axis_None``, ``reduce_2d_axes``, ``reduce_op_spellings``,
``reduce_nested_structures``, ``reduce_non_distributed_inputs``, ``reduce_in_replica_context``,
``reduce_variable_and_mirrored``, ``reduce_result_device``, ``reduce_to_and_batch_reduce_to``.
(The docstring example ``doc_reduce_example_*`` is in test_golden_doc_examples.py.)

Not applicable: ``dataset_SUM_axis_None_in_tf_function`` and ``tf_function_run``
(tf.function variants).

TF's ``InvalidArgumentError`` (a TF-only type) for mismatched shapes is a ``ValueError`` in
csrun (deviation 11: a fitting Python type, a message naming the problem).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import csrun.core as cs

SUM, MEAN = cs.ReduceOp.SUM, cs.ReduceOp.MEAN


def _per_replica_batches(s, n, b, dtype=torch.int64):
    data = torch.arange(n).to(dtype)
    return list(s.experimental_distribute_dataset(list(data.split(b))))


@pytest.mark.parametrize("case_id,dtype", [("reduce_mean_partial_batch_float", torch.float32),
                                           ("reduce_int64_mean", torch.int64)])
def test_reduce_partial_batch(case_id, dtype, golden, strategy, expect_golden):
    out = golden[case_id]["outputs"]
    s = strategy(2)
    steps = _per_replica_batches(s, 14, 8, dtype)
    assert len(steps) == len(out["steps"])
    for x, rec in zip(steps, out["steps"]):
        expect_golden(list(s.experimental_local_results(x)), rec["local"])
        for key, (op, axis) in {"MEAN_axis0": (MEAN, 0), "SUM_axis0": (SUM, 0),
                                "MEAN_axis_None": (MEAN, None),
                                "SUM_axis_None": (SUM, None)}.items():
            if key in rec:
                expect_golden(s.reduce(op, x, axis=axis), rec[key]["result"])
        if "MEAN_of_per_replica_reduce_mean" in rec:
            means = s.run(lambda v: v.mean(), args=(x,))
            expect_golden(s.reduce(MEAN, means, axis=None),
                          rec["MEAN_of_per_replica_reduce_mean"]["result"])


def test_reduce_shape_mismatch_axis_None(golden, strategy, expect_golden):
    out = golden["reduce_shape_mismatch_axis_None"]["outputs"]
    s = strategy(2)
    values = s.experimental_distribute_values_from_function(
        lambda ctx: torch.arange(2.0 + ctx.replica_id_in_sync_group, dtype=torch.float32))
    expect_golden(list(s.experimental_local_results(values)), out["values"])
    for key, op in (("SUM_axis_None", SUM), ("MEAN_axis_None", MEAN)):
        assert out[key]["error"]["type"] == "InvalidArgumentError"
        with pytest.raises(ValueError, match="shape"):
            s.reduce(op, values, axis=None)
    expect_golden(s.reduce(SUM, values, axis=0), out["SUM_axis0"]["result"])
    expect_golden(s.reduce(MEAN, values, axis=0), out["MEAN_axis0"]["result"])

    (batch,) = _per_replica_batches(s, 5, 5)
    expect_golden(list(s.experimental_local_results(batch)), out["dataset_values"])
    for key, op in (("dataset_SUM_axis_None", SUM), ("dataset_MEAN_axis_None", MEAN)):
        assert "error" in out[key]
        with pytest.raises(ValueError, match="shape"):
            s.reduce(op, batch, axis=None)


_AXES = ["None", "0", "1", "-1", "2", "-3", "[0, 1]"]


@pytest.mark.parametrize("op_name", ["SUM", "MEAN"])
@pytest.mark.parametrize("axis_name", _AXES)
def test_reduce_2d_axes(op_name, axis_name, golden, strategy, expect_golden):
    out = golden["reduce_2d_axes"]["outputs"]
    s = strategy(2)
    values = s.experimental_distribute_values_from_function(
        lambda ctx: torch.arange(6, dtype=torch.float32).reshape(2, 3)
        + 10 * ctx.replica_id_in_sync_group)
    expect_golden(list(s.experimental_local_results(values)), out["values"])
    axis = eval(axis_name)  # noqa: S307 - the literal spellings of the golden keys
    rec = out[f"{op_name}_axis_{axis_name}"]
    if "error" in rec:
        expected = {"ValueError": ValueError, "TypeError": TypeError}[rec["error"]["type"]]
        with pytest.raises(expected, match="axis"):
            s.reduce(op_name, values, axis=axis)
    else:
        expect_golden(s.reduce(op_name, values, axis=axis), rec["result"])


@pytest.mark.parametrize("spelling", ["'SUM'", "'sum'", "'Mean'", "ReduceOp.SUM"])
def test_reduce_op_spellings_valid(spelling, golden, strategy, expect_golden):
    out = golden["reduce_op_spellings"]["outputs"]
    s = strategy(2)
    values = s.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([1.0, 2.0]) + 2 * ctx.replica_id_in_sync_group)
    expect_golden(list(s.experimental_local_results(values)), out["values"])
    op = SUM if spelling == "ReduceOp.SUM" else spelling.strip("'")
    expect_golden(s.reduce(op, values, axis=None), out[spelling]["result"])


@pytest.mark.parametrize("spelling,axis", [("'MAX'", None), ("'max'", None), ("'MAX'", 0)])
def test_reduce_op_spellings_max_is_value_error(spelling, axis, golden, strategy):
    key = spelling if axis is None else f"{spelling} axis=0"
    rec = golden["reduce_op_spellings"]["outputs"][key]["error"]
    assert rec["type"] == "ValueError"
    s = strategy(2)
    values = s.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"'MAX' is not a valid ReduceOp"):
        s.reduce(spelling.strip("'"), values, axis=axis)


def test_reduce_op_int_is_type_error(golden, strategy):
    # Intended deviation 5 (reduce_op_spellings "0"): TF asserts (AssertionError); csrun
    # raises TypeError naming what reduce_op must be.
    assert golden["reduce_op_spellings"]["outputs"]["0"]["error"]["type"] == "AssertionError"
    s = strategy(2)
    values = s.experimental_distribute_values_from_function(lambda ctx: torch.tensor([1.0]))
    with pytest.raises(TypeError, match="reduce_op"):
        s.reduce(0, values, axis=None)


def test_reduce_op_from_string(golden):
    out = golden["reduce_op_spellings"]["outputs"]["reduce_op_from_string('MEAN')"]["result"]
    assert str(cs.ReduceOp.from_string("MEAN")) == out == "ReduceOp.MEAN"
    assert cs.ReduceOp.from_string("mean") is MEAN


def _nested_outputs(s):
    def fn():
        k = float(cs.get_replica_context().replica_id_in_sync_group)
        return ({"a": torch.tensor(k + 1), "b": torch.tensor([k, 10 * k])},
                (torch.tensor(2 * k), torch.tensor([1.0, 2.0])))
    return s.run(fn)


def test_reduce_nested_structures_run_outputs(golden, strategy, expect_golden):
    out = golden["reduce_nested_structures"]["outputs"]
    s = strategy(2)
    d, t = _nested_outputs(s)
    assert type(d).__name__ == out["dict_type"]
    assert type(d["a"]).__name__ == out["a_type"] and type(d["b"]).__name__ == out["b_type"]
    assert [type(v).__name__ for v in t] == out["tuple_types"]
    expect_golden(list(d["a"].values), out["a"])
    expect_golden(list(d["b"].values), out["b"])
    expect_golden(list(t[0].values), out["t0"])
    expect_golden(list(t[1].values), out["t1"])
    expect_golden(list(s.experimental_local_results(d)),
                  out["experimental_local_results_of_dict"]["result"])
    expect_golden([list(r) for r in s.experimental_local_results(t)],
                  out["experimental_local_results_of_tuple"]["result"])


def test_reduce_nested_structures_leaf_by_leaf(golden, strategy, expect_golden):
    # Intended deviation 3 (reduce_nested_structures): TF raises ValueError for SUM of a
    # dict/tuple/list and returns replica 0's values for MEAN of a tuple; csrun reduces
    # nests leaf by leaf.
    out = golden["reduce_nested_structures"]["outputs"]
    for key in ("reduce_SUM_dict_axis_None", "reduce_SUM_tuple_axis_None",
                "reduce_SUM_list_axis_None"):
        assert out[key]["error"]["type"] == "ValueError"
    s = strategy(2)
    d, t = _nested_outputs(s)

    got = s.reduce(SUM, d, axis=None)
    assert isinstance(got, dict) and set(got) == {"a", "b"}
    expect_golden(got["a"], {"value": 3.0, "dtype": "float32", "shape": []})
    expect_golden(got["b"], {"value": [1.0, 10.0], "dtype": "float32", "shape": [2]})

    got = s.reduce(SUM, t, axis=None)
    assert isinstance(got, tuple)
    expect_golden(list(got), [{"value": 2.0, "dtype": "float32", "shape": []},
                              {"value": [2.0, 4.0], "dtype": "float32", "shape": [2]}])

    got = s.reduce(MEAN, t, axis=None)  # TF: replica 0's values (0.0, [1., 2.])
    assert isinstance(got, tuple)
    expect_golden(list(got), [{"value": 1.0, "dtype": "float32", "shape": []},
                              {"value": [1.0, 2.0], "dtype": "float32", "shape": [2]}])
    assert out["reduce_MEAN_tuple_axis_None"]["result"][0]["value"] == 0.0  # TF's bug

    got = s.reduce(SUM, [d["a"], t[0]], axis=None)
    assert isinstance(got, list)
    expect_golden(got, [{"value": 3.0, "dtype": "float32", "shape": []},
                        {"value": 2.0, "dtype": "float32", "shape": []}])

    # axis=0 leaf by leaf: the vector leaf reduces, a scalar leaf cannot (TF: TypeError bug)
    expect_golden(s.reduce(SUM, {"b": d["b"]}, axis=0)["b"],
                  {"value": 11.0, "dtype": "float32", "shape": []})
    assert out["reduce_SUM_dict_axis0"]["error"]["type"] == "TypeError"
    with pytest.raises(ValueError, match="axis"):
        s.reduce(SUM, d, axis=0)


_INPUTS = {
    "tf.constant(3.)": lambda: torch.tensor(3.0),
    "tf.constant([1.,2.])": lambda: torch.tensor([1.0, 2.0]),
    "tf.constant(0.)": lambda: torch.tensor(0.0),
    "py 3": lambda: 3,
    "py 3.0": lambda: 3.0,
    "py 0": lambda: 0,
    "py 0.0": lambda: 0.0,
    "np.array([1.,2.])": lambda: np.array([1.0, 2.0]),
    "np.zeros(2)": lambda: np.zeros(2),
}
_NON_DIST_KEYS = [f"R{r} {op} {name} axis={axis}" for r in (2, 1) for name in _INPUTS
                  for op in ("SUM", "MEAN") for axis in ("None", "0")]

# Intended deviation 6 (reduce_non_distributed_inputs): where TF crashes on Python 0 / 0.0
# (AttributeError: no .shape), csrun returns the value itself; an all-zero value summed
# across replicas is returned as it is (TF does that for numpy zeros, but raises for a TF
# tensor 0.0 -- csrun applies the all-zeros rule to every value).
_DEVIATION_6 = {
    "R2 SUM py 0 axis=None", "R2 MEAN py 0 axis=None", "R2 SUM py 0.0 axis=None",
    "R2 MEAN py 0.0 axis=None", "R1 SUM py 0 axis=None", "R1 MEAN py 0 axis=None",
    "R1 SUM py 0.0 axis=None", "R1 MEAN py 0.0 axis=None", "R2 SUM tf.constant(0.) axis=None",
}


def test_reduce_non_distributed_keys_cover_golden(golden):
    assert set(golden["reduce_non_distributed_inputs"]["outputs"]) == set(_NON_DIST_KEYS)


@pytest.mark.parametrize("key", _NON_DIST_KEYS)
def test_reduce_non_distributed_inputs(key, golden, strategy, expect_golden):
    rec = golden["reduce_non_distributed_inputs"]["outputs"][key]
    r_name, op, rest = key.split(" ", 2)
    name, axis_name = rest.rsplit(" axis=", 1)
    axis = None if axis_name == "None" else int(axis_name)
    s = strategy(int(r_name[1:]))
    value = _INPUTS[name]()
    if key in _DEVIATION_6:
        got = s.reduce(op, value, axis=axis)
        assert got is value  # returned as it is
        return
    if "error" in rec:
        assert rec["error"]["type"] == "ValueError", key
        # SUM of a plain value over 2+ replicas is ambiguous; axis=0 of a scalar is invalid
        with pytest.raises(ValueError, match="SUM|axis"):
            s.reduce(op, value, axis=axis)
        return
    got = s.reduce(op, value, axis=axis)
    result = rec["result"]
    if axis is None:
        # plain values come back as they are (MEAN, or SUM with one replica / all zeros)
        assert got is value
        if isinstance(result, dict):
            expect_golden(got, result, check_dtype=not isinstance(value, (int, float)))
        else:
            assert got == result
    else:
        # axis=k: the value counts as present on every replica (SUM: R x sum along k)
        expect_golden(got, result)


def test_reduce_non_distributed_axis_on_python_ints_gives_int64(strategy):
    # deviation 6: Python ints become int64 tensors (TF: int32)
    s = strategy(2)
    vec = s.reduce(SUM, np.array([1, 2]), axis=0)
    assert vec.dtype == torch.int64 and int(vec) == 6
    mean = s.reduce(MEAN, torch.tensor([1, 2]), axis=0)
    assert mean.dtype == torch.float64 and float(mean) == 1.5


def test_reduce_in_replica_context_is_runtime_error(golden, strategy):
    rec = golden["reduce_in_replica_context"]["outputs"]["eager_run"]["error"]
    assert rec["type"] == "RuntimeError"
    s = strategy(2)
    with pytest.raises(RuntimeError, match="cross-replica context"):
        s.run(lambda: s.reduce(SUM, torch.tensor(1.0), axis=None))


def test_reduce_variable_and_mirrored(golden, strategy, expect_golden):
    out = golden["reduce_variable_and_mirrored"]["outputs"]
    s = strategy(2)
    with s.scope():
        v = cs.Variable(2.0)
    assert out["var_SUM"]["error"]["type"] == "ValueError"
    with pytest.raises(ValueError, match="SUM"):
        s.reduce(SUM, v, axis=None)
    got = s.reduce(MEAN, v, axis=None)
    assert got is v  # TF returns the variable itself
    expect_golden(got.tensor, out["var_MEAN"]["result"]["value"])
    assert got.device == out["var_MEAN"]["result"]["device"]

    captured = torch.tensor(5.0)
    result = s.run(lambda: captured)
    assert out["same_tensor_run_output_type"] == "EagerTensor"
    assert result is captured
    expect_golden(result, out["same_tensor_run_output"])
    assert out["same_SUM"]["error"]["type"] == "ValueError"
    with pytest.raises(ValueError, match="SUM"):
        s.reduce(SUM, result, axis=None)
    expect_golden(s.reduce(MEAN, result, axis=None), out["same_MEAN"]["result"])


def _device_values(s):
    return s.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([1.0, 2.0]) * (ctx.replica_id_in_sync_group + 1))


def test_reduce_result_device(golden, strategy):
    # deviation 12: results land on torch.get_default_device() (TF's current device:
    # CPU:0 at top level, CPU:3 under tf.device('/cpu:3')).
    out = golden["reduce_result_device"]["outputs"]
    assert out["axis_None"] == out["axis_0"] == "/job:localhost/replica:0/task:0/device:CPU:0"
    assert out["axis_None_under_cpu3"].endswith("CPU:3")
    s = strategy(2)
    values = _device_values(s)
    assert s.reduce(SUM, values, axis=None).device == torch.get_default_device()
    assert s.reduce(SUM, values, axis=0).device == torch.get_default_device()
    assert s.gather(values, axis=0).device == torch.get_default_device()


def test_reduce_result_device_under_set_default_device(strategy):
    # reduce_result_device "axis_None_under_cpu3": a different current device. The meta
    # device stands in for a second physical device on a CPU-only machine.
    s = strategy(2)
    values = _device_values(s)
    torch.set_default_device("meta")
    try:
        assert torch.get_default_device().type == "meta"
        assert s.reduce(SUM, values, axis=None).device.type == "meta"
        assert s.reduce(MEAN, values, axis=0).device.type == "meta"
        assert s.gather(values, axis=0).device.type == "meta"
    finally:
        torch.set_default_device(None)


def test_reduce_result_device_under_torch_device_context(strategy):
    # The same with torch's device context manager (tf.device's closest analogue):
    # factory functions allocate on meta inside it, so the results must be there too
    # (torch.get_default_device() itself ignores the context on torch 2.4 and 2.6).
    s = strategy(2)
    values = _device_values(s)
    with torch.device("meta"):
        assert torch.empty(0).device.type == "meta"
        assert s.reduce(SUM, values, axis=None).device.type == "meta"
        assert s.reduce(MEAN, values, axis=0).device.type == "meta"
        assert s.gather(values, axis=0).device.type == "meta"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_reduce_result_device_cuda(strategy):
    s = strategy(2)
    values = s.experimental_distribute_values_from_function(lambda ctx: torch.tensor([1.0]))
    with torch.device("cuda:0"):
        assert s.reduce(SUM, values, axis=None).device == torch.device("cuda:0")


def test_reduce_to_and_batch_reduce_to(golden, strategy, expect_golden):
    out = golden["reduce_to_and_batch_reduce_to"]["outputs"]
    s = strategy(2)
    pr = s.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([1.0, 2.0]) + 2 * ctx.replica_id_in_sync_group)
    with s.scope():
        v = cs.Variable([0.0, 0.0])
    ext = s.extended

    got = ext.reduce_to(SUM, pr, "/cpu:3")
    assert isinstance(got, torch.Tensor) and out["SUM to /cpu:3"]["result"]["type"] == "EagerTensor"
    expect_golden(got, out["SUM to /cpu:3"]["result"]["enc"])
    assert got.device == torch.device("cpu")  # CPU:3 is a logical CPU (deviation 12)

    expect_golden(ext.reduce_to(MEAN, pr, "/cpu:3"), out["MEAN to /cpu:3"]["result"]["enc"])

    got = ext.reduce_to(SUM, pr, v)
    expect_golden(got, out["SUM to variable"]["result"]["enc"])
    assert got.device == v.tensor.device

    got = ext.reduce_to(SUM, pr, pr)
    rec = out["SUM to per_replica"]["result"]
    assert type(got).__name__ == rec["type"] == "Mirrored"
    expect_golden(list(got.values), rec["enc"])
    assert [t.device for t in got.values] == ext.torch_devices
    assert got.values[0] is not got.values[1]

    got = ext.batch_reduce_to(SUM, [(pr, "/cpu:0"), (pr, v)])
    assert isinstance(got, list)
    expect_golden(got, out["batch_reduce_to"]["result"])


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_reduce_and_gather_of_split_batches_match_the_global_batch(num_replicas, strategy):
    """The rules behind the golden cases, for 1, 2 and 3 replicas: reduce with axis=0 of a
    split batch is the reduction of the global batch (MEAN divides by the true count, even
    with a partial or empty replica); gather(axis=0) rebuilds the global batch."""
    s = strategy(num_replicas)
    data = torch.arange(14, dtype=torch.float32) * 0.5
    for batch, x in zip(data.split(8), s.experimental_distribute_dataset(list(data.split(8)))):
        assert float(s.reduce(SUM, x, axis=0)) == pytest.approx(float(batch.sum()), abs=1e-6)
        assert float(s.reduce(MEAN, x, axis=0)) == pytest.approx(float(batch.mean()), abs=1e-6)
        assert torch.equal(s.gather(x, axis=0), batch)
    ints = torch.arange(9)
    (x,) = list(s.experimental_distribute_dataset([ints]))
    mean = s.reduce(MEAN, x, axis=0)
    assert mean.dtype == torch.float64 and float(mean) == 4.0
    assert int(s.reduce(SUM, x, axis=0)) == 36


# -- dtypes beyond the recorded cases (issue: int SUM promoted, booleans OR-ed) -----------
@pytest.mark.parametrize("dtype", [torch.int32, torch.uint8, torch.int16, torch.int64])
@pytest.mark.parametrize("axis", [None, 0, -1])
def test_integer_sum_keeps_its_dtype_on_every_axis(dtype, axis):
    """TF keeps int32 for SUM (as csrun did for axis=None only); MEAN gives float64."""
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"])
    values = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([1, 2 + ctx.replica_id_in_sync_group], dtype=dtype))
    total = strategy.reduce("SUM", values, axis=axis)
    assert total.dtype == dtype
    assert total.tolist() == ([2, 5] if axis is None else 7)
    assert strategy.reduce("MEAN", values, axis=axis).dtype == torch.float64


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
@pytest.mark.parametrize("axis", [None, 0])
def test_booleans_are_refused_by_reduce_and_all_reduce(op, axis):
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"])
    flags = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([True, False]))
    with pytest.raises(TypeError, match="cannot reduce booleans.*x.int\\(\\)"):
        strategy.reduce(op, flags, axis=axis)
    with pytest.raises(TypeError, match="cannot reduce booleans"):
        strategy.run(lambda x: cs.get_replica_context().all_reduce(op, x), args=(flags,))
    counted = strategy.reduce(op, strategy.run(lambda x: x.int(), args=(flags,)), axis=axis)
    assert counted.tolist() == ([2, 0] if axis is None and op == "SUM" else
                                [1.0, 0.0] if axis is None else 2 if op == "SUM" else 0.5)
