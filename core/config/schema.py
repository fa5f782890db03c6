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

from typing import Annotated, Literal, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue

from ..cluster.resolvers import is_address

__all__ = [
    "RunConfig", "StrategyConfig", "CentralStorageConfig", "ParameterServerConfig",
    "ClusterConfig", "TaskConfig", "DatasetConfig", "TrainConfig", "CheckpointConfig",
    "OptimizerConfig", "ScheduleConfig", "ModelConfig", "SourceConfig", "StepConfig",
    "SECTIONS",
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


# -- strategy -----------------------------------------------------------------------------
_COMPUTE_DEVICES = ("Devices of the replicas, one replica each, in TF or torch spelling "
                    "(`CPU:0`, `/gpu:1`, `cuda:0`). Logical CPUs `CPU:0`, `CPU:1`, ... are "
                    "distinct replicas sharing the host CPU.")
_EXECUTION = ("How replicas run: `ordered` one after another in replica order, `concurrent` "
              "in threads, `auto` concurrent only across physical devices.")
_COPY = ("Give every replica its own parameter copy even on the parameter device (the path "
         "GPU replicas take; lets CPU-only CI exercise it).")


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
                                  "trains on its slice of every global batch.")
    ps: list[Address] = Field(default_factory=list, description="The parameter servers "
                              "(at least one): they hold the variables and apply updates.")


class TaskConfig(_Section):
    """Which task of the cluster this process is (TF_CONFIG's `task`)."""

    type: Literal["chief", "worker", "ps"] = Field(description="The job of this task.")
    index: Int64 = Field(0, ge=0, description="Its index in that job's address list.")


class ParameterServerConfig(_Section):
    """A cluster of processes: workers train, ps tasks hold the variables (a
    ``ParameterServerStrategy``). Workers are synchronous across their local replicas and
    asynchronous to each other. Start every task with `csrun train` and its own
    `TF_CONFIG`, or all of them on one machine with `csrun launch`."""

    kind: Literal["parameter_server"] = Field(description="`parameter_server`.")
    cluster: ClusterConfig | None = Field(
        None, description="The cluster; null: the `cluster` of the `TF_CONFIG` environment "
        "variable. When both are given they must agree.")
    task: TaskConfig | None = Field(
        None, description="This process's task; null: the `task` of `TF_CONFIG`. Usually "
        "set per process by `TF_CONFIG` (or an override), not in a shared file.")
    num_gpus_per_worker: Int64 = Field(
        0, ge=0, description="Local GPUs each worker replicates over (`GPU:0` ... ); 0: "
        "one replica on `CPU:0`. Leave it 0 when `compute_devices` names the replicas.")
    compute_devices: list[str] | None = Field(
        None, description=_COMPUTE_DEVICES + " Each worker's local replicas, on its own "
        "machine. Default: `num_gpus_per_worker` GPUs, else `CPU:0`.")
    variable_placement: Literal["round_robin", "balanced"] = Field(
        "round_robin", description="How variables go to ps tasks: `round_robin` in "
        "creation order (TF's rule), or `balanced` by size (each to the ps holding the "
        "fewest bytes so far).")
    timeout_s: float = Field(
        120.0, gt=0, description="Seconds a task waits for the parameter servers to come "
        "up, and for any answer of the job's store; how long the chief's heartbeat may "
        "stand still before the ps tasks and workers end the job; after a first Ctrl-C or "
        "SIGTERM, how long a ps keeps serving so that the chief can write its last "
        "checkpoint.")
    execution: Literal["auto", "ordered", "concurrent"] = Field(
        "auto", description=_EXECUTION + " (Within one worker.)")
    copy_parameters: bool = Field(False, description=_COPY)

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
    start: Int64 = Field(0, description="First integer.")
    stop: Int64 = Field(description="End (exclusive).")
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
    path: str = Field(description="`.npz`, `.npy` or `.csv` file, relative to the current "
                      "directory.")
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


SourceConfig = Annotated[Union[RangeSource, SyntheticSource, FileSource, DigitsSource],
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
    buffer: Int64 = Field(2, gt=0, description="Steps read ahead (the distributed iterator's "
                        "buffer, and the DataLoader's `prefetch_factor` with workers).")


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
    workers: Int64 = Field(0, ge=0, description="DataLoader worker processes (0: load in the "
                         "main process, fastest for small in-memory data).")
    pin_memory: bool | Literal["auto"] = Field(
        "auto", description="Pin host batches for fast GPU copies; `auto`: when a compute "
        "device is a GPU.")


# -- model --------------------------------------------------------------------------------
LossName = Literal["auto", "cross_entropy", "mse", "l1", "smooth_l1"]
_LOSS_DESCRIPTION = ("Loss function; `auto`: `cross_entropy` for classification, `mse` for "
                     "regression.")


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
    """Any importable `torch.nn.Module` class, built in `strategy.scope()`."""

    kind: Literal["import"] = Field(description="`import`.")
    target: str = Field(description="`package.module:Class`.")
    kwargs: dict[str, JsonValue] = Field(default_factory=dict, description="Constructor "
                                         "keyword arguments.")
    loss: LossName = Field("auto", description=_LOSS_DESCRIPTION)


ModelConfig = Annotated[Union[LinearModel, MLPModel, CNNModel, ImportedModel],
                        Field(discriminator="kind")]


# -- optimizer, train, checkpoint ---------------------------------------------------------
class ScheduleConfig(_Section):
    """A learning-rate schedule: any `torch.optim.lr_scheduler` class."""

    name: str = Field(description="Class in `torch.optim.lr_scheduler` (`StepLR`, "
                      "`CosineAnnealingLR`, `OneCycleLR`, ...).")
    kwargs: dict[str, JsonValue] = Field(default_factory=dict, description="Its keyword "
                                   "arguments (not `optimizer`).")
    interval: Literal["step", "epoch"] = Field("step", description="Call `scheduler.step()` "
                                               "after every step or every epoch.")


class OptimizerConfig(_Section):
    """The optimizer: any `torch.optim` class, created in `strategy.scope()`."""

    name: str = Field("SGD", description="Class in `torch.optim` (`SGD`, `Adam`, `AdamW`, "
                      "...).")
    lr: float = Field(0.01, gt=0, description="Learning rate.")
    kwargs: dict[str, JsonValue] = Field(default_factory=dict, description="Other keyword "
                                   "arguments (`momentum`, `weight_decay`, ...).")
    schedule: ScheduleConfig | None = Field(None, description="Optional learning-rate "
                                            "schedule.")


class TrainConfig(_Section):
    """How long to train, and how reproducibly."""

    steps: Int64 | None = Field(None, gt=0, description="Optimizer steps to run (the "
                              "pipeline restarts, reshuffled, when it runs out). Give "
                              "`steps` or `epochs`.")
    epochs: Int64 | None = Field(None, gt=0, description="Full passes over the pipeline. "
                               "Give `steps` or `epochs`.")
    seed: Int64 = Field(0, description="Seeds torch, numpy, Python's random, shuffles and "
                      "the holdout split: same seed and config, same `params_sha256`.")
    log_every: Int64 = Field(50, gt=0, description="Steps between per-replica tables.")


class CheckpointConfig(_Section):
    """Atomic checkpoints for `--resume` and Ctrl-C."""

    dir: str | None = Field(None, description="Directory of checkpoints (relative to the "
                            "current directory); null: no checkpoints.")
    every_steps: Int64 = Field(0, ge=0, description="Steps between checkpoints; 0: only at "
                             "the end and on Ctrl-C.")
    keep: Int64 = Field(3, gt=0, description="How many of the newest checkpoints to keep.")


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
