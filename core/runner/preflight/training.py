"""Preflight checks of how a config trains (``train``'s step options, evaluation, the best
checkpoint, export, the optimizer's target) against the other sections: what needs
what, and what a parameter-server job cannot do.

A parameter-server worker trains on its slice and pushes its own gradients, so what needs
the whole step's gradient in one place (clipping its norm, accumulating, scaling) or the
whole job's state (evaluating mid-run to stop or keep the best, exporting), and an
optimizer the ps tasks cannot rebuild by name, is refused there, before anything runs.
"""

from __future__ import annotations

from typing import Any

from ...config.problems import Problem
from .devices import compute_devices
from .outputs import check_needs_checkpoint_dir

__all__ = ["check_training", "check_length"]

_NOT_IN_PS = {  # field: why a parameter-server job cannot have it
    "train.grad_clip_norm": "each worker holds only its part of the step's gradient",
    "train.accumulate_steps": "workers push their gradients at every step",
    "train.precision": "only fp32 is supported there",
    "train.compile": "the workers' replicas call the model uncompiled",
    "train.eval_every": "only the chief evaluates, at the end",
    "train.early_stopping": "only the chief evaluates, at the end",
    "checkpoint.keep_best": "only the chief evaluates, at the end",
}
_DEFAULTS = {"train.accumulate_steps": 1, "train.precision": "fp32", "train.compile": False,
             "train.eval_every": 0}


def check_training(sections: dict[str, Any]) -> list[Problem]:
    """Every problem of the step, evaluation and export options of valid ``sections``."""
    strategy, train = sections.get("strategy"), sections.get("train")
    checkpoint, dataset = sections.get("checkpoint"), sections.get("dataset")
    if strategy is not None and strategy.kind == "parameter_server":
        return _parameter_server(sections) + check_needs_checkpoint_dir(checkpoint)
    problems: list[Problem] = []
    if train is not None:
        problems += _evaluation(train, checkpoint, dataset)
        if train.precision == "fp16" and strategy is not None:
            problems += _fp16(strategy)
    return problems + check_needs_checkpoint_dir(checkpoint)


def _value(sections: dict, dotted: str) -> Any:
    section, field = dotted.split(".")
    return getattr(sections[section], field) if sections.get(section) is not None else None


def _parameter_server(sections: dict) -> list[Problem]:
    problems = []
    for field, why in _NOT_IN_PS.items():
        value = _value(sections, field)
        if value is not None and value != _DEFAULTS.get(field):
            problems.append(Problem(field, f"not available with strategy.kind: "
                                    f"parameter_server ({why})", "remove it, or train with "
                                    "strategy.kind: central_storage"))
    return problems


def _evaluation(train, checkpoint, dataset) -> list[Problem]:
    """Early stopping and the best checkpoint need evaluations, which need a holdout."""
    problems = []
    watched = [("train.early_stopping", train.early_stopping),
               ("checkpoint.keep_best", checkpoint and checkpoint.keep_best)]
    for field, watch in watched:
        if watch is None:
            continue
        if not train.eval_every:
            problems.append(Problem(field, "needs evaluations during training",
                                    "set train.eval_every, e.g. 50"))
        if not watch.metric.startswith("eval_"):
            problems.append(Problem(f"{field}.metric", f"{watch.metric!r} is not an "
                                    "evaluated metric", "eval_loss, eval_accuracy, or "
                                    "eval_<name> of your loss function's metrics"))
    if train.eval_every and dataset is not None and not dataset.holdout:
        problems.append(Problem("train.eval_every", "there is nothing to evaluate: "
                                "dataset.holdout is 0", "hold out a fraction, e.g. "
                                "dataset.holdout=0.1"))
    return problems


def _fp16(strategy) -> list[Problem]:
    """fp16 needs GPU replicas (and its gradient scaler a GPU parameter device)."""
    devices = compute_devices(strategy)
    if devices is None or all(d.is_gpu for d in devices):  # None: check_devices reports it
        return []
    return [Problem("train.precision", "fp16 needs GPU replicas; this run computes on "
                    f"{', '.join(d.short_name for d in devices)}",
                    "use precision: bf16 on CPU (no gradient scaler needed), or fp32")]


def check_length(train) -> list[Problem]:
    """How long to train: exactly one of ``steps`` and ``epochs``."""
    if train is None or (train.steps is None) != (train.epochs is None):
        return []
    return [Problem("train", "give exactly one of steps and epochs" +
                    (" (both are set)" if train.steps else ""),
                    "e.g. train.epochs=10 or train.steps=500")]
