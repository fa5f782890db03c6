"""The steps' losses, kept where the replicas computed them until the run reads them.

Reading a loss on a GPU (``float(loss)``) makes the host wait for the device: the next
step cannot be queued while this one runs. So a loss that lives on a device that makes
the host wait stays there, a reference per step, until the run needs the numbers: a log,
an evaluation, a checkpoint, the end of a pass, or ``CAPACITY`` steps held (so what is
kept does not grow with the steps). Then every held step is read at once: one stack and
one read per device. A loss on the CPU costs no wait to read; it is read at its step, so
a NaN stops the run before its update there (docs/reliability.md). A run that needs each
step's loss at its step (``--metrics``, a ``ReduceLROnPlateau`` stepped per step) reads
each step (``each_step``).

Example::

    losses = StepLosses(each_step=False)
    losses.add(step=1, replicas=[[l0], [l1]], reduced=[total], examples=64)
    if losses.due():
        for read in losses.read():   # StepLoss(step=1, loss=..., replicas=[..., ...])
            ...
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

import torch

from .errors import NonFiniteLoss

__all__ = ["StepLoss", "StepLosses", "CAPACITY", "waits_to_read", "check_finite"]

CAPACITY = 256  # steps held at most: ~kilobytes on a device, one read per 256 steps


def waits_to_read(tensor: torch.Tensor) -> bool:
    """Whether reading ``tensor`` makes the host wait for a device (not on the CPU)."""
    return tensor.device.type != "cpu"


@dataclasses.dataclass
class StepLoss:
    """One step's loss (the step's mean) and each replica's summed loss, as numbers."""

    step: int
    loss: float
    replicas: list[float]


@dataclasses.dataclass
class _Held:
    step: int
    replicas: list[list[torch.Tensor]]  # replica -> its batches' losses
    reduced: list[torch.Tensor]  # the batches' reduced (summed) losses
    examples: int


class StepLosses:
    """The losses of the steps not read yet (at most ``CAPACITY`` steps)."""

    def __init__(self, each_step: bool):
        self.each_step = each_step
        self._held: list[_Held] = []
        self._waits = False  # a held loss is on a device the host waits for

    def add(self, step: int, replicas: Sequence[Sequence[torch.Tensor]],
            reduced: Sequence[torch.Tensor], examples: int) -> None:
        held = _Held(step, [list(r) for r in replicas], list(reduced), examples)
        self._held.append(held)
        if not self._waits:
            self._waits = any(waits_to_read(t) for t in held.reduced) or any(
                waits_to_read(t) for r in held.replicas for t in r)

    def due(self) -> bool:
        """Read now: each step is read, a loss costs no wait, or the hold is full."""
        return bool(self._held) and (self.each_step or not self._waits
                                     or len(self._held) >= CAPACITY)

    @property
    def held(self) -> int:
        return len(self._held)

    def read(self) -> list[StepLoss]:
        """The held steps' losses as numbers, oldest first; the hold empties."""
        held, self._held, self._waits = self._held, [], False
        if not held:
            return []
        tensors = [t for h in held for t in (*h.reduced, *(x for r in h.replicas for x in r))]
        numbers = iter(_read_all(tensors))
        out = []
        for h in held:
            reduced = [next(numbers) for _ in h.reduced]
            replicas = []
            for batches in h.replicas:
                total = 0.0  # summed as the batches came (the order of a plain loop)
                for _ in batches:
                    total += next(numbers)
                replicas.append(total)
            out.append(StepLoss(h.step, sum(reduced) / h.examples, replicas))
        return out


def check_finite(read: StepLoss, step: int, devices: Sequence[str],
                 checkpoint_note: Callable[[], str]) -> None:
    """Fail the run on a non-finite loss read, naming its step and replica; ``step``: the
    last step updated (the read one's update has not run when it is the next)."""
    for replica, value in enumerate(read.replicas):
        if math.isfinite(value):
            continue
        when = "stopped before the update" if read.step > step else (
            "read later (a loss on a GPU is read at each log, evaluation, checkpoint and "
            f"pass end, not each step), after the updates of steps {read.step}-{step} ran")
        raise NonFiniteLoss(
            f"the loss is {value} at step {read.step} on replica {replica} "
            f"({devices[replica]}); {when}, {checkpoint_note()}. Try a lower "
            "optimizer.lr, or check the data for NaN/inf values")


def _read_all(tensors: list[torch.Tensor]) -> list[float]:
    """Each (one-element) tensor's value, read with one stack and one read per device."""
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    values: list[float] = [0.0] * len(tensors)
    for indices in by_device.values():
        if len(indices) == 1:
            values[indices[0]] = float(tensors[indices[0]])
            continue
        # stack promotes to the widest dtype held: every value stays exact
        read = torch.stack([tensors[i].detach().reshape(()) for i in indices]).tolist()
        for i, value in zip(indices, read):
            values[i] = float(value)
    return values
