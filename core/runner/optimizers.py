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
from ..cluster import CombinedOptimizer
from ..config.schema import OptimizerConfig, TableOptimizerConfig
from ..config.targets import import_object, lookup_class, parameters_hint
from ..config.user_code import CHECKED_FAILURES, user_problem
from .schedules import build_schedule

__all__ = ["optimizer_names", "optimizer_class", "param_groups", "unmatched_groups",
           "build_optimizer", "build_schedule", "table_parameters"]


def optimizer_names() -> list[str]:
    """Every optimizer class in ``torch.optim``."""
    return sorted(name for name, obj in vars(torch.optim).items()
                  if inspect.isclass(obj) and issubclass(obj, torch.optim.Optimizer)
                  and obj is not torch.optim.Optimizer)


def optimizer_class(config: "OptimizerConfig | TableOptimizerConfig",
                    where: str = "optimizer") -> type:
    """``optimizer.target``'s class, else ``torch.optim.<name>`` (``where``: the
    section, ``optimizer`` or ``optimizer.tables``).

    Raises:
      ConfigError: an unknown name, a target that does not import, or both given.
    """
    if config.target is None:
        return lookup_class(torch.optim, config.name, optimizer_names(), f"{where}.name",
                       "torch.optim optimizer")
    if "name" in config.model_fields_set:
        raise ConfigError([Problem(f"{where}.target", "give name or target, not both",
                                   "name: a torch.optim class; target: your own class")])
    return import_object(config.target, f"{where}.target")


NO_TABLES = Problem("optimizer.tables", "the model has no nn.Embedding or nn.EmbeddingBag "
                    "for it to train", "remove optimizer.tables, or build the tables with "
                    "torch.nn's Embedding/EmbeddingBag")


def table_parameters(model: torch.nn.Module) -> set[str]:
    """The names of the embedding tables' weights (every ``nn.Embedding`` and
    ``nn.EmbeddingBag``): what ``optimizer.tables`` trains."""
    return {f"{name}.weight" if name else "weight" for name, module in model.named_modules()
            if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag))}


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


def build_optimizer(config: "OptimizerConfig", params: Iterable,
                    tables: Iterable[str] = ()) -> torch.optim.Optimizer:
    """``cls(params, lr=lr, **kwargs)``; ``params``: parameters, or ``(name, parameter)``
    pairs, which ``optimizer.param_groups`` split into groups. With ``optimizer.tables``,
    the parameters named in ``tables`` (:func:`table_parameters`) get that optimizer and
    the rest this one, both in one :class:`~csrun.core.CombinedOptimizer`.

    Raises:
      ConfigError: an unknown class, or keyword arguments the class refuses.
    """
    params = list(params)
    if config.tables is None:
        return _built(config, params)
    tables = set(tables)
    named = [(n, p) for n, p in params] if params and isinstance(params[0], tuple) else []
    if not any(n in tables for n, _ in named):
        raise ConfigError([NO_TABLES])
    dense = [(n, p) for n, p in named if n not in tables]
    table_optimizer = _built(config.tables, [p for n, p in named if n in tables],
                             "optimizer.tables")
    # the dense part first: its step is the job's step, its lr the one logged
    return CombinedOptimizer(([_built(config, dense)] if dense else []) + [table_optimizer])


def _built(config: "OptimizerConfig | TableOptimizerConfig", params: list,
           where: str = "optimizer") -> torch.optim.Optimizer:
    cls = optimizer_class(config, where)
    groups = getattr(config, "param_groups", [])
    if params and isinstance(params[0], tuple):
        params = param_groups(config, params) if groups else [p for _, p in params]
    try:
        optimizer = cls(params, lr=config.lr, **config.kwargs)
    except (TypeError, ValueError, KeyError) as exc:
        field = f"{where}.param_groups" if groups and "group" in str(exc) \
            else f"{where}.kwargs"
        raise ConfigError([Problem(field, f"{cls.__name__}: {exc}",
                                   parameters_hint(cls, {"params", "lr"}))]) from None
    except CHECKED_FAILURES as exc:  # noqa: BLE001 - a user's class may raise anything
        field = f"{where}.target" if config.target else f"{where}.kwargs"
        raise ConfigError([user_problem(field, f"{config.target or cls.__name__}(params, "
                                        "lr, **kwargs)", exc)]) from None
    if groups:
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
