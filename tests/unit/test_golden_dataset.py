"""experimental_distribute_dataset: how global batches are split across replicas.

Golden cases: every ``dist_ds_range{N}_batch{B}_R{R}[_drop]`` (parametrized by id),
``dist_ds_range0_batch4_R2``, ``dist_ds_shapes_range10_batch4``, ``dist_ds_unbatched_range10``,
``dist_ds_tuple_dict_elements``, ``dist_ds_float_matrix_batch``, ``dist_ds_map_after_batch``,
``dist_ds_padded_batch``, ``dist_ds_batch_then_unbatch_batch``, ``dist_ds_with_input_options``,
``dist_ds_reiterate_and_iterator_api``.

TF -> csrun: ``Dataset.range(N).batch(B)`` is ``list(torch.arange(N).split(B))`` (int64);
``drop_remainder=True`` is the same list without a short last batch. ``steps[i][k]`` is
``[t.tolist() for t in strategy.experimental_local_results(x)]``; TF's recorded component
device ``k`` is ``strategy.extended.worker_devices[k]`` and every logical CPU holds its
tensors on torch's ``cpu`` (intended deviation 12).

Not applicable: ``dist_ds_range7_batch4_R2_in_tf_function`` (tf.function; csrun has no
graph mode -- the eager cases are the spec; its sizes/sums are still checked below from the
eager rule).

Static shapes: TF prints a static batch dimension in ``element_spec`` when the pipeline
knows it (``batch(B, drop_remainder=True)``); a Python iterable of batches has no static
shapes, so csrun always reports the batch dimension as ``None``. The comparisons below
normalize TF's static batch dimension to ``None`` (see ``_spec_without_static_batch``), and
``element_spec`` of an *empty* iterable is not pinned (TF knows it from the pipeline's types;
an empty Python list has none).
"""

from __future__ import annotations

import math
import re
import threading
import warnings

import numpy as np
import pytest
import torch

import csrun.core as cs

_RANGE_IDS = [f"dist_ds_range{n}_batch{b}_R{r}{'_drop' if drop else ''}"
              for n in (1, 5, 7, 8, 10) for b in range(1, 7) for r in (1, 2)
              for drop in (False, True)]


def _batches(n: int, b: int, drop: bool = False) -> list:
    batches = list(torch.arange(n).split(b)) if n else []
    if drop and batches and len(batches[-1]) < b:
        batches = batches[:-1]
    return batches


def _steps(strategy, dist) -> list:
    return [[t.tolist() for t in strategy.experimental_local_results(x)] for x in dist]


def _spec_without_static_batch(tf_spec: str) -> str:
    """TF's spec string with a static leading (batch) dimension written as None."""
    return re.sub(r"shape=\((\d+)(,|\))", r"shape=(None\2", tf_spec)


def test_every_range_case_is_pinned(golden):
    recorded = {cid for cid in golden if cid.startswith("dist_ds_range")
                and not cid.endswith("_in_tf_function")}
    assert recorded - {"dist_ds_range0_batch4_R2"} == set(_RANGE_IDS)


@pytest.mark.parametrize("case_id", _RANGE_IDS)
def test_dist_ds_range(case_id, golden, strategy, spec_string):
    case = golden[case_id]
    inp, out = case["inputs"], case["outputs"]
    s = strategy(inp["R"])
    dist = s.experimental_distribute_dataset(_batches(inp["N"], inp["B"], inp["drop_remainder"]))
    values = list(dist)
    steps = [[t.tolist() for t in s.experimental_local_results(x)] for x in values]
    assert steps == out["steps"]
    assert len(values) == out["num_steps"]
    for x, kind in zip(values, out["step_value_types"]):
        if kind == "EagerTensor":
            assert isinstance(x, torch.Tensor)
        else:
            assert kind == "PerReplica"
            assert isinstance(x, cs.PerReplica)
            assert len(x.values) == inp["R"]
            for t in x.values:
                assert t.dtype == torch.int64
    if out["component_devices_step0"] is not None:
        assert s.extended.worker_devices == out["component_devices_step0"]
        for t, device in zip(s.experimental_local_results(values[0]), s.extended.torch_devices):
            assert t.device == device
    if values:
        assert spec_string(dist.element_spec) == _spec_without_static_batch(out["element_spec"])


def test_dist_ds_range0_batch4_R2_empty_dataset(golden, strategy):
    out = golden["dist_ds_range0_batch4_R2"]["outputs"]
    s = strategy(2)
    dist = s.experimental_distribute_dataset(_batches(0, 4))
    assert _steps(s, dist) == out["steps"] == []
    assert out["num_steps"] == 0
    # element_spec of an empty untyped iterable: not representable (module docstring).


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_split_rule_ceil_per_replica_for_three_replicas_too(num_replicas, strategy):
    """README rule (checked against the golden R1/R2 cases above): ceil(n/R) consecutive
    examples per replica, trailing replicas possibly empty; extended here to R=3."""
    s = strategy(num_replicas)
    for n in (1, 5, 7, 8, 10):
        for b in range(1, 7):
            batches = _batches(n, b)
            steps = _steps(s, s.experimental_distribute_dataset(batches))
            expected = []
            for batch in batches:
                per = math.ceil(len(batch) / num_replicas)
                vals = batch.tolist()
                expected.append([vals[r * per:(r + 1) * per] for r in range(num_replicas)])
            if num_replicas == 1:
                expected = [[e[0]] for e in expected]
            assert steps == expected, (n, b)


def test_dist_ds_range7_batch4_R2_in_tf_function_sizes_and_sums(golden, strategy):
    # The tf.function variant is not applicable as such (no graph mode); its recorded
    # per-replica sizes and sums must hold for the eager iteration all the same.
    out = golden["dist_ds_range7_batch4_R2_in_tf_function"]["outputs"]
    s = strategy(out["R"])
    values = list(s.experimental_distribute_dataset(_batches(7, 4)))
    sizes = [[len(t) for t in s.experimental_local_results(x)] for x in values]
    sums = [[int(t.sum()) for t in s.experimental_local_results(x)] for x in values]
    assert sizes == out["per_step_per_replica_sizes"]
    assert sums == out["per_step_per_replica_sums"]


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_dist_ds_shapes_range10_batch4(num_replicas, golden, strategy):
    out = golden["dist_ds_shapes_range10_batch4"]["outputs"]
    s = strategy(num_replicas)
    shapes = [[list(t.shape) for t in s.experimental_local_results(x)]
              for x in s.experimental_distribute_dataset(_batches(10, 4))]
    assert shapes == out[f"R{num_replicas}"]["result"]


def test_dist_ds_unbatched_range10_R1_works_as_tf(golden, strategy, spec_string):
    out = golden["dist_ds_unbatched_range10"]["outputs"]["R1"]["result"]
    s = strategy(1)
    dist = s.experimental_distribute_dataset(list(torch.arange(10)))
    values = list(dist)
    assert _steps(s, dist) == out["steps"]
    assert len(values) == out["num_steps"]
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in values)
    assert s.extended.worker_devices == out["component_devices_step0"]
    assert spec_string(dist.element_spec) == out["element_spec"]


@pytest.mark.parametrize("num_replicas", [2, 3])
def test_dist_ds_unbatched_range10_multi_replica_raises_value_error(num_replicas, golden,
                                                                     strategy):
    # Intended deviation 1 (dist_ds_unbatched_range10): TF raises IndexError('list index out
    # of range'); csrun raises a ValueError that says the elements are unbatched.
    recorded = golden["dist_ds_unbatched_range10"]["outputs"][f"R{num_replicas}"]
    assert recorded["error"]["type"] == "IndexError"
    s = strategy(num_replicas)
    with pytest.raises(ValueError, match=r"(?i)unbatched|0-d"):
        list(s.experimental_distribute_dataset(list(torch.arange(10))))


def test_dist_ds_tuple_dict_elements(golden, strategy, spec_string):
    out = golden["dist_ds_tuple_dict_elements"]["outputs"]
    a = torch.arange(6)
    b, labels = a * 10, a * 100
    batches = [({"a": a[i:i + 4], "b": b[i:i + 4]}, labels[i:i + 4]) for i in (0, 4)]
    s = strategy(2)
    dist = s.experimental_distribute_dataset(batches)
    steps = list(dist)
    assert len(steps) == len(out["steps"])
    for (features, lab), rec in zip(steps, out["steps"]):
        assert type(features).__name__ == rec["features_type"]
        assert type(lab).__name__ == rec["labels_type"]
        for key in ("a", "b"):
            assert isinstance(features[key], cs.PerReplica)
            for got, enc in zip(s.experimental_local_results(features[key]), rec[key]):
                assert got.tolist() == enc["value"] and list(got.shape) == enc["shape"]
                assert got.dtype == torch.int64
        for got, enc in zip(s.experimental_local_results(lab), rec["labels"]):
            assert got.tolist() == enc["value"] and list(got.shape) == enc["shape"]
    assert spec_string(dist.element_spec) == out["element_spec"]


def test_dist_ds_float_matrix_batch(golden, strategy, spec_string):
    out = golden["dist_ds_float_matrix_batch"]["outputs"]
    data = torch.arange(20.0, dtype=torch.float32).reshape(10, 2)
    s = strategy(3)
    dist = s.experimental_distribute_dataset(list(data.split(4)))
    values = list(dist)
    assert _steps(s, dist) == out["steps"]
    assert len(values) == out["num_steps"]
    assert all(isinstance(v, cs.PerReplica) for v in values)
    assert s.extended.worker_devices == out["component_devices_step0"]
    # the empty third replica keeps the trailing shape (0, 2)
    assert [list(t.shape) for t in values[0].values] == [[2, 2], [2, 2], [0, 2]]
    assert spec_string(dist.element_spec) == out["element_spec"]


@pytest.mark.parametrize("case_id,batches", [
    ("dist_ds_map_after_batch", [b * 2 for b in torch.arange(10).split(4)]),
    ("dist_ds_padded_batch", list(torch.arange(10).split(4))),
    ("dist_ds_batch_then_unbatch_batch", list(torch.cat(torch.arange(10).split(2)).split(5))),
])
def test_dist_ds_transformed_pipelines(case_id, batches, golden, strategy, spec_string):
    out = golden[case_id]["outputs"]
    s = strategy(2)
    dist = s.experimental_distribute_dataset(batches)
    values = list(dist)
    assert _steps(s, dist) == out["steps"]
    assert len(values) == out["num_steps"]
    assert all(isinstance(v, cs.PerReplica) for v in values)
    assert s.extended.worker_devices == out["component_devices_step0"]
    assert spec_string(dist.element_spec) == out["element_spec"]


def test_dist_ds_with_input_options_none(golden, strategy, spec_string):
    out = golden["dist_ds_with_input_options"]["outputs"]["options=None explicitly"]["result"]
    s = strategy(2)
    dist = s.experimental_distribute_dataset(_batches(6, 4), options=None)
    assert _steps(s, dist) == out["steps"]
    assert out["num_steps"] == 2
    assert s.extended.worker_devices == out["component_devices_step0"]
    assert spec_string(dist.element_spec) == out["element_spec"]


@pytest.mark.parametrize("options", [
    cs.InputOptions(),
    cs.InputOptions(experimental_fetch_to_device=False),
    cs.InputOptions(experimental_fetch_to_device=True),
    cs.InputOptions(experimental_per_replica_buffer_size=3),
], ids=["InputOptions()", "fetch_to_device=False", "fetch_to_device=True", "buffer_size=3"])
def test_dist_ds_with_input_options_work(options, golden, strategy):
    # Intended deviation 2 (dist_ds_with_input_options): TF crashes on a typo
    # ('experimental_replication_moden') for every InputOptions; csrun honours them and
    # gives the same steps as options=None.
    out = golden["dist_ds_with_input_options"]["outputs"]
    assert out["InputOptions()"]["error"]["type"] == "AttributeError"
    expected = out["options=None explicitly"]["result"]["steps"]
    s = strategy(2)
    assert _steps(s, s.experimental_distribute_dataset(_batches(6, 4), options=options)) \
        == expected


def test_dist_ds_input_options_fetch_to_device_false_stays_on_host(strategy):
    # deviation 2: fetch_to_device=False leaves every component on the host CPU.
    s = strategy(2)
    dist = s.experimental_distribute_dataset(_batches(6, 4),
                                             options=cs.InputOptions(
                                                 experimental_fetch_to_device=False))
    for x in dist:
        for t in s.experimental_local_results(x):
            assert t.device == torch.device("cpu")


def test_dist_ds_input_options_per_replica_mode_is_rejected(golden, strategy):
    # dist_ds_with_input_options, "InputOptions(experimental_replication_mode=PER_REPLICA)":
    # TF 2.21 crashes on its typo before reaching the check the typo sits in; that check
    # (central_storage_strategy.experimental_distribute_dataset, and MirroredStrategy's)
    # raises NotImplementedError: "InputReplicationMode.PER_REPLICA is only supported in
    # `distribute_datasets_from_function`". csrun keeps TF's intent: a clear error that
    # points to distribute_datasets_from_function.
    out = golden["dist_ds_with_input_options"]["outputs"]
    assert "error" in out["InputOptions(experimental_replication_mode=PER_REPLICA)"]
    s = strategy(2)
    options = cs.InputOptions(experimental_replication_mode=cs.InputReplicationMode.PER_REPLICA)
    with pytest.raises((ValueError, NotImplementedError),
                       match="distribute_datasets_from_function"):
        list(s.experimental_distribute_dataset(_batches(6, 4), options=options))


def test_dist_ds_reiterate_and_iterator_api(golden, strategy, expect_golden, spec_string):
    out = golden["dist_ds_reiterate_and_iterator_api"]["outputs"]
    s = strategy(2)
    dist = s.experimental_distribute_dataset(_batches(5, 2))
    first = [list(s.experimental_local_results(x)) for x in dist]
    second = [list(s.experimental_local_results(x)) for x in dist]
    expect_golden(first, out["first_pass"])
    expect_golden(second, out["second_pass"])

    iterator = iter(dist)
    assert type(iterator).__name__ == out["iterator_type"]
    expect_golden(list(s.experimental_local_results(next(iterator))), out["next1"])
    expect_golden(list(s.experimental_local_results(next(iterator))), out["next2"])
    expect_golden(list(s.experimental_local_results(iterator.get_next())), out["next3"])
    assert out["next4_after_end"]["error"]["type"] == "StopIteration"
    with pytest.raises(StopIteration):
        next(iterator)

    iterator = iter(dist)
    for rec in out["get_next_as_optional_x4"]:
        opt = iterator.get_next_as_optional()
        assert opt.has_value() == rec["has_value"]
        if rec["has_value"]:
            expect_golden(list(s.experimental_local_results(opt.get_value())), rec["value"])

    assert out["len"]["error"]["type"] == "TypeError"
    with pytest.raises(TypeError, match="len"):
        len(dist)
    assert dist.cardinality == int(out["cardinality_attr"]["result"]["np_scalar"]) == 3
    assert spec_string(dist.element_spec) == out["element_spec"]


def test_dist_ds_accepts_numpy_batches_and_dataloader(strategy):
    """Any iterable of global batches is a dataset (README mapping): numpy arrays and a
    torch DataLoader split exactly like lists of tensors."""
    s = strategy(2)
    np_batches = [np.arange(i, min(i + 4, 10)) for i in range(0, 10, 4)]
    loader = torch.utils.data.DataLoader(torch.arange(10), batch_size=4)
    expected = [[[0, 1], [2, 3]], [[4, 5], [6, 7]], [[8], [9]]]
    assert _steps(s, s.experimental_distribute_dataset(np_batches)) == expected
    assert _steps(s, s.experimental_distribute_dataset(loader)) == expected


def test_dist_ds_rejects_a_tensor_as_dataset(strategy):
    s = strategy(2)
    with pytest.raises(TypeError, match="iterable of batches"):
        s.experimental_distribute_dataset(torch.arange(10))


def test_dist_ds_no_warning_for_ordinary_iteration(strategy):
    s = strategy(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(s.experimental_distribute_dataset(_batches(10, 4)))) == 3


def _before_each_split(monkeypatch, before) -> None:
    """Call ``before()`` ahead of every split of a step (on the thread that splits)."""
    import csrun.core.distribute.input as input_module
    split = input_module.split_batch

    def wrapped(*args, **kwargs):
        before()
        return split(*args, **kwargs)
    monkeypatch.setattr(input_module, "split_batch", wrapped)


def _record_split_threads(monkeypatch) -> list:
    threads: list = []
    _before_each_split(monkeypatch, lambda: threads.append(threading.current_thread()))
    return threads


@pytest.mark.parametrize("kind", [list, tuple])
def test_in_memory_batches_for_cpu_replicas_are_split_on_the_consumers_thread(
        kind, strategy, monkeypatch):
    # no reading ahead for batches already in memory (docs/performance.md): the same
    # steps as the prefetch thread gives an iterator of the same batches
    threads = _record_split_threads(monkeypatch)
    s = strategy(3)
    batches = kind(_batches(10, 4))
    assert _steps(s, s.experimental_distribute_dataset(batches)) == \
        [[[0, 1], [2, 3], []], [[4, 5], [6, 7], []], [[8], [9], []]]
    assert threads and all(t is threading.current_thread() for t in threads)
    threads.clear()
    assert _steps(s, s.experimental_distribute_dataset(iter(batches))) == \
        _steps(s, s.experimental_distribute_dataset(batches))
    assert any(t.name == "csrun-prefetch" for t in threads)


def test_in_memory_batches_fail_like_prefetched_ones(strategy):
    s = strategy(2)
    bad = [torch.arange(4), "not a batch", torch.arange(4)]
    for source in (bad, iter(bad)):
        iterator = iter(s.experimental_distribute_dataset(source))
        next(iterator)
        with pytest.raises(TypeError) as info:
            next(iterator)
        assert "str" in str(info.value)
        with pytest.raises(StopIteration):  # the iterator is spent after a failure
            next(iterator)


@pytest.mark.parametrize("source", [list, iter])
def test_batches_do_not_take_the_consumers_default_device_or_inference_mode(source, strategy):
    # in-memory batches are built on the consumer's thread: as on the prefetch thread,
    # numpy batches become CPU tensors a training step can use
    s = strategy(2)
    batches = source([np.arange(4, dtype=np.float32)])
    with torch.inference_mode():
        with torch.device("meta"):
            (step,) = list(s.experimental_distribute_dataset(batches))
    parts = s.experimental_local_results(step)
    assert [p.device.type for p in parts] == ["cpu", "cpu"]
    assert not any(p.is_inference() for p in parts)
    weight = torch.ones(2, requires_grad=True)
    (weight * parts[0]).sum().backward()  # an inference tensor could not be saved for this
    assert weight.grad.tolist() == [0.0, 1.0]


def test_ctrl_c_while_a_step_is_built_leaves_the_iterator_usable(strategy, monkeypatch):
    s = strategy(2)
    iterator = iter(s.experimental_distribute_dataset(_batches(8, 4)))
    calls: list = []

    def interrupted_once():
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
    _before_each_split(monkeypatch, interrupted_once)
    with pytest.raises(KeyboardInterrupt):
        next(iterator)
    # the interrupted step's batch was taken from the list already; the rest still comes
    assert [[t.tolist() for t in s.experimental_local_results(x)] for x in iterator] == \
        [[[4, 5], [6, 7]]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_dist_ds_fetch_to_device_with_a_gpu_replica():
    # deviation 2 on a real second device: components go to the replica's device unless
    # fetch_to_device=False, which leaves them on the host CPU.
    s = cs.CentralStorageStrategy(["GPU:0", "CPU:1"], "CPU:0")
    batches = _batches(6, 4)
    (first, *_) = list(s.experimental_distribute_dataset(batches))
    assert [t.device.type for t in first.values] == ["cuda", "cpu"]
    options = cs.InputOptions(experimental_fetch_to_device=False)
    (first, *_) = list(s.experimental_distribute_dataset(batches, options=options))
    assert [t.device.type for t in first.values] == ["cpu", "cpu"]
