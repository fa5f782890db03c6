"""Learning-rate schedules named in a config: one ``torch.optim.lr_scheduler`` class, or a
chain of them run one after another (``SequentialLR``), e.g. linear warmup then cosine::

    schedule: [{name: LinearLR, kwargs: {start_factor: 0.1}, steps: 100},
               {name: CosineAnnealingLR, kwargs: {T_max: 900}}]

Example::

    schedule = build_schedule(config.optimizer.schedule, optimizer)
    if schedule_interval(config.optimizer.schedule) == "step": ...
"""

from __future__ import annotations

import inspect
import itertools

import torch

from ..config.problems import ConfigError, Problem
from ..config.schema import ScheduleConfig
from ..config.targets import lookup_class, parameters_hint

__all__ = ["schedule_names", "build_schedule", "schedule_interval", "takes_metric",
           "ScheduleSteps"]


def schedule_names() -> list[str]:
    """Every schedule class in ``torch.optim.lr_scheduler``."""
    base = torch.optim.lr_scheduler.LRScheduler
    return sorted(name for name, obj in vars(torch.optim.lr_scheduler).items()
                  if inspect.isclass(obj) and issubclass(obj, base) and obj is not base
                  and not name.startswith("_"))


def schedule_interval(config: "ScheduleConfig | list[ScheduleConfig] | None") -> str | None:
    """``"step"`` or ``"epoch"`` (a chain steps at its first schedule's); None: none."""
    if not config:
        return None
    return (config[0] if isinstance(config, list) else config).interval


def build_schedule(config: "ScheduleConfig | list[ScheduleConfig] | None",
                   optimizer: torch.optim.Optimizer):
    """The schedule (a ``SequentialLR`` for a chain), or None without one.

    Raises:
      ConfigError: an unknown class, refused keyword arguments, a chain link without
        ``steps``, or links with different intervals.
    """
    if not config:
        return None
    if not isinstance(config, list):
        return _one(config, optimizer, "optimizer.schedule")
    problems = [Problem(f"optimizer.schedule.{i}.steps", "every schedule of a chain but the "
                        "last needs steps (how long it lasts)", "e.g. steps: 100")
                for i, link in enumerate(config[:-1]) if link.steps is None]
    problems += [Problem(f"optimizer.schedule.{i}.interval", f"{link.interval!r} differs from "
                         f"the chain's {config[0].interval!r}", "one interval for the chain")
                 for i, link in enumerate(config) if link.interval != config[0].interval]
    problems += [Problem(f"optimizer.schedule.{i}.name", f"{link.name} steps on a metric, "
                         "which a chain (SequentialLR) cannot give it",
                         "use it alone, not in a chain")
                 for i, link in enumerate(config) if len(config) > 1 and link.name == _PLATEAU]
    if problems:
        raise ConfigError(problems)
    links = [_one(link, optimizer, f"optimizer.schedule.{i}") for i, link in enumerate(config)]
    if len(links) == 1:
        return links[0]
    milestones = list(itertools.accumulate(link.steps for link in config[:-1]))
    return torch.optim.lr_scheduler.SequentialLR(optimizer, links, milestones)


def _one(config: ScheduleConfig, optimizer: torch.optim.Optimizer, field: str):
    cls = lookup_class(torch.optim.lr_scheduler, config.name, schedule_names(),
                       f"{field}.name", "torch.optim.lr_scheduler schedule")
    try:
        return cls(optimizer, **config.kwargs)
    except (TypeError, ValueError, KeyError) as exc:
        raise ConfigError([Problem(f"{field}.kwargs", f"{config.name}: {exc}",
                                   parameters_hint(cls, {"optimizer"}))]) from None


_PLATEAU = "ReduceLROnPlateau"


def takes_metric(schedule) -> bool:
    """Whether ``schedule.step`` needs a metric (``ReduceLROnPlateau``)."""
    return isinstance(schedule, torch.optim.lr_scheduler.ReduceLROnPlateau)


class ScheduleSteps:
    """When a run steps its schedule: after every optimizer step or every pass over the
    data (``interval``). A schedule that steps on a metric (``ReduceLROnPlateau``) gets
    ``eval_loss`` after each evaluation when the run ``evaluates`` during training
    (``train.eval_every``; the interval then does not matter), else the mean training
    loss of each interval, as a plain loop would give it."""

    def __init__(self, schedule, interval: str | None, evaluates: bool):
        self.schedule, self.interval = schedule, interval
        self.metric = takes_metric(schedule)
        self.on_loss = self.metric and not evaluates

    @property
    def reads_step_loss(self) -> bool:
        """Whether each step's loss is needed at its step (a metric schedule stepped
        each step on the training loss)."""
        return self.on_loss and self.interval == "step"

    def after_update(self) -> None:
        if self.schedule is not None and not self.metric and self.interval == "step":
            self.schedule.step()

    def after_step(self, loss: float) -> None:
        if self.on_loss and self.interval == "step":
            self.schedule.step(loss)

    def after_pass(self, mean_loss: float) -> None:
        if self.schedule is None or self.interval != "epoch":
            return
        if not self.metric:
            self.schedule.step()
        elif self.on_loss:
            self.schedule.step(mean_loss)

    def after_evaluation(self, eval_loss: float) -> None:
        if self.metric and not self.on_loss:
            self.schedule.step(eval_loss)
