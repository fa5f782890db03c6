"""Checks of a typed config against this machine and its data, before anything runs.

Pydantic checks types and ranges; these check meaning: the devices exist, the data loads
and the pipeline yields batches, the model fits the data (built on the meta device), the
optimizer and schedule accept their arguments. Each check runs when the sections it needs
are valid, so one pass reports every problem.
"""

from __future__ import annotations

from typing import Any

from .datasets import Pipeline, SourceData, load_source, split_holdout
from .devices import DeviceError, default_compute_devices, resolve_device
from .models import check_model
from .optimizers import check_optimizer
from .problems import ConfigError, Problem

__all__ = ["preflight", "replica_count"]


def preflight(sections: dict[str, Any]) -> list[Problem]:
    """Every problem of the valid ``sections`` (name -> model) alone and together."""
    strategy, dataset, model = (sections.get(n) for n in ("strategy", "dataset", "model"))
    optimizer, train = sections.get("optimizer"), sections.get("train")
    problems: list[Problem] = []
    if strategy is not None:
        problems += check_devices(strategy)
    if optimizer is not None:
        problems += check_optimizer(optimizer)
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
        problems += check_model(model, data.feature_shape, data.outputs, data.task)
    if pipeline is not None and strategy is not None and not _has(problems, "strategy"):
        problems += _check_distribution(dataset, pipeline, replica_count(strategy), train)
    return problems


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


def _device(spec: str, field: str, problems: list[Problem]):
    try:
        return resolve_device(spec)
    except DeviceError as exc:
        message, _, hint = str(exc).partition("; available")
        problems.append(Problem(field, message, f"available{hint}" if hint else None))
        return None


def _check_data(dataset, seed: int) -> tuple[SourceData | None, Pipeline | None, list]:
    try:
        data = load_source(dataset.source)
    except ConfigError as exc:
        return None, None, exc.problems
    train_idx, held = split_holdout(len(data), dataset.holdout, seed)
    problems = []
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
    if pipeline.infinite:
        if train is not None and train.epochs is not None:
            return [Problem("train.epochs", "the pipeline repeats forever, so an epoch "
                            "never ends", "use train.steps, or give repeat a count")]
        return []
    steps = pipeline.steps_per_epoch(replicas)
    if steps == 0:
        return [Problem("dataset.steps", f"the pipeline yields no full step from "
                        f"{len(pipeline.indices)} training examples",
                        "lower the batch size, or drop drop_remainder/take/skip/shard")]
    return []

