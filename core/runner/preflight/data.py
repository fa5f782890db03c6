"""The ``dataset`` section on this machine: the source fits in memory and loads, the
holdout leaves both sides non-empty, the pipeline builds and yields (and ends) as the
run trains it, over the replicas it is split across."""

from __future__ import annotations

import os

from ...config.problems import ConfigError, Problem
from ...data.pipeline import Pipeline
from ...data.sources import SourceData, load_source, source_bytes, split_holdout
from ...distribute.device_lib import memory_bytes
from ...distribute.devices import resolve_device
from .devices import gib

__all__ = ["check_data", "check_distribution", "check_batch_split"]


def check_data(dataset, seed: int) -> tuple[SourceData | None, Pipeline | None, list]:
    """The data and its pipeline (None when they cannot be built), and every problem."""
    too_big = _check_source_memory(dataset)
    if too_big:
        return None, None, too_big
    try:
        data = load_source(dataset.source)
    except ConfigError as exc:
        return None, None, exc.problems
    train_idx, held = split_holdout(len(data), dataset.holdout, seed)
    problems = _check_workers(dataset)
    # an IterableDataset has no length: the pipeline says so (its "0 of 0" is no count)
    iterable = getattr(data, "iterable", False)
    if dataset.holdout and not iterable and (len(held) == 0 or len(train_idx) == 0):
        problems.append(Problem("dataset.holdout", f"holds out {len(held)} of {len(data)} "
                                f"examples, leaving {len(train_idx)} to train on",
                                "choose a fraction that leaves both sides non-empty"))
    try:
        pipeline = Pipeline(dataset, data, train_idx, seed)
    except ConfigError as exc:
        return data, None, problems + exc.problems
    return data, pipeline, problems


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
                    f"{gib(needed)} of memory; this machine has {gib(available)}", hint)]


def _check_workers(dataset) -> list[Problem]:
    # more loader processes than 4 per core never helps in-memory data, and a huge count
    # would fork that many processes
    limit = 4 * (os.cpu_count() or 1)
    if dataset.workers <= limit:
        return []
    return [Problem("dataset.workers", f"{dataset.workers} worker processes for "
                    f"{os.cpu_count()} CPU cores", f"use at most {limit}; 0 loads in the "
                    "main process, fastest for small in-memory data")]


def check_batch_split(strategy, dataset) -> list[Problem]:
    """``batch_split: balanced`` has global batches to split."""
    if getattr(strategy, "batch_split", "auto") != "balanced" or \
            dataset.distribute != "per_replica":
        return []
    return [Problem("strategy.batch_split", "balanced splits each global batch by replica "
                    "speed, but with dataset.distribute: per_replica every replica gets "
                    "whole batches of its pipeline's size", "use dataset.distribute: "
                    "global, or batch_split: auto or even")]


def check_distribution(dataset, pipeline: Pipeline, replicas: int, train) -> list[Problem]:
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
