"""The input pipeline: tf.data-style steps over an index plan, loaded by a DataLoader."""

import numpy as np
import pytest
import torch

from csrun.core.config.schema import DatasetConfig
from csrun.core.data.pipeline import Pipeline
from csrun.core.data.sources import load_source, split_holdout
from csrun.core.config.problems import ConfigError


def double_features(x, y, factor=2.0):
    """A ``map`` function (imported by name: test_datasets_pipeline:double_features)."""
    return x * factor, y


def pipeline(steps, stop=10, seed=0, **extra):
    config = DatasetConfig.model_validate(
        {"source": {"kind": "range", "stop": stop}, "steps": steps, **extra})
    data = load_source(config.source)
    return Pipeline(config, data, torch.arange(len(data)), seed)


def values(loader):
    return [x.flatten().int().tolist() for x, _ in loader]


def test_batch_repeat_take_skip_in_order():
    p = pipeline([{"op": "batch", "size": 4}])
    assert list(p.plan(0)) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    p = pipeline([{"op": "batch", "size": 4, "drop_remainder": True},
                  {"op": "repeat", "count": 2}])
    assert list(p.plan(0)) == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
    p = pipeline([{"op": "skip", "count": 2}, {"op": "take", "count": 5},
                  {"op": "batch", "size": 2}])
    assert list(p.plan(0)) == [[2, 3], [4, 5], [6]]
    assert p.batches_per_epoch() == 3 and not p.infinite


def test_shard_explicit_and_by_input_pipeline():
    p = pipeline([{"op": "shard", "num_shards": 3, "index": 1}, {"op": "batch", "size": 10}])
    assert list(p.plan(0)) == [[1, 4, 7]]
    p = pipeline([{"op": "shard"}, {"op": "batch", "size": 10}])
    assert list(p.plan(0)) == [list(range(10))]  # one pipeline: everything
    assert list(p.plan(0, pipelines=2, pipeline_id=1)) == [[1, 3, 5, 7, 9]]
    with pytest.raises(ConfigError) as info:
        pipeline([{"op": "shard", "num_shards": 2, "index": 2}, {"op": "batch", "size": 1}])
    assert info.value.problems[0].path == "dataset.steps.0.index"


def test_shuffle_is_seeded_and_reshuffles_each_epoch():
    steps = [{"op": "shuffle", "buffer": 100}, {"op": "batch", "size": 10}]
    first = list(pipeline(steps, seed=1).plan(0))
    assert first == list(pipeline(steps, seed=1).plan(0))
    assert sorted(first[0]) == list(range(10)) and first[0] != list(range(10))
    assert first != list(pipeline(steps, seed=2).plan(0))
    assert first != list(pipeline(steps, seed=1).plan(1))  # the next epoch
    fixed = [{"op": "shuffle", "buffer": 100, "reshuffle_each_iteration": False},
             {"op": "batch", "size": 10}]
    p = pipeline(fixed, seed=1)
    assert list(p.plan(0)) == list(p.plan(1))


def test_small_shuffle_buffer_only_mixes_locally():
    p = pipeline([{"op": "shuffle", "buffer": 2}, {"op": "batch", "size": 100}], stop=100)
    order = next(p.plan(0))
    assert sorted(order) == list(range(100))
    assert all(abs(pos - value) < 50 for pos, value in enumerate(order))


def _reference_shuffle(stream, buffer, seed):
    """tf.data's buffered shuffle one example at a time (the plan's order before it was
    worked out in chunks): a plan must not change order across releases (resume)."""
    rng, window, draws = np.random.default_rng(seed), [], []
    for item in stream:
        if len(window) < buffer:
            window.append(item)
            continue
        if not draws:
            draws = rng.random(1024).tolist()
        j = int(draws.pop() * buffer)
        yield window[j]
        window[j] = item
    while window:
        if not draws:
            draws = rng.random(1024).tolist()
        j = int(draws.pop() * len(window))
        yield window[j]
        window[j] = window[-1]
        window.pop()


@pytest.mark.parametrize("chunk", [1, 256])
@pytest.mark.parametrize("n", [0, 1, 9, 1000, 4097])
@pytest.mark.parametrize("buffer", [1, 7, 256, 300, 5000])
def test_shuffle_order_is_the_example_by_example_buffered_shuffle(n, buffer, chunk):
    from csrun.core.data.pipeline import _shuffled
    assert list(_shuffled(iter(range(n)), buffer, 3, chunk)) == \
        list(_reference_shuffle(iter(range(n)), buffer, 3))


def test_a_streamed_plan_hands_on_every_example_read_before_a_failing_one():
    # chunk=1, as for streamed datasets: what was shuffled out before the failing read
    # arrives, then the error (a chunk would have held it back)
    from csrun.core.data.pipeline import _shuffled

    def source():
        yield from range(20)
        raise OSError("bad record")
    got = []
    with pytest.raises(OSError):
        for item in _shuffled(source(), 4, 0, 1):
            got.append(item)
    expected = []
    with pytest.raises(OSError):
        for item in _reference_shuffle(source(), 4, 0):
            expected.append(item)
    assert got == expected and len(got) == 16


def test_shuffle_reads_an_endless_stream_only_a_window_ahead():
    import itertools

    from csrun.core.data.pipeline import _shuffled
    stream = itertools.count()
    assert len(list(itertools.islice(_shuffled(stream, 10, 0), 5))) == 5
    assert next(stream) <= 20  # the window and one chunk of at most its size


def test_repeat_reshuffles_each_repetition():
    p = pipeline([{"op": "shuffle", "buffer": 10}, {"op": "repeat", "count": 2},
                  {"op": "batch", "size": 10}])
    a, b = list(p.plan(0))
    assert sorted(a) == sorted(b) and a != b


def test_infinite_repeat_and_empty_repeat():
    p = pipeline([{"op": "batch", "size": 3}, {"op": "repeat"}])
    assert p.infinite and p.batches_per_epoch() is None
    plan = p.plan(0)
    assert [next(plan) for _ in range(5)][-2:] == [[9], [0, 1, 2]]
    p = pipeline([{"op": "take", "count": 0}, {"op": "repeat"}, {"op": "batch", "size": 3}])
    assert list(p.plan(0)) == []  # repeating nothing ends instead of hanging


def test_loader_skips_to_a_position_without_changing_what_follows():
    p = pipeline([{"op": "shuffle", "buffer": 100}, {"op": "batch", "size": 3}], stop=20)
    whole = values(p.loader(epoch=2))
    assert values(p.loader(epoch=2, skip=4)) == whole[4:]
    assert len(p.loader(epoch=2, skip=4)) == len(whole) - 4


@pytest.mark.process
def test_worker_processes_load_the_same_batches():
    steps = [{"op": "shuffle", "buffer": 50}, {"op": "batch", "size": 7},
             {"op": "map", "fn": "test_datasets_pipeline:double_features"}]
    in_process = values(pipeline(steps, stop=50).loader(0))
    assert values(pipeline(steps, stop=50, workers=2).loader(0)) == in_process


def test_map_and_normalize_before_and_after_batch():
    p = pipeline([{"op": "map", "fn": "test_datasets_pipeline:double_features",
                   "kwargs": {"factor": 3.0}}, {"op": "batch", "size": 5},
                  {"op": "normalize", "mean": 1.0, "std": 2.0}])
    x, y = next(iter(p.loader(0)))
    assert x.flatten().tolist() == [(3 * i - 1) / 2 for i in range(5)]
    assert y.flatten().tolist() == [0, 1, 2, 3, 4]  # targets untouched
    with pytest.raises(ConfigError) as info:
        pipeline([{"op": "map", "fn": "test_datasets_pipeline:nope"},
                  {"op": "normalize", "mean": [1, 2], "std": 0}, {"op": "batch", "size": 2}])
    paths = [p.path for p in info.value.problems]
    assert paths == ["dataset.steps.0.fn", "dataset.steps.1.mean", "dataset.steps.1.std"]


def test_one_batch_step_required():
    with pytest.raises(ConfigError) as info:
        pipeline([{"op": "batch", "size": 2}, {"op": "batch", "size": 2}])
    assert "second batch" in info.value.problems[0].message


def test_eval_loader_reads_in_order_with_the_transforms():
    p = pipeline([{"op": "shuffle", "buffer": 10}, {"op": "batch", "size": 4},
                  {"op": "normalize", "mean": 0.0, "std": 0.5}])
    assert values(p.eval_loader(torch.tensor([9, 3, 5]), 2)) == [[18, 6], [10]]


def test_sources():
    synthetic = load_source(DatasetConfig.model_validate(
        {"source": {"kind": "synthetic", "examples": 50, "features": 3, "classes": 5},
         "steps": [{"op": "batch", "size": 1}]}).source)
    assert synthetic.features.shape == (50, 3) and synthetic.classes == 5
    digits = load_source(DatasetConfig.model_validate(
        {"source": {"kind": "digits", "layout": "image"},
         "steps": [{"op": "batch", "size": 1}]}).source)
    assert digits.features.shape == (1797, 1, 8, 8) and float(digits.features.max()) == 1.0
    assert digits.targets.bincount().tolist()[:3] == [178, 182, 177]


def _file_source(path, **fields):
    config = DatasetConfig.model_validate(
        {"source": {"kind": "file", "path": str(path), **fields},
         "steps": [{"op": "batch", "size": 1}]})
    return load_source(config.source)


def test_file_sources(tmp_path):
    np.savez(tmp_path / "d.npz", x=np.ones((4, 2)), y=np.array([0, 1, 1, 2]))
    data = _file_source(tmp_path / "d.npz")
    assert data.task == "classification" and data.classes == 3
    np.save(tmp_path / "d.npy", np.array([[1.0, 2.0, 0.5], [3.0, 4.0, 1.5]]))
    data = _file_source(tmp_path / "d.npy")
    assert data.task == "regression" and data.targets.tolist() == [[0.5], [1.5]]
    (tmp_path / "d.csv").write_text("a,label,b\n1,0,2\n3,1,4\n")
    data = _file_source(tmp_path / "d.csv", target_column="label")
    assert data.features.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert data.targets.tolist() == [0, 1]


def test_file_source_errors(tmp_path):
    np.savez(tmp_path / "d.npz", features=np.ones((2, 2)), y=np.zeros(2))
    with pytest.raises(ConfigError) as info:
        _file_source(tmp_path / "d.npz")
    assert info.value.problems[0].path == "dataset.source.features_key"
    assert "features" in info.value.problems[0].hint
    (tmp_path / "d.csv").write_text("a,label\n1,0\n")
    with pytest.raises(ConfigError) as info:
        _file_source(tmp_path / "d.csv", target_column="lable")
    assert info.value.problems[0].hint == "did you mean 'label'?"
    with pytest.raises(ConfigError) as info:
        _file_source(tmp_path / "missing.npy")
    assert "not found" in info.value.problems[0].message


def test_holdout_split_is_seeded_and_disjoint():
    train, held = split_holdout(100, 0.25, seed=3)
    assert len(held) == 25 and len(train) == 75
    assert sorted(train.tolist() + held.tolist()) == list(range(100))
    assert held.tolist() == split_holdout(100, 0.25, seed=3)[1].tolist()
    assert held.tolist() != split_holdout(100, 0.25, seed=4)[1].tolist()


@pytest.mark.parametrize("steps", [
    [{"op": "batch", "size": 4}],
    [{"op": "batch", "size": 4, "drop_remainder": True}, {"op": "repeat", "count": 3}],
    [{"op": "repeat", "count": 3}, {"op": "skip", "count": 7}, {"op": "batch", "size": 4}],
    [{"op": "shard", "num_shards": 3, "index": 2}, {"op": "take", "count": 2},
     {"op": "batch", "size": 1}],
    [{"op": "shard"}, {"op": "batch", "size": 3}, {"op": "shard", "num_shards": 2,
                                                    "index": 1}],
    [{"op": "repeat"}, {"op": "shuffle", "buffer": 5}, {"op": "take", "count": 13},
     {"op": "batch", "size": 5}],
    [{"op": "skip", "count": 50}, {"op": "repeat"}, {"op": "take", "count": 4},
     {"op": "batch", "size": 2}],
])
def test_batches_per_epoch_is_counted_as_the_plan_walks(steps):
    """The count is arithmetic (a repeat of 10**12 cannot be walked); it must equal the
    plan's length for every op, input pipeline and per-replica batch size."""
    p = pipeline(steps)
    for pipelines, pipeline_id, batch_size in ((1, 0, None), (2, 1, None), (3, 0, 2)):
        walked = sum(1 for _ in p.plan(0, pipelines, pipeline_id, batch_size))
        assert p.batches_per_epoch(pipelines, pipeline_id, batch_size) == walked


@pytest.mark.timeout(60)
def test_a_huge_repeat_count_is_counted_at_once():
    """Walking 10**12 repeats took forever: validate and train spun before any step."""
    import threading
    p = pipeline([{"op": "repeat", "count": 10**12}, {"op": "batch", "size": 4}])
    counted = []
    thread = threading.Thread(target=lambda: counted.append(p.steps_per_epoch(2)),
                              daemon=True)
    thread.start()
    thread.join(timeout=5)
    assert counted == [10**13 // 4]
