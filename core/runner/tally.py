"""Sums over a span of training steps: overall, per replica and per phase.

A run keeps three: the whole run's (checkpointed), the current log window's
(checkpointed: a resumed run logs what an uninterrupted one does) and this process's
(for throughput, never checkpointed).
"""

from __future__ import annotations

import math
from typing import Sequence

from .events import ReplicaStats

__all__ = ["PHASES", "Tally", "add_metrics", "loss_fn_metrics"]

PHASES = ("distribute", "run", "update", "reduce")


class Tally:
    """Sums of the steps added: examples, loss, correct predictions, a loss function's
    metrics, each replica's examples, loss and seconds, and each phase's seconds."""

    def __init__(self, replicas: int):
        self.steps = self.examples = self.correct = 0
        self.loss = 0.0
        self.replica_examples = [0] * replicas
        self.replica_loss = [0.0] * replicas
        self.replica_seconds = [0.0] * replicas
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.metrics: dict[str, float] = {}  # sums of a loss function's metrics

    def add(self, per_replica: Sequence[dict], phases: dict[str, float]) -> None:
        """A step's numbers; its correct predictions come later
        (:meth:`csrun.core.runner.state.TrainState.count_correct`)."""
        self.steps += 1
        for r, stats in enumerate(per_replica):  # Python numbers (replica_numbers)
            add_metrics(vars(self), stats)
            examples = stats["examples"]
            self.examples += examples
            self.replica_examples[r] += examples
            self.replica_seconds[r] += stats["seconds"]
        for name, seconds in phases.items():
            self.phases[name] += seconds

    def add_loss(self, replicas: Sequence[float]) -> None:
        """A step's summed loss of each replica, when read (it may come steps later:
        :mod:`csrun.core.runner.step_losses`)."""
        for r, loss in enumerate(replicas):
            self.loss += loss
            self.replica_loss[r] += loss

    def replica_stats(self, devices: Sequence[str]) -> list[ReplicaStats]:
        steps = max(self.steps, 1)
        return [ReplicaStats(r, device, n, self.replica_loss[r] / n if n else math.nan,
                             self.replica_seconds[r] / steps)
                for r, (device, n) in enumerate(zip(devices, self.replica_examples))]

    def mean_phases(self) -> dict[str, float]:
        return {name: total / max(self.steps, 1) for name, total in self.phases.items()}

    def state_dict(self) -> dict:
        return dict(vars(self))

    def load_state_dict(self, state: dict) -> None:
        vars(self).update(state)


def add_metrics(totals: dict, stats: dict) -> None:
    """Sum a loss function's metrics (``stats["metrics"]``) into ``totals["metrics"]``;
    a named loss has none, and adds no ``metrics`` entry (a step's hot path)."""
    if "metrics" not in stats:
        return
    sums = totals.setdefault("metrics", {})
    for name, value in stats["metrics"].items():
        sums[name] = sums.get(name, 0.0) + float(value)


def loss_fn_metrics(totals: Tally, evaluated: dict[str, float]) -> dict[str, float]:
    """A loss function's metrics: ``train_<name>`` over every training example of the
    run, ``eval_<name>`` over the held-out ones (``accuracy`` is reported as correct
    predictions already)."""
    examples = max(totals.examples, 1)
    found = {f"train_{name}": value / examples for name, value in totals.metrics.items()}
    found |= {f"eval_{name}": value for name, value in evaluated.items()}
    return {key: value for key, value in found.items() if not key.endswith("_accuracy")}
