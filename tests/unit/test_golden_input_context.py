"""InputContext and distribute_datasets_from_function.

Golden cases: ``input_context_fields``, ``dfn_range10_batch2_R2``, ``dfn_range10_batch3_R2``,
``dfn_range10_batch3_R2_drop``, ``dfn_range3_batch4_R2``, ``dfn_range10_batch2_R1``,
``dfn_deprecated_alias_and_options``, ``dfn_returns_non_dataset``.

TF's rule, kept: one input pipeline (``dataset_fn`` called once, input_pipeline_id 0 of 1),
replicas take consecutive *per-replica* batches in replica order, an incomplete final round
is dropped -- csrun warns (UserWarning) saying what it dropped (intended deviation 9).

Not pinned: ``options_PER_REPLICA_pipeline_id_visible`` (the dataset_fn behind it is not
recorded). PER_REPLICA mode is tested on its own terms below: ``dataset_fn`` is called once
per replica with ``input_pipeline_id`` = replica id and ``num_input_pipelines`` = R.

Static shapes: TF reports the static batch size of ``batch(3, drop_remainder=True)``
(``shape=(3,)``) in ``dfn_range10_batch3_R2_drop``'s element_spec; a Python iterable has no
static shapes, so csrun's batch dimension is ``None`` (normalized in the comparison).
"""

from __future__ import annotations

import re
import warnings

import pytest
import torch

import csrun.core as cs


def _batches(n, b, drop=False):
    batches = list(torch.arange(n).split(b))
    if drop and batches and len(batches[-1]) < b:
        batches = batches[:-1]
    return batches


def _steps(s, dist):
    return [[t.tolist() for t in s.experimental_local_results(x)] for x in dist]


def _spec_without_static_batch(tf_spec: str) -> str:
    return re.sub(r"shape=\((\d+)(,|\))", r"shape=(None\2", tf_spec)


def _ctx_suffix(text: str, cls: str = "InputContext") -> str:
    """The part of str(ctx) after the class name, whitespace-normalized (TF prints
    'tf.distribute.InputContext(...)', csrun 'csrun.core.InputContext(...)')."""
    return " ".join(text.split(cls, 1)[1].split())


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_input_context_fields(num_replicas, golden, strategy):
    out = golden["input_context_fields"]["outputs"][f"R{num_replicas}"]
    s = strategy(num_replicas)
    calls = []

    def dataset_fn(ctx):
        calls.append(ctx)
        return _batches(8, 2)  # 4 per-replica batches

    dist = s.distribute_datasets_from_function(dataset_fn)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps = list(dist)
    assert len(steps) == out["num_steps"]
    assert len(calls) == out["num_dataset_fn_calls"] == 1
    (ctx,), (rec,) = calls, out["calls"]
    assert type(ctx).__name__ == rec["type"]
    assert isinstance(ctx, cs.InputContext)
    assert ctx.num_input_pipelines == rec["num_input_pipelines"]
    assert ctx.input_pipeline_id == rec["input_pipeline_id"]
    assert ctx.num_replicas_in_sync == rec["num_replicas_in_sync"]
    assert _ctx_suffix(str(ctx)) == _ctx_suffix(rec["str"])
    for size, res in rec["get_per_replica_batch_size"].items():
        if "error" in res:
            assert res["error"]["type"] == "ValueError"
            with pytest.raises(ValueError, match=re.escape(res["error"]["message"].strip())):
                ctx.get_per_replica_batch_size(int(size))
        else:
            assert ctx.get_per_replica_batch_size(int(size)) == res["result"]
    # 4 batches over 3 replicas: one round, the 4th batch is dropped with a warning
    dropped = [w for w in caught if issubclass(w.category, UserWarning)]
    assert bool(dropped) == (4 % num_replicas != 0)


_DFN_CASES = ["dfn_range10_batch2_R2", "dfn_range10_batch3_R2", "dfn_range10_batch3_R2_drop",
              "dfn_range3_batch4_R2", "dfn_range10_batch2_R1"]


def test_every_dfn_range_case_is_pinned(golden):
    assert {c for c in golden if re.match(r"dfn_range", c)} == set(_DFN_CASES)


@pytest.mark.parametrize("case_id", _DFN_CASES)
def test_dfn_range(case_id, golden, strategy, spec_string):
    case = golden[case_id]
    inp, out = case["inputs"], case["outputs"]
    s = strategy(inp["R"])
    batches = _batches(inp["N"], inp["per_replica_batch"], inp["drop_remainder"])
    dist = s.distribute_datasets_from_function(lambda ctx: batches)
    leftover = len(batches) % inp["R"]
    if leftover:
        # deviation 9: TF drops the incomplete final round silently; csrun warns
        with pytest.warns(UserWarning, match="dropped") as record:
            values = list(dist)
        message = str(record[0].message)
        dropped_examples = sum(len(b) for b in batches[len(batches) - leftover:])
        assert f"{leftover} batch(es)" in message
        assert f"{dropped_examples} examples" in message
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            values = list(dist)
    assert [[t.tolist() for t in s.experimental_local_results(x)] for x in values] \
        == out["steps"]
    assert len(values) == out["num_steps"]
    if inp["R"] == 1:
        assert all(isinstance(v, torch.Tensor) for v in values)
    else:
        assert all(isinstance(v, cs.PerReplica) for v in values)
    if values:
        assert spec_string(dist.element_spec) == _spec_without_static_batch(out["element_spec"])
        for x in values:
            for t, device in zip(s.experimental_local_results(x), s.extended.torch_devices):
                assert t.device == device


def test_dfn_deprecated_alias(golden, strategy, expect_golden):
    out = golden["dfn_deprecated_alias_and_options"]["outputs"]
    s = strategy(2)
    with pytest.warns(DeprecationWarning, match="distribute_datasets_from_function"):
        dist = s.experimental_distribute_datasets_from_function(lambda ctx: _batches(4, 1))
    values = [list(s.experimental_local_results(x)) for x in dist]
    expect_golden(values, out["alias"]["result"])


def test_dfn_default_devices(golden, strategy):
    out = golden["dfn_deprecated_alias_and_options"]["outputs"]
    s = strategy(2)
    assert [s.extended.worker_devices] == out["default_devices"]["result"]
    for x in s.distribute_datasets_from_function(lambda ctx: _batches(4, 1)):
        for t, device in zip(s.experimental_local_results(x), s.extended.torch_devices):
            assert t.device == device


def test_dfn_options_fetch_to_device_false(golden, strategy, expect_golden):
    out = golden["dfn_deprecated_alias_and_options"]["outputs"][
        "options_fetch_to_device_False"]["result"]
    s = strategy(2)
    dist = s.distribute_datasets_from_function(
        lambda ctx: _batches(4, 1), options=cs.InputOptions(experimental_fetch_to_device=False))
    values = [list(s.experimental_local_results(x)) for x in dist]
    expect_golden(values, out["steps"])
    # TF: every component stays on the host (CPU:0): torch's cpu
    assert out["devices"][0] == ["/job:localhost/replica:0/task:0/device:CPU:0"] * 2
    for step in values:
        assert all(t.device == torch.device("cpu") for t in step)


def test_dfn_options_per_replica(golden, strategy, expect_golden):
    # dfn_deprecated_alias_and_options "options_PER_REPLICA": with a dataset_fn that shards
    # by input pipeline (the documented way), replica k reads pipeline k.
    out = golden["dfn_deprecated_alias_and_options"]["outputs"]["options_PER_REPLICA"]
    s = strategy(2)
    options = cs.InputOptions(experimental_replication_mode=cs.InputReplicationMode.PER_REPLICA)
    dist = s.distribute_datasets_from_function(
        lambda ctx: list(torch.arange(ctx.input_pipeline_id, 4,
                                      ctx.num_input_pipelines).split(1)),
        options=options)
    expect_golden([list(s.experimental_local_results(x)) for x in dist], out["result"])


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_dfn_per_replica_mode_calls_dataset_fn_per_replica(num_replicas, strategy):
    s = strategy(num_replicas)
    calls = []

    def dataset_fn(ctx):
        calls.append((ctx.input_pipeline_id, ctx.num_input_pipelines, ctx.num_replicas_in_sync))
        return [torch.full((2,), 10 * ctx.input_pipeline_id + step) for step in range(3)]

    options = cs.InputOptions(experimental_replication_mode="PER_REPLICA")
    steps = _steps(s, s.distribute_datasets_from_function(dataset_fn, options=options))
    assert calls == [(k, num_replicas, num_replicas) for k in range(num_replicas)]
    assert steps == [[[10 * k + step] * 2 for k in range(num_replicas)] for step in range(3)]


def test_dfn_returns_tensor_is_type_error(golden, strategy):
    # Intended deviation 9 (dfn_returns_non_dataset "tensor"): TF raises AttributeError
    # ('no attribute element_spec'); csrun raises TypeError saying what dataset_fn must return.
    out = golden["dfn_returns_non_dataset"]["outputs"]
    assert out["tensor"]["error"]["type"] == "AttributeError"
    s = strategy(2)
    with pytest.raises(TypeError, match="iterable"):
        list(s.distribute_datasets_from_function(lambda ctx: torch.arange(4)))


def test_dfn_returns_list_of_batches_is_a_dataset(golden, strategy):
    # dfn_returns_non_dataset "list": TF needs a tf.data.Dataset; in csrun any iterable of
    # batches is a dataset (README mapping), so a list of tensors works. A list whose items
    # are not tensors is refused with a TypeError.
    assert golden["dfn_returns_non_dataset"]["outputs"]["list"]["error"]["type"] \
        == "AttributeError"
    s = strategy(2)
    assert _steps(s, s.distribute_datasets_from_function(lambda ctx: _batches(4, 1))) \
        == [[[0], [1]], [[2], [3]]]
    with pytest.raises(TypeError, match="tensors"):
        list(s.distribute_datasets_from_function(lambda ctx: [1, 2, 3, 4]))


def test_dfn_cardinality(strategy):
    s = strategy(2)
    assert s.distribute_datasets_from_function(lambda ctx: _batches(10, 2)).cardinality == 2
