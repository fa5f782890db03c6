"""The run configuration: pydantic models, YAML loading with ``file:line`` errors, overrides.

A config is a YAML file with six sections (``strategy``, ``dataset``, ``model``,
``optimizer``, ``train``, ``checkpoint``), optionally changed by ``key=value`` overrides
(dotted paths, values parsed as YAML). Precedence: **override > file > default**.

Every field is documented with ``Field(description=...)``; ``docs/config.md`` is generated
from these models (:mod:`csrun.core.config.reference`). Unknown keys are rejected.

Example::

    config = load_config("configs/quickstart.yaml", ["train.epochs=2", "optimizer.lr=0.01"])
"""

from __future__ import annotations

import pathlib
from typing import Annotated, Any, Literal, Mapping, Sequence, Union

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, JsonValue,
                      ValidationError)

from ..cluster.resolvers import is_address
from .problems import ConfigError, Problem
from .safe_yaml import MAX_BYTES, YamlDocument, load_yaml

__all__ = [
    "RunConfig", "StrategyConfig", "CentralStorageConfig", "ParameterServerConfig",
    "ClusterConfig", "TaskConfig", "DatasetConfig", "TrainConfig", "CheckpointConfig",
    "OptimizerConfig", "ScheduleConfig", "ModelConfig", "SourceConfig", "StepConfig",
    "load_config", "load_config_text", "parse_override", "SECTIONS",
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
        "up; after a first Ctrl-C or SIGTERM, how long a ps keeps serving so that the chief "
        "can write its last checkpoint.")
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


# -- loading ------------------------------------------------------------------------------
def load_config(path: str | pathlib.Path, overrides: Sequence[str] = (), *,
                environ: Mapping[str, str] | None = None) -> RunConfig:
    """Read, override and validate a config file; check it against this machine.

    Args:
      path: the YAML file.
      overrides: ``key=value`` strings (dotted keys, YAML values); they win over the file.
      environ: where ``TF_CONFIG`` is read (``strategy.kind: parameter_server``);
        default ``os.environ``.

    Returns:
      The validated :class:`RunConfig`.

    Raises:
      ConfigError: every problem found, each with its dotted path, ``file:line`` and hint.
    """
    path = pathlib.Path(path)
    return load_config_text(_read_config(path), str(path), overrides, environ=environ)


def _read_config(path: pathlib.Path) -> str:
    """The text of a config file, or a ConfigError that says why there is none."""
    if path.is_dir():
        names = sorted(p.name for p in path.glob("*.y*ml"))
        raise ConfigError([Problem("", f"{str(path)!r} is a directory, not a config file",
                                   f"YAML files in it: {', '.join(names)}" if names else
                                   "give the path of a .yaml file")])
    try:
        with open(path, "rb") as f:
            # at most one byte past the limit: a device (/dev/zero) or a huge file costs
            # no more than a config would
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError([Problem("", f"config file {str(path)!r} not found",
                                   _sibling_hint(path))]) from None
    except OSError as exc:
        raise ConfigError([Problem("", f"cannot read config file {str(path)!r}: "
                                   f"{exc.strerror or exc}", "check its permissions")]) \
            from None
    if len(data) > MAX_BYTES:
        raise ConfigError([Problem("", f"the file is larger than {MAX_BYTES} bytes; a "
                                   "config is a few kilobytes", file=str(path))])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError([Problem("", f"the file is not UTF-8 text (byte 0x{data[exc.start]:02x}"
                                   f" at offset {exc.start})", "save it as UTF-8 YAML; is it "
                                   "a binary file?", str(path), line)]) from None


def load_config_text(text: str, file: str | None = None, overrides: Sequence[str] = (),
                     *, environ: Mapping[str, str] | None = None) -> RunConfig:
    """:func:`load_config` for YAML text (``file`` names it in messages)."""
    document = load_yaml(text, file)
    data = document.data if document.data is not None else {}
    if not isinstance(data, dict):
        raise ConfigError([Problem("", f"the config must be a mapping of sections "
                                   f"({', '.join(SECTIONS)}), got {type(data).__name__}",
                                   file=file, line=1)])
    origins: dict = {}
    problems = _apply_overrides(data, overrides, origins)
    sections, found = _validate(data)
    problems += found
    from .cluster import cluster_problems
    from ..runner.preflight import preflight  # it imports the data and model modules
    reported = {p.path for p in problems}
    problems += [p for p in preflight(sections) + cluster_problems(sections, environ)
                 if not _explained(p.path, reported)]
    if problems:
        raise ConfigError(_locate(p, document, origins) for p in problems)
    return RunConfig.model_construct(**sections)


def _explained(path: str, reported: set[str]) -> bool:
    """A preflight problem at ``path`` is noise when it or a key below it was reported
    (a partially valid section is checked without its bad keys)."""
    return any(r == path or r.startswith(path + ".") for r in reported if path)


def _sibling_hint(path: pathlib.Path) -> str | None:
    folder = path.parent if str(path.parent) else pathlib.Path(".")
    if not folder.is_dir():
        return None
    files = {p.stem: p.name for p in folder.glob("*.y*ml") if p.is_file()}
    names = sorted(files.values())
    from .problems import closest
    # compare the stems: a shared ".yaml" would make unrelated names look alike
    close = closest(path.stem, sorted(files))
    if close is not None:
        return f"did you mean {files[close]!r}?"
    listed = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    return f"YAML files in {str(folder)!r}: {listed}" if names else None


# -- overrides ----------------------------------------------------------------------------
def parse_override(text: str) -> tuple[tuple, Any]:
    """Split ``"a.b.0=value"`` into the key path ``("a", "b", 0)`` and the YAML value.

    Raises:
      ConfigError: no ``=``, an empty key part, or a value that is not valid YAML.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError([Problem("", f"override {text!r} is not key=value",
                                   "write e.g. train.steps=100 or "
                                   "strategy.compute_devices=[CPU:0,CPU:1]",
                                   origin=f"override {text!r}")])
    path = _key_path(key)
    try:
        value = load_yaml(raw, f"override {text!r}").data
    except ConfigError as exc:
        for problem in exc.problems:
            problem.path, problem.origin = key, f"override {text!r}"
        raise
    return path, value


def _key_path(dotted: str) -> tuple:
    """``"a.b.0"`` -> ``("a", "b", 0)``; only ASCII digits make an index (``"²"`` has
    ``isdigit()`` but is no number)."""
    return tuple(int(p) if p.isascii() and p.isdigit() else p for p in dotted.split("."))


def _apply_overrides(data: dict, overrides: Sequence[str], origins: dict) -> list[Problem]:
    """Set each override in ``data``; ``origins`` maps each set path to its text."""
    problems = []
    for text in overrides:
        try:
            path, value = parse_override(text)
            _set_path(data, path, value)
        except ConfigError as exc:
            for problem in exc.problems:
                problem.origin = problem.origin or f"override {text!r}"
            problems += exc.problems
            continue
        origins[path] = f"override {text!r}"
    return problems


def _set_path(data: dict, path: tuple, value: Any) -> None:
    node: Any = data
    for depth, part in enumerate(path):
        last = depth == len(path) - 1
        where = ".".join(str(p) for p in path[:depth]) or "the config"
        if isinstance(node, list) and not isinstance(part, int):
            raise _override_error(path, f"{where} is a list; {part!r} is not an index",
                                  f"address its items by number, 0..{len(node)} "
                                  f"({len(node)} appends)")
        if isinstance(node, list):
            if part > len(node):
                raise _override_error(path, f"{where} has {len(node)} items; index {part} "
                                      "is past the end", f"use 0..{len(node)} ({len(node)} "
                                      "appends)")
            if part == len(node):
                node.append({} if not last else None)
        elif isinstance(node, dict):
            if not last and not isinstance(node.get(part), (dict, list)):
                node[part] = {}
        else:
            raise _override_error(path, f"{where} is a value ({node!r:.40}), not a section "
                                  "or list", None)
        if last:
            node[part] = value
        else:
            node = node[part]


def _override_error(path: tuple, message: str, hint: str | None) -> ConfigError:
    key = ".".join(str(p) for p in path)
    return ConfigError([Problem(key, message, hint)])


# -- validation ---------------------------------------------------------------------------
_SECTION_TYPES = {"strategy": StrategyConfig, "dataset": DatasetConfig, "model": ModelConfig,
                  "optimizer": OptimizerConfig, "train": TrainConfig,
                  "checkpoint": CheckpointConfig}
_ADAPTERS: dict = {}


def _adapter(name: str):
    from pydantic import TypeAdapter
    if name not in _ADAPTERS:
        _ADAPTERS[name] = TypeAdapter(_SECTION_TYPES[name])
    return _ADAPTERS[name]


def _validate(data: dict) -> tuple[dict, list[Problem]]:
    """Validate each section on its own, so that the problems of all are reported.

    Returns the sections that are valid (name -> model) and the problems of the others.
    """
    from .problems import did_you_mean
    problems = [Problem(str(key), "unknown section", did_you_mean(key, SECTIONS) or
                        f"the sections are {', '.join(SECTIONS)}")
                for key in data if key not in SECTIONS]
    sections: dict = {}
    for name, field in RunConfig.model_fields.items():
        raw = data.get(name)
        if raw is None and field.is_required():
            problems.append(Problem(name, "missing section (required)", field.description))
            continue
        if raw is None:
            raw = data[name] = {}  # an empty section (all keys commented out): defaults
        if name == "strategy" and isinstance(raw, dict):
            raw.setdefault("kind", "central_storage")  # the default strategy's tag
        try:
            sections[name] = _adapter(name).validate_python(raw)
        except ValidationError as exc:
            found = _pydantic_problems(exc, name, data)
            problems += found
            partial = _partial_section(name, raw, found)
            if partial is not None:
                sections[name] = partial
    return sections, problems


def _partial_section(name: str, raw: Any, problems: list[Problem]):
    """The section without its bad keys, if that validates (defaults fill in), so that
    preflight can still check the rest of it; None otherwise.

    A removed key was reported already; a preflight problem at the same path is dropped.
    """
    if not isinstance(raw, dict):
        return None
    bad = {p.path.split(".")[1] for p in problems if p.path.count(".") >= 1}
    if not bad or any(p.path == name for p in problems):
        return None
    try:
        return _adapter(name).validate_python({k: v for k, v in raw.items() if k not in bad})
    except ValidationError:
        return None


def _pydantic_problems(exc: ValidationError, section: str, data: dict) -> list[Problem]:
    by_path: dict[str, Problem] = {}
    for error in exc.errors(include_url=False):
        loc = (section,) + tuple(error["loc"])
        path = ".".join(str(p) for p in _raw_path(loc, data))
        message, hint = _describe(error, loc)
        if error["type"] == "union_tag_invalid":
            path += f".{str((error.get('ctx') or {}).get('discriminator', 'kind')).strip(chr(39))}"
        if path in by_path:  # a plain union: one error per member; say them together
            known = by_path[path]
            if message not in known.message:
                known.message += f"; or {message}"
            continue
        by_path[path] = Problem(path, message, hint)
    return list(by_path.values())


def _raw_path(loc: tuple, data: Any) -> tuple:
    """The part of pydantic's ``loc`` that names keys in the data (drops union tags)."""
    node, out = data, []
    for part in loc:
        if isinstance(node, dict):
            if part in node:
                out.append(part)
                node = node[part]
            elif part not in (node.get("kind"), node.get("op")):
                out.append(part)  # a missing key
                node = None
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            out.append(part)
            node = node[part]
    return tuple(out)


def _describe(error: dict, loc: tuple) -> tuple[str, str | None]:
    """A clear message and hint for one pydantic error."""
    from .problems import did_you_mean
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "missing":
        field = _field_at(loc)
        return "missing (required)", field.description if field else None
    if kind == "extra_forbidden":
        fields = _fields_at(loc[:-1])
        return "unknown key", _other_strategy(loc) or did_you_mean(loc[-1], fields) or (
            f"valid keys here: {', '.join(fields)}" if fields else None)
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tag = str(ctx.get("discriminator", "kind")).strip("'")
        expected = [t.strip().strip("'") for t in str(ctx.get("expected_tags", "")).split(",")]
        if kind == "union_tag_not_found":
            return f"needs `{tag}`", f"one of: {', '.join(expected)}"
        return (f"unknown {tag} {ctx.get('tag')!r}",
                did_you_mean(ctx.get("tag"), expected) or f"one of: {', '.join(expected)}")
    if kind == "literal_error":
        options = [o.strip().strip("'") for o in str(ctx.get("expected", "")).split(",")]
        options = [o for part in options for o in part.split(" or ")]
        return (f"{value!r} is not allowed; expected {ctx.get('expected')}",
                did_you_mean(value, [o.strip("'") for o in options]))
    shown = "" if isinstance(value, (dict, list)) else f" (got {value!r:.60})"
    if kind == "value_error":  # our own validators say what they got
        return error["msg"].removeprefix("Value error, "), None
    if kind == "string_type" and isinstance(value, bool):  # the "Norway problem"
        return f"{error['msg']}{shown}", ("YAML reads yes/no/on/off/true/false as "
                                          "booleans: quote the text, e.g. 'off'")
    if kind == "invalid-json-value":
        return f"{error['msg']}{shown}", ("kwargs hold plain YAML data: numbers, text, "
                                          "booleans, null, lists and mappings")
    return f"{error['msg']}{shown}", None


def _other_strategy(loc: tuple) -> str | None:
    """``strategy.cluster`` under central storage: say which kind has the key."""
    if loc[0] != "strategy" or len(loc) != 3:
        return None
    for model in (CentralStorageConfig, ParameterServerConfig):
        if loc[-1] in model.model_fields and _tag_of(model) != loc[1]:
            return f"`{loc[-1]}` is a setting of strategy kind: {_tag_of(model)}"
    return None


def _field_at(loc: tuple):
    model = _model_at(loc[:-1])
    return model.model_fields.get(loc[-1]) if model is not None else None


def _fields_at(loc: tuple) -> list[str]:
    model = _model_at(loc)
    return list(model.model_fields) if model is not None else []


def _model_at(loc: tuple):
    """The config model class that pydantic's ``loc`` points into, or None."""
    import typing
    current: Any = RunConfig
    for part in loc:
        while True:  # unwrap Annotated, Optional and unions down to what ``part`` indexes
            origin, args = typing.get_origin(current), typing.get_args(current)
            if origin is Annotated:
                current = args[0]
            elif origin is Union and sum(a is not type(None) for a in args) == 1:
                current = next(a for a in args if a is not type(None))
            else:
                break
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(part)
            current = field.annotation if field else None
        elif origin is list and isinstance(part, int):
            current = args[0]
        elif origin is dict:
            current = args[1]
        elif origin is Union:
            current = next((m for m in args if _tag_of(m) == part), None)
        else:
            current = None
        if current is None:
            return None
    while typing.get_origin(current) is Annotated:
        current = typing.get_args(current)[0]
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _tag_of(model: Any) -> str | None:
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    for name in ("kind", "op"):
        field = model.model_fields.get(name)
        if field is not None:
            import typing
            return typing.get_args(field.annotation)[0]
    return None


def _locate(problem: Problem, document: YamlDocument, origins: dict) -> Problem:
    """Fill in where the problem's value came from: an override that set it (or set a
    value inside it: ``model.hidden.0=...`` for a problem with ``model.hidden``), else
    ``file:line``."""
    if problem.origin or problem.line:
        return problem
    path = _key_path(problem.path) if problem.path else ()
    for set_path, origin in origins.items():
        if path[:len(set_path)] == set_path:
            problem.origin = origin
            return problem
    problem.file = document.file
    problem.line = document.line_of(path)
    inside = [origin for set_path, origin in origins.items()
              if path and set_path[:len(path)] == path]
    if inside:
        problem.origin = inside[-1]
    return problem
