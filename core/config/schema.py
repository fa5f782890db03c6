"""The run configuration's schema: one pydantic model per section, every field described.

A config is a YAML file with six sections (``strategy``, ``dataset``, ``model``,
``optimizer``, ``train``, ``checkpoint``), optionally changed by ``key=value`` overrides
(dotted paths, values parsed as YAML). Precedence: **override > file > default**.

Every field is documented with ``Field(description=...)``; ``docs/config.md`` is generated
from these models (:mod:`csrun.core.config.reference`). Unknown keys are rejected.

Loading a file (YAML with ``file:line`` errors, overrides) is :mod:`.loading`; checking it
against this machine and its data is the runner's preflight.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue

from .addresses import is_address

__all__ = [
    "RunConfig", "StrategyConfig", "CentralStorageConfig", "ParameterServerConfig",
    "ClusterConfig", "TaskConfig", "DatasetConfig", "TrainConfig", "CheckpointConfig",
    "OptimizerConfig", "TableOptimizerConfig", "ScheduleConfig", "ParamGroupConfig", "EarlyStoppingConfig",
    "BestCheckpointConfig", "ModelConfig", "SourceConfig", "StepConfig",
    "ImportSource", "LOSS_NAMES", "SECTIONS",
]


class _Section(BaseModel):
    # NaN and infinity are refused everywhere: no setting means them, and they would
    # surface much later as a non-finite loss
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# Integers are 64-bit: torch, numpy and itertools take no more, and a value past that is
# a typo, not a size; refusing it here keeps it from failing deep inside a run.
# (A validator, not ge/le bounds: those would replace a field's own ge=0.)
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1


def _int64(value: int) -> int:
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{value} does not fit in 64 bits (at most {INT64_MAX})")
    return value


Int64 = Annotated[int, AfterValidator(_int64)]


def _within(low: float | None, high: float, unit: str, why: str,
            why_low: str = "") -> AfterValidator:
    """A bound past which a number cannot be held by the code that takes it (a C int of
    milliseconds, an 8-bit device index, a buffer made of it), with that reason in the
    message: found by ``validate``, not as an ``OverflowError`` deep inside ``train``."""
    def check(value):
        if low is not None and value < low:
            raise ValueError(f"{_shown(value)}{unit} is less than {_shown(low)}{unit}, the "
                             f"least it can be: {why_low}")
        if value > high:
            raise ValueError(f"{_shown(value)}{unit} is more than {_shown(high)}{unit}, the "
                             f"most it can be: {why}")
        return value
    return AfterValidator(check)


def _shown(number: float) -> str:
    if isinstance(number, int):
        return f"{number:,}"
    return f"{number:,.0f}" if float(number).is_integer() and abs(number) < 1e16 else \
        f"{number:g}"


# torch's store and gloo count a wait in milliseconds, in C ints (2**31 - 1 ms is 24.8
# days), and a task waits up to twice this plus 5 s; under 1 ms is 0 ms: no wait at all
TIMEOUT_S = (0.001, 1_000_000.0)
# a deque of the last 3 log windows' losses judges divergence, checkpointed at its full
# size: a window of 10**18 steps could not be made, one of 10**9 would take 24 GB
MAX_LOG_EVERY = 1_000_000
MAX_GPUS = 128  # torch numbers a machine's devices in 8 bits: cuda:128 is cuda:-128
MAX_PREFETCH = 1024  # batches held read ahead; the DataLoader queues prefetch x workers
# a range source's examples are float32, which holds every integer only up to 2**24
# (range(2**63 - 99, 2**63 - 1) was 0 examples, range(2**24, 2**24 + 10) repeated some)
_FLOAT32_INTEGER = _within(-2**24, 2**24, "", "the examples are float32, exact for integers "
                           "up to 2**24", "the examples are float32, exact for integers "
                           "down to -2**24")


# -- strategy -----------------------------------------------------------------------------
_COMPUTE_DEVICES = ("Devices of the replicas, one replica each, in TF or torch spelling "
                    "(`CPU:0`, `/gpu:1`, `cuda:0`). Logical CPUs `CPU:0`, `CPU:1`, ... are "
                    "distinct replicas sharing the host CPU.")
_EXECUTION = ("How replicas run: `ordered` one after another in replica order, `concurrent` "
              "in threads, `auto` concurrent only across physical devices.")
_COPY = ("Give every replica its own parameter copy even on the parameter device (the path "
         "GPU replicas take; lets CPU-only CI exercise it).")
_BYTES_PER_PACK = (
    "The most bytes a replica computing on a copy of the parameters (a GPU, or "
    "`copy_parameters`) moves in one copy: parameters and gradients cross in buckets of "
    "this size, the gradients while the backward still runs, the parameters ahead of the "
    "forward's first read of them (TF's `bytes_per_pack`, DDP's `bucket_cap_mb`). 0: one "
    "copy per dtype each way. Default 25 MiB; see docs/performance.md.")


class CentralStorageConfig(_Section):
    """One machine: replicas on its devices, parameters kept once on one device (a
    ``CentralStorageStrategy``)."""

    kind: Literal["central_storage"] = Field(
        "central_storage", description="`central_storage` (the default): one machine.")
    compute_devices: list[str] | None = Field(
        None, description=_COMPUTE_DEVICES + " Default (TF's): every local GPU, else "
        "`CPU:0`.")
    parameter_device: str | None = Field(
        None, description="The one device holding parameters and optimizer state. Default "
        "(TF's): the only compute device if there is one, else `CPU:0`.")
    execution: Literal["auto", "ordered", "concurrent"] = Field(
        "auto", description=_EXECUTION)
    copy_parameters: bool = Field(False, description=_COPY)
    batch_split: Literal["auto", "even", "balanced"] = Field(
        "auto", description="How each global batch is split over the replicas: `even` "
        "(TF's equal shares), `balanced` (in proportion to each replica's measured speed, "
        "re-measured as the run goes, so a GPU is not kept waiting by a CPU replica; the "
        "loss stays the global-batch mean and BatchNorm global), or `auto`: balanced for "
        "replicas on different kinds of device (GPU and CPU), else even. Balanced shares "
        "follow timing, so results may differ in the last bits from run to run: use "
        "`even` where a run must repeat bit for bit. It splits global batches "
        "(`dataset.distribute: global`); see docs/performance.md.")
    bytes_per_pack: Int64 = Field(25 * 2**20, ge=0, description=_BYTES_PER_PACK)


def _address(value: str) -> str:
    if not is_address(value):
        raise ValueError(f"{value!r} is not 'host:port' with a port in 1..65535")
    return value


Address = Annotated[str, AfterValidator(_address)]


class ClusterConfig(_Section):
    """The tasks of a parameter-server cluster, as `host:port` addresses per job (TF's
    cluster spec, TF_CONFIG's `cluster`). `ps:0`'s address hosts the job's rendezvous
    store; the other addresses name the tasks."""

    chief: list[Address] = Field(
        default_factory=list, description="At most one chief: it trains, writes the "
        "checkpoints and the result, and ends the job. Without one, `worker:0` does.")
    worker: list[Address] = Field(default_factory=list, description="The workers: each "
                                  "trains on its share of every global batch.")
    ps: list[Address] = Field(default_factory=list, description="The parameter servers "
                              "(at least one): they hold the variables and apply updates.")


class TaskConfig(_Section):
    """Which task of the cluster this process is (TF_CONFIG's `task`)."""

    type: Literal["chief", "worker", "ps"] = Field(description="The job of this task.")
    index: Int64 = Field(0, ge=0, description="Its index in that job's address list.")


class FixedShardsConfig(_Section):
    """TF's `FixedShardsPartitioner`: every variable in `num_shards` shards."""

    kind: Literal["fixed"] = Field(description="`fixed`: a fixed number of shards.")
    num_shards: Int64 = Field(
        ge=1, le=65536, description="Shards per variable along dim 0 (a variable with "
        "fewer rows gets one per row; scalars stay whole). Shards are placed over the ps "
        "tasks as variables are (`variable_placement`).")


class MinSizeConfig(_Section):
    """TF's `MinSizePartitioner`: one shard per `min_shard_bytes`, rounded up."""

    kind: Literal["min_size"] = Field(description="`min_size`: shards of a minimum size.")
    min_shard_bytes: Int64 = Field(
        256 << 10, ge=1, description="Bytes per shard: a variable gets one shard per "
        "`min_shard_bytes`, rounded up (TF's rule and default, 256 KiB), so a smaller one "
        "stays whole.")
    max_shards: Int64 = Field(
        1, ge=1, le=65536, description="At most this many shards per variable (TF's "
        "default, 1, splits nothing: set it).")


class MaxSizeConfig(_Section):
    """TF's `MaxSizePartitioner`: as few shards as keep each within `max_shard_bytes`."""

    kind: Literal["max_size"] = Field(description="`max_size`: shards of a maximum size.")
    max_shard_bytes: Int64 = Field(
        ge=1, description="Bytes a shard may hold at most: a variable gets as few shards "
        "as keep each within it (whole rows, at least one row a shard; TF's rule).")
    max_shards: Int64 | None = Field(
        None, ge=1, le=65536, description="At most this many shards per variable, "
        "whatever their size; null: no limit (TF's default).")


PartitionerConfig = Annotated[Union[FixedShardsConfig, MinSizeConfig, MaxSizeConfig],
                              Field(discriminator="kind")]


class ParameterServerConfig(_Section):
    """A cluster of processes: workers train, ps tasks hold the variables (a
    ``ParameterServerStrategy``). Workers are synchronous across their local replicas and
    asynchronous to each other. Start every task with `csrun train` and its own
    `TF_CONFIG`, or all of them on one machine with `csrun launch`."""

    kind: Literal["parameter_server"] = Field(description="`parameter_server`.")
    cluster: ClusterConfig | None = Field(
        None, description="The cluster; null: the `cluster` of the `TF_CONFIG` environment "
        "variable, else torchrun's or Slurm's variables (with `num_ps`). When both this "
        "and `TF_CONFIG` give one they must agree.")
    task: TaskConfig | None = Field(
        None, description="This process's task; null: the `task` of `TF_CONFIG` (or the "
        "launcher's rank). Usually "
        "set per process by `TF_CONFIG` (or an override), not in a shared file.")
    num_ps: Int64 | None = Field(
        None, ge=1, description="How many ps tasks a job started by `torchrun` (or "
        "Slurm's `srun`) has: ranks `0..num_ps-1` serve the variables, the rest are "
        "workers (the first the chief); the cluster then comes from the launcher's "
        "variables, without `TF_CONFIG`. With a cluster from `strategy.cluster` or "
        "`TF_CONFIG`, it must match its ps count. See docs/parameter-server.md.")
    num_gpus_per_worker: Annotated[Int64, _within(
        None, MAX_GPUS, "", "torch numbers a machine's GPUs in 8 bits")] = Field(
        0, ge=0, description="Local GPUs each worker replicates over (`GPU:0` ... ); 0: "
        "one replica on `CPU:0`. Leave it 0 when `compute_devices` names the replicas.")
    compute_devices: list[str] | None = Field(
        None, description=_COMPUTE_DEVICES + " Each worker's local replicas, on its own "
        "machine. Default: `num_gpus_per_worker` GPUs, else `CPU:0`.")
    variable_placement: Literal["round_robin", "balanced"] = Field(
        "round_robin", description="How variables go to ps tasks: `round_robin` in "
        "creation order (TF's rule), or `balanced` by size (each to the ps holding the "
        "fewest bytes so far).")
    variable_partitioner: PartitionerConfig | None = Field(
        None, description="Split variables along dim 0 over the ps tasks (TF's "
        "partitioners): `{kind: fixed, num_shards: N}`, `{kind: min_size, "
        "min_shard_bytes: B, max_shards: N}` or `{kind: max_size, max_shard_bytes: B}`; null: each variable whole on one ps. "
        "Checkpoints, exports and `params_sha256` see whole variables, whatever the "
        "sharding. See docs/parameter-server.md.")
    serve_embedding_rows: bool = Field(
        True, description="Embedding tables (`nn.Embedding`, `nn.EmbeddingBag`) are read "
        "by rows: a worker fetches only the rows its batch looks up and pushes only those "
        "rows' gradients. false: every table is served whole (pushed and pulled in full "
        "each step), for a model that reads a table's weight other than by lookups.")
    timeout_s: Annotated[float, _within(
        *TIMEOUT_S, " s", "torch's store and gloo count waits in milliseconds, in C ints",
        "torch's store counts whole milliseconds: less than 1 ms is 0 ms, which times "
        "out at once")] = Field(
        120.0, gt=0, description="Seconds a task waits for the parameter servers to come "
        "up, and for any answer of the job's store; how long the chief's heartbeat may "
        "stand still before the ps tasks and workers end the job; how long the chief, done, "
        "waits for the other workers while none pushes an update (then they count as "
        "lost); after a first Ctrl-C or "
        "SIGTERM, how long a ps keeps serving so that the chief can write its last "
        "checkpoint. From 0.001 (1 ms) to 1,000,000 (11.6 days): torch's store counts "
        "milliseconds in C ints.")
    execution: Literal["auto", "ordered", "concurrent"] = Field(
        "auto", description=_EXECUTION + " (Within one worker.)")
    copy_parameters: bool = Field(False, description=_COPY)
    bytes_per_pack: Int64 = Field(25 * 2**20, ge=0, description=_BYTES_PER_PACK)

    @property
    def parameter_device(self) -> None:
        """Variables live on the ps tasks: there is no local parameter device to name."""
        return None


StrategyConfig = Annotated[Union[CentralStorageConfig, ParameterServerConfig],
                           Field(discriminator="kind")]


# -- dataset: sources ----------------------------------------------------------------------
class RangeSource(_Section):
    """Integers `start, start+step, ... < stop`: each example is `x = [i]`, target `[i]`."""

    kind: Literal["range"] = Field(description="`range`: integers, for checking pipelines.")
    start: Annotated[Int64, _FLOAT32_INTEGER] = Field(0, description="First integer "
                                                      "(within +-2**24).")
    stop: Annotated[Int64, _FLOAT32_INTEGER] = Field(description="End (exclusive; within "
                                                     "+-2**24).")
    step: Int64 = Field(1, description="Stride between integers (not 0).")


class SyntheticSource(_Section):
    """Seeded synthetic data: Gaussian class blobs or a noisy linear map."""

    kind: Literal["synthetic"] = Field(description="`synthetic`: generated from `seed`.")
    task: Literal["classification", "regression"] = Field(
        "classification", description="Class labels (blobs) or real targets (linear map).")
    examples: Int64 = Field(1024, gt=0, description="Number of examples.")
    features: Int64 = Field(16, gt=0, description="Features per example.")
    classes: Int64 = Field(4, ge=2, description="Number of classes (classification).")
    targets: Int64 = Field(1, gt=0, description="Target values per example (regression).")
    noise: float = Field(0.5, ge=0, description="Standard deviation of the added noise.")
    seed: Int64 = Field(0, ge=0, description="Seed of the generator (independent of "
                        "`train.seed`).")


class FileSource(_Section):
    """Tensors from a `.npz`, `.npy` or `.csv` file (read once, at start)."""

    kind: Literal["file"] = Field(description="`file`: arrays from `path`.")
    path: str = Field(description="`.npz`, `.npy` or `.csv` file. A relative path written in "
                      "the config file starts at the file's folder; one given as a "
                      "command-line override, at the current folder.")
    features_key: str = Field("x", description="(`.npz`) the array of features.")
    target_key: str = Field("y", description="(`.npz`) the array of targets.")
    target_column: Int64 | str = Field(
        -1, description="(`.npy`, `.csv`) the column holding the target: an index "
        "(negative counts from the end) or, for a `.csv` with a header, a name. The other "
        "columns are the features.")
    task: Literal["auto", "classification", "regression"] = Field(
        "auto", description="`auto`: classification when every target is a whole number.")


class DigitsSource(_Section):
    """UCI optical digits (1797 8x8 images, 10 classes), shipped with csrun (CC BY 4.0)."""

    kind: Literal["digits"] = Field(description="`digits`: the bundled real dataset.")
    layout: Literal["flat", "image"] = Field(
        "flat", description="`flat`: 64 features; `image`: 1x8x8 (for `model.kind: cnn`).")
    scale: bool = Field(True, description="Divide pixel values (0..16) by 16.")


_TARGET_PATH = ("Imported from the current folder first (as with `python -m`), then "
                "the config file's folder, `PYTHONPATH` and installed packages.")


class ImportSource(_Section):
    """Your own `torch.utils.data.Dataset` (map-style) or `IterableDataset`, from a
    factory. Its examples are any nest (tuples, lists, dicts) of tensors and numbers, kept
    in the dtypes it gives (token ids stay int64); the batches are that nest, collated by
    `dataset.collate`. Map-style datasets take every step, with the exact, resumable
    index plan. Iterable ones have no length: they take `shuffle` (buffered), `batch`,
    `repeat`, `take`, `skip` and `shard` on the stream, need `train.steps`, `holdout: 0`
    and `workers: 0`, and a resumed run replays the stream, skipping the batches already
    consumed (exact when the dataset yields the same stream each pass). `map` and
    `normalize` are not available: transform in the dataset or the collate function."""

    kind: Literal["import"] = Field(description="`import`: your own dataset.")
    target: str = Field(description="`package.module:factory`: a Dataset class or a "
                        "function returning a Dataset or IterableDataset. " + _TARGET_PATH)
    kwargs: dict[str, JsonValue] = Field(default_factory=dict, description="Keyword "
                                         "arguments of the factory.")


SourceConfig = Annotated[Union[RangeSource, SyntheticSource, FileSource, DigitsSource,
                               ImportSource],
                         Field(discriminator="kind")]


# -- dataset: steps ------------------------------------------------------------------------
class ShuffleStep(_Section):
    """Shuffle with a buffer, as `tf.data.Dataset.shuffle` does."""

    op: Literal["shuffle"] = Field(description="`shuffle`.")
    buffer: Int64 = Field(gt=0, description="Buffer size; at least the dataset size for a "
                        "uniform shuffle.")
    seed: Int64 | None = Field(None, description="Seed; default: `train.seed`.")
    reshuffle_each_iteration: bool = Field(True, description="A new order every epoch.")


class BatchStep(_Section):
    """Group consecutive elements into batches."""

    op: Literal["batch"] = Field(description="`batch`.")
    size: Int64 = Field(gt=0, description="The *global* batch size (all replicas together). "
                      "With `dataset.distribute: per_replica` each pipeline batches "
                      "`size / replicas` (it must divide).")
    drop_remainder: bool = Field(False, description="Drop a last, smaller batch.")


class RepeatStep(_Section):
    """Repeat what comes before (reshuffled each time)."""

    op: Literal["repeat"] = Field(description="`repeat`.")
    count: Int64 | None = Field(None, gt=0, description="Times to repeat; null: forever "
                              "(then use `train.steps`).")


class TakeStep(_Section):
    """Keep only the first `count` elements (batches, after `batch`)."""

    op: Literal["take"] = Field(description="`take`.")
    count: Int64 = Field(ge=0, description="Elements to keep.")


class SkipStep(_Section):
    """Drop the first `count` elements (batches, after `batch`)."""

    op: Literal["skip"] = Field(description="`skip`.")
    count: Int64 = Field(ge=0, description="Elements to drop.")


class ShardStep(_Section):
    """Keep every `num_shards`-th element, starting at `index`."""

    op: Literal["shard"] = Field(description="`shard`.")
    num_shards: Int64 | None = Field(None, gt=0, description="Shards; null: one per input "
                                   "pipeline (`InputContext.num_input_pipelines`).")
    index: Int64 | None = Field(None, ge=0, description="This shard; null: the input "
                              "pipeline id (`InputContext.input_pipeline_id`).")


class MapStep(_Section):
    """Apply an importable function to each element (each batch, after `batch`)."""

    op: Literal["map"] = Field(description="`map`.")
    fn: str = Field(description="`package.module:function` taking and returning `(x, y)`.")
    kwargs: dict[str, JsonValue] = Field(default_factory=dict, description="Extra keyword "
                                   "arguments of `fn`.")


class NormalizeStep(_Section):
    """Features become `(x - mean) / std`."""

    op: Literal["normalize"] = Field(description="`normalize`.")
    mean: float | list[float] = Field(0.0, description="A number, or one per feature.")
    std: float | list[float] = Field(1.0, description="A positive number, or one per "
                                     "feature.")


class PrefetchStep(_Section):
    """Read ahead while the replicas compute."""

    op: Literal["prefetch"] = Field(description="`prefetch`.")
    buffer: Annotated[Int64, _within(None, MAX_PREFETCH, "", "each batch read ahead is held "
                                     "in memory")] = Field(
        2, gt=0, description="Steps read ahead (the distributed iterator's buffer, and the "
        f"DataLoader's `prefetch_factor` with workers), at most {MAX_PREFETCH}.")


StepConfig = Annotated[Union[ShuffleStep, BatchStep, RepeatStep, TakeStep, SkipStep,
                             ShardStep, MapStep, NormalizeStep, PrefetchStep],
                       Field(discriminator="op")]


class DatasetConfig(_Section):
    """The input pipeline: a source, then ordered steps (`tf.data` style), read by a
    `torch.utils.data.DataLoader`."""

    source: SourceConfig = Field(description="Where examples come from (`kind` picks).")
    steps: list[StepConfig] = Field(description="Ordered pipeline steps (`op` picks); one "
                                    "must be `batch`.")
    holdout: float = Field(0.0, ge=0, lt=1, description="Fraction of the source held out "
                           "for evaluation at the end (a seeded permutation, `train.seed`), "
                           "taken before the steps.")
    distribute: Literal["global", "per_replica"] = Field(
        "global", description="`global`: global batches split across replicas "
        "(`experimental_distribute_dataset`); `per_replica`: per-replica batches from "
        "`distribute_datasets_from_function`.")
    replication: Literal["per_worker", "per_replica"] = Field(
        "per_worker", description="(`distribute: per_replica`) one pipeline dealing batches "
        "to the replicas in turn, or one pipeline per replica (`InputReplicationMode`).")
    collate: str | None = Field(
        None, description="(`source.kind: import`) `package.module:function` making a batch "
        "of a list of examples; default `torch.utils.data.default_collate` (stacks tensors "
        "and numbers, keeps tuples and dicts). " + _TARGET_PATH)
    workers: Int64 = Field(0, ge=0, description="DataLoader worker processes (0: load in the "
                         "main process, fastest for small in-memory data).")
    pin_memory: bool | Literal["auto"] = Field(
        "auto", description="Pin host batches for fast GPU copies; `auto`: when a compute "
        "device is a GPU.")


# -- model --------------------------------------------------------------------------------
LOSS_NAMES = ("auto", "cross_entropy", "mse", "l1", "smooth_l1")


def _loss_name(value: str) -> str:
    if value in LOSS_NAMES or ":" in value:
        return value
    from .problems import did_you_mean
    hint = did_you_mean(value, LOSS_NAMES)
    raise ValueError(f"{value!r} is neither a loss ({', '.join(LOSS_NAMES)}) nor "
                     f"'package.module:function'" + (f"; {hint}" if hint else ""))


LossName = Annotated[str, AfterValidator(_loss_name)]
_LOSS_DESCRIPTION = ("Loss function: `cross_entropy`, `mse`, `l1`, `smooth_l1` on `(x, y)` "
                     "batches, `auto` (`cross_entropy` for classification, `mse` for "
                     "regression), or your own `package.module:function`, called as "
                     "`fn(model, batch)` and returning per-example losses of shape `[B]` "
                     "(or `(losses, {name: per-example metric [B]})`; a metric named "
                     "`accuracy` feeds the accuracy columns). It must not average: the "
                     "runner sums and divides by the global batch, so any replica count "
                     "takes the same steps. It may get an empty slice (B = 0) when a short "
                     "last batch is split over more replicas than it has examples.")


class LinearModel(_Section):
    """One linear layer (logistic or linear regression)."""

    kind: Literal["linear"] = Field(description="`linear`.")
    bias: bool = Field(True, description="Learn a bias.")
    loss: LossName = Field("auto", description=_LOSS_DESCRIPTION)


class MLPModel(_Section):
    """A multi-layer perceptron over the flattened features."""

    kind: Literal["mlp"] = Field(description="`mlp`.")
    hidden: list[Annotated[Int64, Field(gt=0)]] = Field(
        default_factory=lambda: [64], description="Width of each hidden layer.")
    activation: Literal["relu", "gelu", "tanh", "sigmoid"] = Field(
        "relu", description="Activation after each hidden layer.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout after each hidden layer.")
    loss: LossName = Field("auto", description=_LOSS_DESCRIPTION)


class CNNModel(_Section):
    """A small convolutional network for `C x H x W` (or `H x W`) images."""

    kind: Literal["cnn"] = Field(description="`cnn`.")
    channels: list[Annotated[Int64, Field(gt=0)]] = Field(
        default_factory=lambda: [16, 32], description="Output channels of each "
        "convolution; each is followed by ReLU and, while the image is at least 2x2, a 2x2 "
        "max-pool.")
    kernel_size: Int64 = Field(3, gt=0, description="Convolution kernel size (padding keeps "
                             "the size).")
    hidden: Int64 = Field(64, gt=0, description="Width of the dense layer before the output.")
    batch_norm: bool = Field(False, description="BatchNorm after each convolution "
                             "(synchronized across replicas by the strategy).")
    loss: LossName = Field("auto", description=_LOSS_DESCRIPTION)


class ImportedModel(_Section):
    """Any importable `torch.nn.Module` class, built in `strategy.scope()`. With a loss
    function it may take any batch structure; with a named loss it gets `x` of `(x, y)`.
    Preflight checks it on the meta device, or (for a forward that needs real values)
    on CPU with one real batch of 2 examples, and says so."""

    kind: Literal["import"] = Field(description="`import`.")
    target: str = Field(description="`package.module:Class` (or a function returning a "
                        "module). " + _TARGET_PATH)
    kwargs: dict[str, JsonValue] = Field(default_factory=dict, description="Constructor "
                                         "keyword arguments.")
    loss: LossName = Field("auto", description=_LOSS_DESCRIPTION)


ModelConfig = Annotated[Union[LinearModel, MLPModel, CNNModel, ImportedModel],
                        Field(discriminator="kind")]


# -- optimizer, train, checkpoint ---------------------------------------------------------
def _regex(value: str) -> str:
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"{value!r} is not a regular expression: {exc}") from None
    return value


def _target(value: str) -> str:
    module, sep, name = value.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"{value!r} is not 'package.module:Class'")
    return value


class ScheduleConfig(_Section):
    """A learning-rate schedule: any `torch.optim.lr_scheduler` class."""

    name: str = Field(description="Class in `torch.optim.lr_scheduler` (`StepLR`, "
                      "`CosineAnnealingLR`, `OneCycleLR`, ...). `ReduceLROnPlateau` steps on "
                      "`eval_loss` after each evaluation with `train.eval_every`, else on "
                      "the mean training loss of each `interval`; it cannot be chained.")
    kwargs: dict[str, JsonValue] = Field(default_factory=dict, description="Its keyword "
                                   "arguments (not `optimizer`).")
    interval: Literal["step", "epoch"] = Field("step", description="Call `scheduler.step()` "
                                               "after every step or every epoch (in a "
                                               "chain: the first schedule's).")
    steps: Int64 | None = Field(None, gt=0, description="(In a chain) how many intervals "
                                "this schedule lasts before the next takes over; every "
                                "schedule of a chain but the last needs it.")


class ParamGroupConfig(BaseModel):
    """A parameter group: the parameters whose names (`model.named_parameters()`) match
    `match`, with their own optimizer options. Groups are tried in order, the first match
    wins; unmatched parameters form a default group with the optimizer's own options."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)
    # the options are plain data, numbers finite, as every kwargs (`lr: .nan` passed)
    __pydantic_extra__: dict[str, JsonValue] = Field(init=False)  # type: ignore[assignment]

    match: Annotated[str, AfterValidator(_regex)] = Field(
        description="A regular expression searched in each parameter name "
        "(`re.search`), e.g. `bias|norm`. Any other key of the group is an optimizer "
        "option for it (`weight_decay: 0.0`, `lr: 0.001`).")

    def options(self) -> dict:
        """The group's optimizer options (every key but `match`)."""
        return dict(self.model_extra or {})


class TableOptimizerConfig(_Section):
    """The embedding tables' own optimizer (per-table optimizers, as TensorFlow and
    TorchRec allow): it trains the weights of every `nn.Embedding` and `nn.EmbeddingBag`
    (`EmbeddingBagCollection`'s tables too), `optimizer` trains the rest. In a
    parameter-server job each is built on the ps tasks over its own variables."""

    name: str = Field("SparseAdam", description="Class in `torch.optim` (`SparseAdam`, "
                      "`Adagrad`, `SGD`, ...); `SparseAdam` needs the tables built with "
                      "`sparse=True`.")
    target: Annotated[str, AfterValidator(_target)] | None = Field(
        None, description="Instead of `name`: an optimizer class outside `torch.optim`, "
        "`package.module:Class`, called as `Class(params, lr=lr, **kwargs)`. " + _TARGET_PATH)
    lr: float = Field(0.01, gt=0, description="The tables' learning rate (a schedule "
                      "scales it as it scales `optimizer.lr`).")
    kwargs: dict[str, JsonValue] = Field(default_factory=dict, description="Other keyword "
                                   "arguments (`betas`, `eps`, ...).")


class OptimizerConfig(_Section):
    """The optimizer: any `torch.optim` class (or your own), created in
    `strategy.scope()`."""

    name: str = Field("SGD", description="Class in `torch.optim` (`SGD`, `Adam`, `AdamW`, "
                      "...).")
    target: Annotated[str, AfterValidator(_target)] | None = Field(
        None, description="Instead of `name`: an optimizer class outside `torch.optim`, "
        "`package.module:Class`, called as `Class(params, lr=lr, **kwargs)`. " + _TARGET_PATH)
    lr: float = Field(0.01, gt=0, description="Learning rate.")
    kwargs: dict[str, JsonValue] = Field(default_factory=dict, description="Other keyword "
                                   "arguments (`momentum`, `weight_decay`, ...).")
    param_groups: list[ParamGroupConfig] = Field(
        default_factory=list, description="Parameter groups with their own options, e.g. "
        "`[{match: \"bias|norm\", weight_decay: 0.0}]`: first match wins, the rest in a "
        "default group.")
    schedule: ScheduleConfig | list[ScheduleConfig] | None = Field(
        None, description="Optional learning-rate schedule, or a chain of them run one "
        "after another (`torch.optim.lr_scheduler.SequentialLR`), e.g. `[{name: LinearLR, "
        "kwargs: {start_factor: 0.1}, steps: 100}, {name: CosineAnnealingLR, kwargs: "
        "{T_max: 900}}]`: linear warmup, then cosine.")
    tables: TableOptimizerConfig | None = Field(
        None, description="A separate optimizer for the embedding tables, e.g. `{name: "
        "SparseAdam, lr: 0.01}` beside `name: AdamW` for the dense part; null: this "
        "optimizer trains every parameter.")


class EarlyStoppingConfig(_Section):
    """Stop when an evaluated metric has not improved for `patience` evaluations
    (`train.eval_every`)."""

    metric: str = Field("eval_loss", description="An evaluated metric: `eval_loss`, "
                        "`eval_accuracy`, or `eval_<name>` of a loss function's metrics.")
    mode: Literal["min", "max"] = Field("min", description="`min`: lower is better; "
                                        "`max`: higher is better.")
    patience: Int64 = Field(3, gt=0, description="Evaluations without improvement before "
                            "stopping.")
    min_delta: float = Field(0.0, ge=0, description="The least change that counts as an "
                             "improvement.")


class TrainConfig(_Section):
    """How long to train, how each step is computed, and how reproducibly."""

    steps: Int64 | None = Field(None, gt=0, description="Optimizer steps to run (the "
                              "pipeline restarts, reshuffled, when it runs out). Give "
                              "`steps` or `epochs`. With `accumulate_steps: N` a step "
                              "takes N batches.")
    epochs: Int64 | None = Field(None, gt=0, description="Full passes over the pipeline. "
                               "Give `steps` or `epochs`.")
    seed: Int64 = Field(0, description="Seeds torch, numpy, Python's random, shuffles and "
                      "the holdout split: same seed and config, same `params_sha256`.")
    log_every: Annotated[Int64, _within(
        None, MAX_LOG_EVERY, "", "the last 3 windows' losses are kept (and checkpointed) "
        "to judge divergence")] = Field(
        50, gt=0, description="Steps between per-replica tables (a log window; at most "
        f"{MAX_LOG_EVERY:,}: the last 3 windows' losses judge divergence).")
    divergence: float | None = Field(
        1000.0, gt=1, description="Fail the run (exit 1) when the loss ran away without "
        "becoming NaN: the mean loss of a log window (`log_every` steps) exceeds this many "
        "times the first step's loss in 3 windows in a row, or in the run's last window. "
        "null: no check.")
    grad_clip_norm: float | None = Field(
        None, gt=0, description="Clip the global gradient norm to this value after the "
        "replicas' gradients are summed (and accumulated), before the optimizer step; the "
        "norm before clipping is reported as `grad_norm` in `--metrics` lines. null: no "
        "clipping.")
    accumulate_steps: Int64 = Field(
        1, gt=0, description="Batches (micro-steps) whose gradients are accumulated into "
        "one optimizer step: the loss is divided by the examples of all N, so N batches of "
        "B take the step one batch of N x B takes. `train.steps` counts optimizer steps; a "
        "pass's last step takes the batches left (fewer than N).")
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        "fp32", description="`bf16`: forward under `torch.autocast` with bfloat16 (CPU or "
        "GPU); `fp16`: float16 autocast with a gradient scaler, GPU replicas only. "
        "Parameters, gradients and optimizer state stay float32.")
    compile: bool = Field(False, description="Run the model through `torch.compile` (once; "
                          "every replica calls the compiled model).")
    eval_every: Int64 = Field(
        0, ge=0, description="Evaluate the holdout (`dataset.holdout`) every N steps during "
        "training: a `--metrics` line with an `eval` field, and an entry of `evaluations` "
        "in the `--json` result. 0: only at the end.")
    early_stopping: EarlyStoppingConfig | None = Field(
        None, description="Stop early when an evaluated metric stops improving (needs "
        "`eval_every`); null: never.")


class BestCheckpointConfig(_Section):
    """Keep the checkpoint of the best evaluation (`train.eval_every`) besides the newest
    `keep`."""

    metric: str = Field("eval_loss", description="An evaluated metric: `eval_loss`, "
                        "`eval_accuracy`, or `eval_<name>` of a loss function's metrics.")
    mode: Literal["min", "max"] = Field("min", description="`min`: lower is better; "
                                        "`max`: higher is better.")


class CheckpointConfig(_Section):
    """Atomic checkpoints for `--resume` and Ctrl-C."""

    dir: str | None = Field(None, description="Directory of checkpoints; null: no "
                            "checkpoints. A relative path written in the config file starts "
                            "at the file's folder; one given as a command-line override, at "
                            "the current folder.")
    every_steps: Int64 = Field(0, ge=0, description="Steps between checkpoints; 0: only at "
                             "the end and on Ctrl-C.")
    keep: Int64 = Field(3, gt=0, description="How many of the newest checkpoints to keep.")
    keep_best: BestCheckpointConfig | None = Field(
        None, description="Also keep the checkpoint of the best evaluation (saved when an "
        "evaluation improves on the best), whatever `keep` rotates out; the result's "
        "`checkpoint.best` names it.")
    export: Literal["safetensors"] | None = Field(
        None, description="At the end of a completed run, write the final weights to "
        "`<dir>/model.safetensors` (atomically): the model's own `state_dict` keys, "
        "loadable with `safetensors.torch.load_file` and no csrun.")


class RunConfig(_Section):
    """A whole run: the six sections of a csrun config file."""

    strategy: StrategyConfig = Field(
        default_factory=CentralStorageConfig, description="Where replicas compute and "
        "where parameters live; `kind` picks the strategy (default `central_storage`).")
    dataset: DatasetConfig = Field(description="The input pipeline.")
    model: ModelConfig = Field(description="The model (`kind` picks) and its loss.")
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig,
                                       description="The optimizer and LR schedule.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Length, seed, "
                               "logging.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig,
                                         description="Checkpoints.")


SECTIONS = tuple(RunConfig.model_fields)
