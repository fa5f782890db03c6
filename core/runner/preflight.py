"""Checks of a typed config against this machine and its data, before anything runs.

Pydantic checks types and ranges; these check meaning: the devices exist, the data loads
and the pipeline yields batches, the model fits the data (built on the meta device), the
optimizer and schedule accept their arguments. Each check runs when the sections it needs
are valid, so one pass reports every problem.
"""

from __future__ import annotations

import os
import pathlib
import stat
from typing import Any, Mapping, Sequence

from ..data.imported import Collate, ImportedData, first_batch
from ..data.pipeline import Pipeline
from ..data.sources import SourceData, load_source, source_bytes, split_holdout
from ..distribute.device_lib import memory_bytes
from ..distribute.devices import (DeviceError, default_compute_devices, default_parameter_device,
                      resolve_device)
from .model_checks import check_fit
from .models import model_bytes
from .optimizers import check_optimizer
from .training_checks import check_training
from ..config.loading import read_config, read_config_text
from ..config.problems import ConfigError, Problem
from ..config.schema import RunConfig

__all__ = ["load_config", "load_config_text", "preflight", "check_outside", "replica_count", "check_devices",
           "check_checkpoint_dir", "check_writable", "check_outputs"]


def load_config(path: str | pathlib.Path, overrides: Sequence[str] = (), *,
                environ: Mapping[str, str] | None = None) -> RunConfig:
    """Read, override and validate a config file, and check it against this machine.

    :func:`csrun.core.config.loading.read_config` with the :func:`preflight` checks.

    Raises:
      ConfigError: every problem found, each with its dotted path, ``file:line`` and hint.
    """
    return read_config(path, overrides, environ=environ, checks=(preflight,))


def load_config_text(text: str, file: str | None = None, overrides: Sequence[str] = (), *,
                     environ: Mapping[str, str] | None = None) -> RunConfig:
    """:func:`load_config` for YAML text (``file`` names it in messages)."""
    return read_config_text(text, file, overrides, environ=environ, checks=(preflight,))


def preflight(sections: dict[str, Any]) -> list[Problem]:
    """Every problem of the valid ``sections`` (name -> model) alone and together."""
    strategy, dataset, model = (sections.get(n) for n in ("strategy", "dataset", "model"))
    optimizer, train = sections.get("optimizer"), sections.get("train")
    problems: list[Problem] = []
    if strategy is not None:
        problems += check_devices(strategy)
    if optimizer is not None:
        problems += check_optimizer(optimizer)
    if sections.get("checkpoint") is not None:
        problems += check_checkpoint_dir(sections["checkpoint"])
    problems += check_training(sections)
    if train is not None and (train.steps is None) == (train.epochs is None):
        problems.append(Problem("train", "give exactly one of steps and epochs" +
                                (" (both are set)" if train.steps else ""),
                                "e.g. train.epochs=10 or train.steps=500"))
    if dataset is None:
        return problems
    seed = train.seed if train is not None else 0
    data, pipeline, found = _check_data(dataset, seed)
    problems += found
    if data is not None and model is not None:
        found = _check_model(model, data, dataset)
        problems += found or _check_model_memory(model, data, strategy)
    if isinstance(data, ImportedData) and data.iterable and train is not None and train.epochs:
        problems.append(Problem("train.epochs", "an IterableDataset has no known length, "
                                "so an epoch's steps are unknown", "use train.steps"))
    if pipeline is not None and strategy is not None and not _has(problems, "strategy"):
        problems += _check_distribution(dataset, pipeline, replica_count(strategy), train)
    return problems


def _check_model(model, data: "SourceData | ImportedData", dataset) -> list[Problem]:
    """The model and its loss on a real batch of 2 examples (on the meta device first)."""
    if isinstance(data, ImportedData):
        try:
            sample = first_batch(data, Collate(dataset.collate), 2)
        except ConfigError as exc:
            return exc.problems
    else:
        sample = (data.features[:2], data.targets[:2])
    return check_fit(model, data, sample)


def _has(problems: list[Problem], section: str) -> bool:
    return any(p.path.split(".")[0] == section for p in problems)


def replica_count(strategy) -> int:
    """How many replicas the ``strategy`` section makes (TF's default when omitted)."""
    if strategy.compute_devices is None:
        return len(default_compute_devices())
    return len(strategy.compute_devices)


def check_devices(strategy) -> list[Problem]:
    """Each device parses, exists here, and no compute device repeats."""
    problems, seen = [], {}
    for i, spec in enumerate(strategy.compute_devices or []):
        field = f"strategy.compute_devices.{i}"
        device = _device(spec, field, problems)
        if device is not None and device in seen:
            problems.append(Problem(field, f"{spec!r} repeats compute device "
                                    f"{seen[device]!r}", "each replica needs its own "
                                    "device (logical CPUs CPU:0, CPU:1, ... are distinct)"))
        seen.setdefault(device, spec)
    if strategy.compute_devices == []:
        problems.append(Problem("strategy.compute_devices", "is empty",
                                "list at least one device, or remove the key for TF's "
                                "default"))
    if strategy.parameter_device is not None:
        _device(strategy.parameter_device, "strategy.parameter_device", problems)
    return problems


def check_checkpoint_dir(checkpoint) -> list[Problem]:
    """``checkpoint.dir`` is, or can become, a writable directory: found now, not when
    the first checkpoint of a long run fails to save."""
    return check_writable(checkpoint.dir, "checkpoint.dir", directory=True)


def check_writable(path: str | None, field: str, *, directory: bool = False) -> list[Problem]:
    """``path`` can be written as a file (or, with ``directory``, a folder): it is not the
    other kind, and the nearest folder that exists on its way can be written in. Nothing
    is created (``validate`` has no side effects); ``-`` (stdout) and None pass."""
    if not path or path == "-":
        return []
    target = pathlib.Path(path)
    if not directory and target.is_dir():
        return [Problem(field, f"{path!r} is a directory", "give a file name")]
    if not directory and _blocks(target):
        return [Problem(field, f"{path!r} is a named pipe or a socket; opening it waits "
                        "for a reader, maybe forever", "give a regular file (or - for "
                        "stdout)")]
    start = target if directory else target.parent
    existing = next(p for p in (start, *start.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        return [Problem(field, f"{str(existing)!r} is a file, not a directory",
                        "choose another path")]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [Problem(field, f"cannot write in {str(existing)!r} (permission denied)",
                        "choose a path you can write to")]
    return []


def _blocks(target: pathlib.Path) -> bool:
    """A FIFO or socket: ``open(path, "w")`` blocks until someone reads. Devices such
    as /dev/null are fine."""
    try:
        mode = target.stat().st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def check_outputs(config: str | None, outputs: Mapping[str, str | None]) -> list[Problem]:
    """No output (option -> path) is the config file or another output's file: writing
    it would destroy the config (``validate c.yaml --json c.yaml``) or tear both."""
    problems, taken = [], [("the config file", config)] if config else []
    for option, path in outputs.items():
        if not path or path == "-":
            continue
        clash = next((what for what, other in taken if _same_file(path, other)), None)
        if clash is not None:
            problems.append(Problem(option, f"{path!r} is {clash}; writing it would "
                                    "overwrite it", "give each output a file of its own"))
        taken.append((f"also the {option} file", path))
    return problems


def check_outside(directory: str | None, outputs: Mapping[str, str | None]) -> list[Problem]:
    """No output file (option -> path) lies in ``checkpoint.dir``: csrun owns and prunes
    the files there, and an output written onto one destroys a checkpoint."""
    if not directory:
        return []
    root = os.path.realpath(directory)
    return [Problem(option, f"{path!r} is inside checkpoint.dir ({directory!r}), whose "
                    "files csrun owns: writing it could destroy a checkpoint",
                    "write outputs outside checkpoint.dir")
            for option, path in outputs.items() if path and path != "-" and
            (os.path.realpath(path) + os.sep).startswith(root + os.sep)]


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)  # hard links and symlinks too
    except OSError:  # one does not exist yet: compare the resolved spellings
        return os.path.realpath(a) == os.path.realpath(b)


def _device(spec: str, field: str, problems: list[Problem]):
    try:
        return resolve_device(spec)
    except DeviceError as exc:
        problems.append(Problem(field, exc.message, exc.hint))
    except ValueError:  # the parser's int() of a digit that is not ASCII ('replica:²')
        problems.append(Problem(field, f"cannot parse device {spec!r}", "use forms like "
                                "'CPU:0', '/gpu:1', '/job:localhost/replica:0/task:0/"
                                "device:CPU:0', 'cuda:1'"))
    return None


def _gib(count: int) -> str:
    return f"{count / 2**30:,.1f} GiB"


def _check_model_memory(model, data: SourceData, strategy) -> list[Problem]:
    """The parameters and their gradients fit in the parameter device's memory: the
    least central storage needs (an optimizer keeps more)."""
    if strategy is None:
        return []
    try:
        device = resolve_device(strategy.parameter_device) if strategy.parameter_device \
            else default_parameter_device(default_compute_devices())[0]
    except ValueError:  # reported by check_devices
        return []
    needed, available = 2 * model_bytes(model, data.feature_shape, data.outputs), \
        memory_bytes(device)
    if available is None or needed <= available:
        return []
    # where the size comes from: the layer widths, the constructor's arguments, the data
    field = {"mlp": "model.hidden", "import": "model.kwargs"}.get(model.kind, "model")
    return [Problem(field, f"the model's parameters and gradients need {_gib(needed)}, "
                    f"more than the {_gib(available)} of the parameter device "
                    f"{device.short_name} (the data asks for {data.outputs} outputs)",
                    "make the model smaller (hidden, channels), or check the class "
                    "labels: the classes are the largest label + 1")]


def _check_source_memory(dataset) -> list[Problem]:
    """A generated source fits in the host's memory (checked before generating it)."""
    needed = source_bytes(dataset.source)
    available = memory_bytes(resolve_device("CPU:0"))
    if needed is None or available is None or needed <= available:
        return []
    source = dataset.source
    if source.kind == "synthetic":  # name the biggest size: the likely typo
        sizes = ("examples", "features", "classes" if source.task == "classification"
                 else "targets")
        field, hint = max(sizes, key=lambda name: getattr(source, name)), \
            "lower dataset.source.examples or features"
    else:
        field = "start" if abs(source.start) > abs(source.stop) else "stop"
        hint = "narrow dataset.source.start..stop, or raise step"
    return [Problem(f"dataset.source.{field}", f"the {source.kind} data would need about "
                    f"{_gib(needed)} of memory; this machine has {_gib(available)}", hint)]


def _check_workers(dataset) -> list[Problem]:
    # more loader processes than 4 per core never helps in-memory data, and a huge count
    # would fork that many processes
    limit = 4 * (os.cpu_count() or 1)
    if dataset.workers <= limit:
        return []
    return [Problem("dataset.workers", f"{dataset.workers} worker processes for "
                    f"{os.cpu_count()} CPU cores", f"use at most {limit}; 0 loads in the "
                    "main process, fastest for small in-memory data")]


def _check_data(dataset, seed: int) -> tuple[SourceData | None, Pipeline | None, list]:
    too_big = _check_source_memory(dataset)
    if too_big:
        return None, None, too_big
    try:
        data = load_source(dataset.source)
    except ConfigError as exc:
        return None, None, exc.problems
    train_idx, held = split_holdout(len(data), dataset.holdout, seed)
    problems = _check_workers(dataset)
    if dataset.holdout and (len(held) == 0 or len(train_idx) == 0):
        problems.append(Problem("dataset.holdout", f"holds out {len(held)} of {len(data)} "
                                f"examples, leaving {len(train_idx)} to train on",
                                "choose a fraction that leaves both sides non-empty"))
    try:
        pipeline = Pipeline(dataset, data, train_idx, seed)
    except ConfigError as exc:
        return data, None, problems + exc.problems
    return data, pipeline, problems


def _check_distribution(dataset, pipeline: Pipeline, replicas: int, train) -> list[Problem]:
    """The batch size fits the replicas, and the pipeline yields (and ends) as trained."""
    batch_index = next(i for i, s in enumerate(dataset.steps) if s.op == "batch")
    if dataset.distribute == "per_replica" and pipeline.batch_size % replicas:
        return [Problem(f"dataset.steps.{batch_index}.size", f"the global batch size "
                        f"{pipeline.batch_size} does not divide among {replicas} replicas "
                        "(distribute: per_replica)",
                        f"use a multiple of {replicas}, e.g. "
                        f"{pipeline.batch_size // replicas * replicas or replicas}")]
    if pipeline.infinite or pipeline.streamed:  # no length to check against
        if pipeline.infinite and train is not None and train.epochs is not None:
            return [Problem("train.epochs", "the pipeline repeats forever, so an epoch "
                            "never ends", "use train.steps, or give repeat a count")]
        return []
    steps = pipeline.steps_per_epoch(replicas)
    if steps == 0:
        return [Problem("dataset.steps", f"the pipeline yields no full step from "
                        f"{len(pipeline.indices)} training examples",
                        "lower the batch size, or drop drop_remainder/take/skip/shard")]
    examples = pipeline.examples_per_pass()
    if examples < pipeline.batch_size:  # every step would be smaller than it says
        return [Problem(f"dataset.steps.{batch_index}.size", f"the global batch size "
                        f"{pipeline.batch_size} is larger than the {examples} examples a "
                        f"pass yields: every step would train on {examples}",
                        f"use a batch size of at most {examples}, or repeat before batch")]
    return []

