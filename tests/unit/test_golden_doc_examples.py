"""The examples of TensorFlow's CentralStorageStrategy pages (shared/seeds), run on csrun.

Golden cases: ``doc_class_example``, ``doc_distribute_dataset_example``,
``doc_reduce_example_unbatched_R1``, ``doc_reduce_example_unbatched_R2``,
``doc_reduce_example_batch8_R2``, ``doc_reduce_example_batch4_R2``; the other examples
(distribute_datasets_from_function, make_numpy_dataset, scope, experimental_local_results,
make_input_fn_iterator / experimental_run, the reduce docstring's prose) are pinned from the
pages themselves. The values_from_function and gather examples are in
test_golden_values_from_function.py and test_golden_gather.py.

``@tf.function`` in the examples is dropped (no graph mode in csrun). The docs use
``compute_devices=['CPU:0', 'GPU:0']``; the golden runs use the logical CPUs of S2.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import csrun.core as cs

SUM = cs.ReduceOp.SUM


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_doc_class_example(num_replicas, golden, strategy, expect_golden):
    rec = golden["doc_class_example"]["outputs"][f"R{num_replicas}"]
    s = strategy(num_replicas)
    ds = list(torch.arange(5).split(2))
    dist_dataset = s.experimental_distribute_dataset(ds)
    results = []
    with s.scope():
        def train_step(val):
            return val + 1

        for x in dist_dataset:
            results.append(list(s.experimental_local_results(s.run(train_step, args=(x,)))))
    expect_golden(results, rec)


def test_doc_class_example_tf21_experimental_run_v2(golden, strategy, expect_golden):
    # The TF 1.15/2.1 page spells it strategy.experimental_run_v2 (deviation 8: a deprecated
    # alias of run).
    rec = golden["doc_class_example"]["outputs"]["R2"]
    s = strategy(2)
    results = []
    with s.scope():
        for x in s.experimental_distribute_dataset(list(torch.arange(5).split(2))):
            with pytest.warns(DeprecationWarning, match="run"):
                out = s.experimental_run_v2(lambda val: val + 1, args=(x,))
            results.append(list(s.experimental_local_results(out)))
    expect_golden(results, rec)


def test_doc_distribute_dataset_example(golden, strategy):
    out = golden["doc_distribute_dataset_example"]["outputs"]
    s = strategy(2)
    dist_dataset = s.experimental_distribute_dataset(list(torch.arange(10).split(2)))
    steps = [[t.tolist() for t in s.experimental_local_results(x)] for x in dist_dataset]
    assert steps == out["steps"]
    first = next(iter(dist_dataset))
    text = repr(first)
    # TF: "PerReplica:{\n  0: <tf.Tensor ... [0]>,\n  1: <tf.Tensor ... [1]>\n}"
    assert out["first_step_repr"].startswith("PerReplica:{\n  0: ")
    assert text.startswith("PerReplica:{\n  0: ") and "\n  1: " in text and text.endswith("\n}")
    assert repr(first.values[0]) in text and repr(first.values[1]) in text


def _doc_reduce_run(s, ds):
    dist_dataset = s.experimental_distribute_dataset(ds)
    per_step = []
    with s.scope():
        def train_step(val):
            return val  # pass through

        for x in dist_dataset:
            result = s.run(train_step, args=(x,))
            per_step.append(list(s.experimental_local_results(result)))
    return per_step, result


@pytest.mark.parametrize("case_id,batch", [("doc_reduce_example_batch8_R2", 8),
                                           ("doc_reduce_example_batch4_R2", 4)])
def test_doc_reduce_example_batched(case_id, batch, golden, strategy, expect_golden):
    out = golden[case_id]["outputs"]
    s = strategy(2)
    per_step, result = _doc_reduce_run(s, list(torch.arange(10).split(batch)))
    expect_golden(per_step, out["per_step_results"])
    assert type(result).__name__ == out["final_result_type"]
    expect_golden(list(s.experimental_local_results(result)), out["final_result_local"])
    summed = s.reduce(SUM, result, axis=None)
    expect_golden(summed, out["reduce_SUM_axis_None"]["result"])
    # the plain result of the first reduce counts as present on both replicas: 2 x 17
    expect_golden(s.reduce(SUM, summed, axis=0), out["reduce_SUM_axis0_of_that"]["result"])
    expect_golden(s.reduce(SUM, result, axis=0), out["reduce_SUM_axis0_direct"]["result"])


def test_doc_reduce_example_prose(strategy):
    """The reduce docstring: global batch 8 on 2 replicas puts [0, 1, 2, 3] on replica 0 and
    [4, 5, 6, 7] on replica 1; by default reduce returns [0+4, 1+5, 2+6, 3+7]; with axis=0
    the scalar 0+1+...+7. (The docstring's comments "[4, 6, 8, 10]" then "28": the 28 is
    what reducing the per-replica value with axis=0 gives; reducing the already-reduced
    plain tensor again counts it on both replicas, as TF does -- see the batch8 case.)"""
    s = strategy(2)
    (x,) = list(s.experimental_distribute_dataset([torch.arange(8)]))
    assert [t.tolist() for t in x.values] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert s.reduce(SUM, x, axis=None).tolist() == [4, 6, 8, 10]
    assert int(s.reduce(SUM, x, axis=0)) == 28
    assert int(s.reduce(SUM, s.reduce(SUM, x, axis=None), axis=0)) == 56
    # partial batch: MEAN with axis=0 uses the true denominator
    (y,) = list(s.experimental_distribute_dataset([torch.arange(6, dtype=torch.float32)]))
    assert float(s.reduce("MEAN", y, axis=0)) == pytest.approx(2.5, abs=1e-6)


def test_doc_reduce_example_unbatched_R1(golden, strategy, expect_golden):
    out = golden["doc_reduce_example_unbatched_R1"]["outputs"]
    s = strategy(1)
    per_step, result = _doc_reduce_run(s, list(torch.arange(10)))
    expect_golden(per_step, out["per_step_results"])
    assert isinstance(result, torch.Tensor) and out["final_result_type"] == "EagerTensor"
    expect_golden(list(s.experimental_local_results(result)), out["final_result_local"])
    summed = s.reduce(SUM, result, axis=None)
    expect_golden(summed, out["reduce_SUM_axis_None"]["result"])
    for key, value in (("reduce_SUM_axis0_of_that", summed), ("reduce_SUM_axis0_direct", result)):
        assert out[key]["error"]["type"] == "ValueError"
        with pytest.raises(ValueError, match="axis"):
            s.reduce(SUM, value, axis=0)


def test_doc_reduce_example_unbatched_R2_is_value_error(golden, strategy):
    # Intended deviation 1 (doc_reduce_example_unbatched_R2): TF raises IndexError; csrun
    # raises a ValueError that says the dataset yields unbatched elements.
    rec = golden["doc_reduce_example_unbatched_R2"]["outputs"]["experimental_distribute_dataset"]
    assert rec["error"]["type"] == "IndexError"
    s = strategy(2)
    with pytest.raises(ValueError, match=r"(?i)unbatched"):
        _doc_reduce_run(s, list(torch.arange(10)))


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_doc_distribute_datasets_from_function_example(num_replicas, strategy):
    s = strategy(num_replicas)
    global_batch_size = 6

    def dataset_fn(input_context):
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        d = (torch.tensor([[1.0]]).repeat(batch_size, 1) for _ in itertools.count())
        return itertools.islice(d, input_context.input_pipeline_id, None,
                                input_context.num_input_pipelines)

    inputs = s.distribute_datasets_from_function(dataset_fn)
    iterator = iter(inputs)
    try:
        for _ in range(3):
            batch = next(iterator)
            replica_results = s.run(lambda b: b.sum(), args=(batch,))
            local = s.experimental_local_results(replica_results)
            assert [float(v) for v in local] == [global_batch_size / num_replicas] * num_replicas
            for t in s.experimental_local_results(batch):
                assert tuple(t.shape) == (global_batch_size // num_replicas, 1)
    finally:
        iterator.close()


def test_doc_make_numpy_dataset_example(strategy):
    # deviation 8: works (TF 2.21 removed it from the v2 class) with a DeprecationWarning and
    # returns a torch map-style dataset of slices; batch it, then distribute it.
    s = strategy(2)
    numpy_input = np.ones([10], dtype=np.float32)
    with pytest.warns(DeprecationWarning):
        dataset = s.experimental_make_numpy_dataset(numpy_input)
    assert isinstance(dataset, torch.utils.data.Dataset) and len(dataset) == 10
    loader = torch.utils.data.DataLoader(dataset, batch_size=2)
    dist_dataset = s.experimental_distribute_dataset(loader)
    steps = [[t.tolist() for t in s.experimental_local_results(x)] for x in dist_dataset]
    assert steps == [[[1.0], [1.0]]] * 5


def test_doc_scope_example(strategy):
    s = strategy(2)
    with s.scope():
        assert cs.get_strategy() is s
        in_scope = cs.Variable(1.0)
    regular = cs.Variable(1.0)
    assert cs.get_strategy() is not s
    assert in_scope.distribute_strategy is s and regular.distribute_strategy is None
    assert s.extended.variable_created_in_scope(in_scope)
    assert not s.extended.variable_created_in_scope(regular)
    assert float(in_scope) == float(regular) == 1.0
    with s.scope():
        module = torch.nn.Linear(2, 1)
    assert s.extended.variable_created_in_scope(module.weight)


def test_doc_experimental_local_results_single_value(strategy):
    s = strategy(2)
    t = torch.tensor(1.0)
    assert s.experimental_local_results(t) == (t,)
    assert isinstance(s.experimental_local_results(s.run(lambda: torch.tensor(0.0))), tuple)


def test_doc_cluster_resolver_is_none_on_one_machine(golden, strategy):
    assert golden["cluster_resolver_and_ps_strategies"]["outputs"]["CSS.cluster_resolver"] == \
        "None"
    assert strategy(2).cluster_resolver is None


def test_doc_make_input_fn_iterator_and_experimental_run(strategy):
    # ParameterServerStrategy page (004): input_fn with per-replica batch size and shard,
    # iterator = strategy.make_input_fn_iterator(input_fn), strategy.experimental_run(fn, it)
    s = strategy(2)
    global_batch_size = 4
    contexts = []

    def input_fn(input_context):
        contexts.append(input_context)
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        d = list(torch.arange(8.0).split(batch_size))
        return d[input_context.input_pipeline_id::input_context.num_input_pipelines]

    with s.scope():
        iterator = s.make_input_fn_iterator(input_fn)
        assert iterator.initialize() == []
        replica_results = s.experimental_run(lambda b: b * 10, iterator)
    assert [t.tolist() for t in s.experimental_local_results(replica_results)] == \
        [[0.0, 10.0], [20.0, 30.0]]
    assert len(contexts) == 1 and contexts[0].num_input_pipelines == 1
