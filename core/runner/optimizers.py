"""Optimizers and learning-rate schedules named in a config (any ``torch.optim`` class).

Example::

    optimizer = build_optimizer(config.optimizer, model.parameters())
    schedule = build_schedule(config.optimizer.schedule, optimizer)
"""

from __future__ import annotations

import inspect
from typing import Any, Iterable

import torch

from ..config.schema import OptimizerConfig, ScheduleConfig
from ..config.problems import ConfigError, Problem, did_you_mean


__all__ = ["optimizer_names", "schedule_names", "build_optimizer", "build_schedule",
           "check_optimizer"]


def optimizer_names() -> list[str]:
    """Every optimizer class in ``torch.optim``."""
    return sorted(name for name, obj in vars(torch.optim).items()
                  if inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer)
                  and obj is not torch.optim.Optimizer)


def schedule_names() -> list[str]:
    """Every schedule class in ``torch.optim.lr_scheduler``."""
    base = torch.optim.lr_scheduler.LRScheduler
    return sorted(name for name, obj in vars(torch.optim.lr_scheduler).items()
                  if inspect.isclass(obj) and issubclass(obj, base) and obj is not base
                  and not name.startswith("_"))


def _lookup(module: Any, name: str, names: list[str], field: str, what: str):
    if name not in names:
        raise ConfigError([Problem(field, f"{name!r} is not a {what}",
                                   did_you_mean(name, names) or f"one of: {', '.join(names)}")])
    return getattr(module, name)


def build_optimizer(config: "OptimizerConfig", params: Iterable) -> torch.optim.Optimizer:
    """``torch.optim.<name>(params, lr=lr, **kwargs)``.

    Raises:
      ConfigError: an unknown name, or keyword arguments the class refuses.
    """
    cls = _lookup(torch.optim, config.name, optimizer_names(), "optimizer.name",
                  "torch.optim optimizer")
    try:
        return cls(params, lr=config.lr, **config.kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError([Problem("optimizer.kwargs", f"{config.name}: {exc}",
                                   _parameters_hint(cls, {"params", "lr"}))]) from None


def build_schedule(config: "ScheduleConfig | None", optimizer: torch.optim.Optimizer):
    """``torch.optim.lr_scheduler.<name>(optimizer, **kwargs)``, or None without one."""
    if config is None:
        return None
    cls = _lookup(torch.optim.lr_scheduler, config.name, schedule_names(),
                  "optimizer.schedule.name", "torch.optim.lr_scheduler schedule")
    try:
        return cls(optimizer, **config.kwargs)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError([Problem("optimizer.schedule.kwargs", f"{config.name}: {exc}",
                                   _parameters_hint(cls, {"optimizer"}))]) from None


def _parameters_hint(cls: type, skip: set) -> str | None:
    try:
        names = [n for n in inspect.signature(cls).parameters if n not in skip]
    except (TypeError, ValueError):  # pragma: no cover - builtins without signatures
        return None
    return f"{cls.__name__} takes: {', '.join(names)}" if names else None


def check_optimizer(config: "OptimizerConfig") -> list[Problem]:
    """Build the optimizer and schedule on a dummy parameter to catch every mistake now."""
    try:
        optimizer = build_optimizer(config, [torch.zeros(1, requires_grad=True)])
    except ConfigError as exc:
        problems = exc.problems
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.lr)
    else:
        problems = []
    try:
        build_schedule(config.schedule, optimizer)
    except ConfigError as exc:
        problems += exc.problems
    return problems
