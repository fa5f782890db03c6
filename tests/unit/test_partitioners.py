"""TF's partitioners and where shards go: the split rule, placement, row routing, and the
config's `strategy.variable_partitioner` (checked before anything runs)."""

import pytest
import torch

from csrun.core import (FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner,
                        Partitioner)
from csrun.core.cluster.plan import ShardingPlan, placement, shard_count
from csrun.core.cluster.sharded_variable import partitioner_from_config
from csrun.core.config.problems import ConfigError
from csrun.core.runner.cluster_role import job_settings
from csrun.core.runner.preflight import load_config_text


def test_fixed_shards_as_tfs_docstring_says():
    assert FixedShardsPartitioner(2)((10, 3), torch.float32) == [2, 1]
    assert shard_count(FixedShardsPartitioner(4), (3, 5), torch.float32) == 3  # one per row
    assert shard_count(FixedShardsPartitioner(4), (), torch.float32) == 1      # a scalar
    with pytest.raises(ValueError, match="num_shards must be at least 1"):
        FixedShardsPartitioner(0)


def test_min_size_gives_one_shard_per_min_shard_bytes_rounded_up_as_tf():
    partitioner = MinSizePartitioner(min_shard_bytes=400, max_shards=8)
    assert shard_count(partitioner, (100, 4), torch.float32) == 4  # 1600 bytes
    assert shard_count(partitioner, (10, 4), torch.float32) == 1   # 160 bytes: whole
    assert shard_count(MinSizePartitioner(1, max_shards=3), (100, 4), torch.float32) == 3
    assert shard_count(MinSizePartitioner(), (1000, 4), torch.float32) == 1  # TF's defaults
    # 300 KiB over TF's 256 KiB: two shards (TF's min_max_variable_partitioner rounds up)
    assert shard_count(MinSizePartitioner(max_shards=4), (76800, 1), torch.float32) == 2


def test_a_partitioner_that_splits_anything_but_dim_0_is_refused_naming_it():
    class Columns(Partitioner):
        def __call__(self, shape, dtype, axis=0):
            return [1, 2]

    with pytest.raises(ValueError, match=r"variable_partitioner must return a list/tuple "
                                         r"whose elements are 1 besides the first element "
                                         r"\(non-zero\), got: \[1, 2\]"):
        ShardingPlan.of([torch.zeros(6, 4)], 2, partitioner=Columns())


class Returns(Partitioner):
    def __init__(self, parts):
        self.parts = parts

    def __call__(self, shape, dtype, axis=0):
        return self.parts


# TF 2.21's ParameterServerStrategyV2._create_variable and its partitioners, as run
@pytest.mark.parametrize("partitioner, shape, shards", [
    (Returns([2]), (4, 4), 2),          # shorter than the shape: TF takes it
    (Returns([2, 1, 1]), (4, 4), 2),    # longer: too
    (Returns([3]), (1, 4), 1),          # a one-row variable reaches the partitioner
    (Returns([True, 1]), (4, 4), 1),    # True == 1
    (MinSizePartitioner(4, 3), (0, 4), 1),  # no rows: [1, 1], whole
    (MinSizePartitioner(1.5, 1000), (25, 1), 25),  # ceil(100 / 1.5) = 67, 25 rows
    (MinSizePartitioner(1, 3, bytes_per_string=4), (10, 1), 3),
])
def test_the_partitioners_results_are_taken_as_tf_takes_them(partitioner, shape, shards):
    assert shard_count(partitioner, shape, torch.float32) == shards


@pytest.mark.parametrize("partitioner, shape, message", [
    (FixedShardsPartitioner(2), (0, 4), r"besides the first element \(non-zero\), got: \[0, 1\]"),
    (Returns([]), (4, 4), r"got: \[\]"),
    (Returns([2.5, 1]), (4, 4), r"first element must be a positive whole number"),
    (Returns([3, 1]), (0, 4), r"into 3 shards, but it has no rows"),
])
def test_what_tf_refuses_is_refused_naming_the_partitioner(partitioner, shape, message):
    with pytest.raises(ValueError, match=message):
        shard_count(partitioner, shape, torch.float32)


def test_partitioners_take_tfs_arguments_and_refuse_counts_that_are_not_counts():
    assert FixedShardsPartitioner(2)((10, 4), torch.float32, axis=1) == [1, 2]
    for partitioner in (FixedShardsPartitioner(2), MaxSizePartitioner(4)):
        # TF indexes past the shape (IndexError, a crash): csrun says what is wrong
        with pytest.raises(ValueError, match=r"along axis 0 when shape is only \(\)"):
            partitioner((), torch.float32)
        with pytest.raises(ValueError, match=r"along axis 2 when shape is only \(10, 3\)"):
            partitioner((10, 3), torch.float32, axis=2)
    with pytest.raises(ValueError, match=r"Cannot partition variable along axis 0 when "
                                         r"shape is only \(\)"):
        MinSizePartitioner(4, 3)((), torch.float32)
    for count in (2.5, "2", True):  # TF takes them, then fails making a variable
        with pytest.raises(TypeError, match="num_shards must be a whole number"):
            FixedShardsPartitioner(count)
    with pytest.raises(ValueError, match="min_shard_bytes` must be positive"):
        MinSizePartitioner(0)
    with pytest.raises(ValueError, match="bytes_per_string` must be positive"):
        MinSizePartitioner(bytes_per_string=0)


def test_max_size_keeps_shards_within_max_shard_bytes_as_tf():
    # TF's docstring: [6, 1] float32 under 4 bytes a shard, 2 at most, 1024 bytes
    assert MaxSizePartitioner(4)((6, 1), torch.float32) == [6, 1]
    assert MaxSizePartitioner(4, max_shards=2)((6, 1), torch.float32) == [2, 1]
    assert MaxSizePartitioner(1024)((6, 1), torch.float32) == [1, 1]
    # whole rows: 12 bytes take 3 of 4-byte rows a shard, ceil(7 / 3) = 3 shards
    assert MaxSizePartitioner(12)((7,), torch.float32) == [3]
    # a fractional size rounds the rows down: floor(3.5) = 3 int8 rows, ceil(100 / 3) = 34
    assert MaxSizePartitioner(3.5)((100,), torch.int8) == [34]
    assert MaxSizePartitioner(16, max_shards=0)((10, 3), torch.float32) == [10, 1]  # 0: none
    assert MaxSizePartitioner(4)((10, 3), torch.float32, axis=1) == [1, 3]
    assert shard_count(MaxSizePartitioner(12, 2), (10, 3), torch.float32) == 2
    with pytest.raises(ValueError, match=r"has no rows"):  # TF divides by zero
        MaxSizePartitioner(4)((0, 4), torch.float32)
    for bad, message in ((dict(max_shard_bytes=0), "max_shard_bytes` must be positive"),
                         (dict(max_shard_bytes=8, max_shards=-1), "max_shards` must be positive"),
                         (dict(max_shard_bytes=8, bytes_per_string=0),
                          "bytes_per_string` must be positive")):
        with pytest.raises(ValueError, match=message):
            MaxSizePartitioner(**bad)
    with pytest.raises(TypeError, match="max_shards must be a whole number"):
        MaxSizePartitioner(8, max_shards=2.5)


def test_a_plain_function_partitions_as_a_partitioner_does():
    asked = []

    def halves(shape, dtype):  # TF takes any callable
        asked.append(tuple(shape))
        return [2] + [1] * (len(shape) - 1)

    plan = ShardingPlan.of([torch.zeros(6, 4), torch.zeros(()), torch.zeros(5)], 2,
                           partitioner=halves)
    assert [(s.var, s.start, s.stop, s.ps) for s in plan.shards] == [
        (0, 0, 3, 0), (0, 3, 6, 1), (1, 0, 1, 0), (2, 0, 3, 1), (2, 3, 5, 0)]
    assert asked == [(6, 4), (5,)]  # a scalar is never offered, as in TF


def test_a_colocated_variable_is_not_counted_by_the_round_robin():
    # TF: colocate_vars_with places a variable with its target, outside the count
    assert placement([4] * 6, 3, colocate={1: 0, 5: 0}) == [0, 0, 1, 2, 0, 0]
    plan = ShardingPlan.of([torch.zeros(4), torch.zeros(4), torch.zeros(4), torch.zeros(4)],
                           3, colocate={1: 0})
    assert [s.ps for s in plan.shards] == [0, 0, 1, 2]


def test_a_variable_without_rows_is_placed_whole():
    plan = ShardingPlan.of([torch.zeros(0, 4), torch.zeros(3)], 2,
                           partitioner=MinSizePartitioner(4, 3))
    assert [(s.var, s.rows, s.ps) for s in plan.shards] == [(0, 0, 0), (1, 1, 1), (1, 1, 0),
                                                           (1, 1, 1)]


def test_shards_split_rows_tfs_way_and_go_round_robin_as_variables_would():
    layout = ShardingPlan.of([torch.zeros(10, 2), torch.zeros(3)], 2,
                       partitioner=FixedShardsPartitioner(3))
    assert [(s.var, s.start, s.stop, s.ps) for s in layout.shards] == [
        (0, 0, 4, 0), (0, 4, 7, 1), (0, 7, 10, 0), (1, 0, 1, 1), (1, 1, 2, 0), (1, 2, 3, 1)]
    ids = torch.tensor([0, 3, 4, 9])
    routed = [(shard.id, ids[where].tolist()) for shard, where in layout.split_rows(0, ids)]
    assert routed == [(0, [0, 3]), (1, [4]), (2, [9])]


def test_unpartitioned_and_colocated_variables_stay_whole():
    layout = ShardingPlan.of([torch.zeros(10, 2), torch.zeros(8)], 3, colocate={1: 0},
                       partitioner=FixedShardsPartitioner(2))
    assert [(s.var, s.rows) for s in layout.shards] == [(0, 5), (0, 5), (1, 8)]
    assert layout.owner(1) == layout.owner(0)


CONFIG = """\
strategy:
  kind: parameter_server
  cluster: {worker: ["127.0.0.1:2"], ps: ["127.0.0.1:3", "127.0.0.1:4"]}
  task: {type: worker, index: 0}
  variable_partitioner: PARTITIONER
dataset:
  source: {kind: synthetic, examples: 32, features: 4, classes: 3}
  steps: [{op: batch, size: 8}]
model: {kind: mlp, hidden: [8]}
optimizer: {name: SGD, lr: 0.1}
train: {steps: 2}
"""


@pytest.mark.parametrize("text, expected", [
    ("{kind: fixed, num_shards: 3}", FixedShardsPartitioner),
    ("{kind: min_size, min_shard_bytes: 1024, max_shards: 4}", MinSizePartitioner),
    ("{kind: max_size, max_shard_bytes: 4096}", MaxSizePartitioner),
])
def test_the_config_gives_tfs_partitioners_and_every_task_must_agree(text, expected):
    config = load_config_text(CONFIG.replace("PARTITIONER", text), "c.yaml")
    assert isinstance(partitioner_from_config(config.strategy.variable_partitioner), expected)
    assert job_settings(config)["strategy.variable_partitioner"]["kind"] in text


@pytest.mark.parametrize("text, path", [
    ("{kind: fixed, num_shards: 0}", "strategy.variable_partitioner.num_shards"),
    ("{kind: min_size, max_shards: 0}", "strategy.variable_partitioner.max_shards"),
    ("{kind: max_size}", "strategy.variable_partitioner.max_shard_bytes"),
    ("{kind: rows}", "strategy.variable_partitioner"),
])
def test_a_partitioner_that_cannot_split_is_refused_before_anything_runs(text, path):
    with pytest.raises(ConfigError) as caught:
        load_config_text(CONFIG.replace("PARTITIONER", text), "c.yaml")
    assert any(p.path.startswith(path) for p in caught.value.problems), caught.value.problems


def test_a_partitioner_in_a_central_storage_config_is_refused():
    text = CONFIG.replace("PARTITIONER", "{kind: fixed, num_shards: 2}").replace(
        "parameter_server", "central_storage")
    text = "\n".join(line for line in text.splitlines() if "cluster" not in line
                     and "task:" not in line)
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, "c.yaml")
    (problem,) = [p for p in caught.value.problems
                  if p.path == "strategy.variable_partitioner"]
    assert "kind: parameter_server" in problem.hint
