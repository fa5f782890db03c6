"""One training step's replica part, and what the caller does around it.

Each replica runs :class:`ReplicaStep` on its slice (forward, loss, backward); its loss is
divided by *all* the step's examples (every replica, every accumulated batch), so the
gradients the strategy sums centrally are those of the step's mean, whatever the replica
count. The replica's stats come back as one opaque value (:class:`Carried`) and are made
Python numbers once, on the caller (:func:`replica_numbers`); the losses stay tensors
where they were computed until the run reads them (:mod:`.step_losses`).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from .tally import add_metrics

__all__ = ["ReplicaStep", "Carried", "replica_numbers", "clear_grads", "compiled",
           "first_leaf", "device_type"]


class ReplicaStep:
    """A replica's part of a step (replica context): forward, backward; returns the
    summed loss (reduced) and the stats to tally after the run."""

    def __init__(self, objective, precision, model: torch.nn.Module):
        self.objective, self.precision, self.model = objective, precision, model

    def __call__(self, batch: Any, step_examples: int, scale: float
                 ) -> tuple[torch.Tensor, "Carried"]:
        begin = time.perf_counter()
        if self.precision.dtype is None:  # fp32: no autocast to enter
            stats = self.objective.stats(self.model, batch)
        else:
            with self.precision.autocast(device_type(batch)):
                stats = self.objective.stats(self.model, batch)
        loss = stats["loss"]
        loss = (loss if loss.dtype == torch.float32 else loss.float()) / step_examples
        (loss * scale if scale != 1.0 else loss).backward()
        stats["loss"] = stats["loss"].detach()
        stats["seconds"] = time.perf_counter() - begin  # a number: no op for a replica
        return stats["loss"], Carried(stats)


class Carried:
    """A replica's step stats, carried through ``run`` as one opaque value: ``run``'s
    nest handling (regroup, and the watch for a backward through outputs after the run)
    then looks at one leaf, not at each number and the output kept for the tally (~30
    µs a step less with 2 replicas); nothing backpropagates through that output."""

    __slots__ = ("stats",)

    def __init__(self, stats: dict):
        self.stats = stats


def replica_numbers(runs: list[Sequence[dict]], objective) -> tuple[list[dict[str, Any]], Any]:
    """Each replica's stats but its loss as Python numbers summed over the runs of an
    accumulated step (converted once here, then read by the tallies and the step record;
    ``losses``: its batches' loss tensors, unread), and the step's correct predictions,
    tallied after the run (``objective.tally_step``): a number, or outputs for
    :class:`~csrun.core.runner.objectives.PendingCorrect` to count."""
    correct = objective.tally_step(runs)  # (takes the outputs out of the stats)
    numbers = []
    for replica in zip(*runs):
        total: dict[str, Any] = {"losses": [], "examples": 0, "seconds": 0.0}
        for stats in replica:
            total["losses"].append(stats["loss"])
            total["examples"] += stats["examples"]
            total["seconds"] += stats["seconds"]
            add_metrics(total, stats)
        numbers.append(total)
    return numbers, correct


def clear_grads(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``, without the profiler span and dynamo
    guard torch wraps it in (~20 µs a step uncontended, 0.1 ms beside running replicas,
    for 6 parameters). An optimizer class with a ``zero_grad`` of its own keeps it."""
    if type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad \
            or "zero_grad" in vars(optimizer):  # a class's own, or one patched on
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def compiled(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile`` of the model for the replicas to call; checkpoints and exports
    keep using ``model`` itself (its own ``state_dict`` keys)."""
    return torch.compile(model)


def first_leaf(batch: Any) -> Any:
    """The first tensor (or PerReplica) of a batch of any structure: it counts examples."""
    while isinstance(batch, (tuple, list, dict)):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return batch


def device_type(batch: Any) -> str:
    """Where a replica's slice lives (``cpu``, ``cuda``): the autocast device."""
    leaf = first_leaf(batch)
    return leaf.device.type if isinstance(leaf, torch.Tensor) else "cpu"
