"""The optimizer and its schedule, built on dummy parameters (one per parameter group) to
catch every mistake in ``optimizer`` now: an unknown class, keyword arguments it refuses,
a group option it does not know, a schedule that does not fit."""

from __future__ import annotations

import torch

from ...config.problems import ConfigError, Problem
from ...config.schema import OptimizerConfig
from ..optimizers import build_optimizer
from ..schedules import build_schedule

__all__ = ["check_optimizer"]


def check_optimizer(config: OptimizerConfig) -> list[Problem]:
    """Every problem of the ``optimizer`` section."""
    named = [("_default", torch.zeros(1, requires_grad=True))] + \
        [(f"group{i}", torch.zeros(1, requires_grad=True))
         for i in range(len(config.param_groups))]
    dummy = config.model_copy(update={"param_groups": [
        g.model_copy(update={"match": f"^group{i}$"}) for i, g in enumerate(config.param_groups)]})
    if config.tables is not None:  # a table of its own, for optimizer.tables
        named.append(("_table", torch.zeros(2, 1, requires_grad=True)))
    try:
        optimizer = build_optimizer(dummy, named, {"_table"})
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
