"""Optimizers named in a config (a ``torch.optim`` class or your own), with parameter
groups by name; schedules are :mod:`.schedules`; the preflight check of both is
:mod:`csrun.core.runner.preflight.optimizer`.

Example::

    optimizer = build_optimizer(config.optimizer, model.named_parameters())
    schedule = build_schedule(config.optimizer.schedule, optimizer)
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Iterable

import torch

from ..config.problems import ConfigError, Problem, did_you_mean
from ..config.schema import OptimizerConfig
from ..config.targets import import_object, lookup_class, parameters_hint
from ..config.user_code import CHECKED_FAILURES, user_problem
from .schedules import build_schedule

__all__ = ["optimizer_names", "optimizer_class", "param_groups", "unmatched_groups",
           "build_optimizer", "build_schedule"]


def optimizer_names() -> list[str]:
    """Every optimizer class in ``torch.optim``."""
    return sorted(name for name, obj in vars(torch.optim).items()
                  if inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer)
                  and obj is not torch.optim.Optimizer)


def optimizer_class(config: "OptimizerConfig") -> type:
    """``optimizer.target``'s class, else ``torch.optim.<name>``.

    Raises:
      ConfigError: an unknown name, a target that does not import, or both given.
    """
    if config.target is None:
        return lookup_class(torch.optim, config.name, optimizer_names(), "optimizer.name",
                       "torch.optim optimizer")
    if "name" in config.model_fields_set:
        raise ConfigError([Problem("optimizer.target", "give name or target, not both",
                                   "name: a torch.optim class; target: your own class")])
    return import_object(config.target, "optimizer.target")


def param_groups(config: "OptimizerConfig", named: Iterable[tuple[str, Any]]) -> list:
    """The parameters split by ``optimizer.param_groups``: each parameter goes to the
    first group whose ``match`` is found in its name; the rest make a default group
    (with the optimizer's own options), listed first. Returns what the optimizer takes."""
    named = list(named)
    if not config.param_groups:
        return [p for _, p in named]
    groups: list[list] = [[] for _ in config.param_groups]
    rest = []
    for name, param in named:
        index = next((i for i, g in enumerate(config.param_groups)
                      if re.search(g.match, name)), None)
        (rest if index is None else groups[index]).append(param)
    return [{"params": rest}] + [{"params": params, **g.options()}
                                 for g, params in zip(config.param_groups, groups)]


def unmatched_groups(config: "OptimizerConfig", names: Iterable[str]) -> list[str]:
    """The ``match`` patterns that no parameter name matches (likely typos)."""
    names = list(names)
    return [g.match for g in config.param_groups
            if not any(re.search(g.match, n) for n in names)]


def build_optimizer(config: "OptimizerConfig", params: Iterable) -> torch.optim.Optimizer:
    """``cls(params, lr=lr, **kwargs)``; ``params``: parameters, or ``(name, parameter)``
    pairs, which ``optimizer.param_groups`` split into groups.

    Raises:
      ConfigError: an unknown class, or keyword arguments the class refuses.
    """
    cls = optimizer_class(config)
    params = list(params)
    if params and isinstance(params[0], tuple):
        params = param_groups(config, params)
    try:
        optimizer = cls(params, lr=config.lr, **config.kwargs)
    except (TypeError, ValueError, KeyError) as exc:
        field = "optimizer.param_groups" if config.param_groups and "group" in str(exc) \
            else "optimizer.kwargs"
        raise ConfigError([Problem(field, f"{cls.__name__}: {exc}",
                                   parameters_hint(cls, {"params", "lr"}))]) from None
    except CHECKED_FAILURES as exc:  # noqa: BLE001 - a user's class may raise anything
        field = "optimizer.target" if config.target else "optimizer.kwargs"
        raise ConfigError([user_problem(field, f"{config.target or cls.__name__}(params, "
                                        "lr, **kwargs)", exc)]) from None
    _check_group_options(config, optimizer)
    return optimizer


def _check_group_options(config: "OptimizerConfig", optimizer) -> None:
    """A group's option the optimizer does not know would be kept and ignored: refuse it."""
    known = sorted(optimizer.defaults)
    problems = [Problem(f"optimizer.param_groups.{i}.{key}", f"{type(optimizer).__name__} "
                        "has no such option", did_you_mean(key, known) or
                        f"its options: {', '.join(known)}")
                for i, group in enumerate(config.param_groups) for key in group.options()
                if key not in optimizer.defaults]
    if problems:
        raise ConfigError(problems)
