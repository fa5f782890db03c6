"""Bounded summaries of per-step series, so that nothing a run keeps grows with its steps.

A run of ten million steps must hold, checkpoint and report what a run of a thousand
does. :class:`Curve` keeps a per-step series (the loss, a replica's step time) as at most
``limit`` points, each the mean of ``every`` consecutive steps: when the points fill up,
neighbours merge and ``every`` doubles. :class:`Thinned` keeps at most ``limit`` records
(the evaluations during training) evenly spaced: when it fills up, every other one goes.
Both are deterministic in the values they are given, and their state is checkpointed
whole, so a resumed run reports exactly what an uninterrupted one does; in a checkpoint
it is tensors of ``limit`` entries however many are in use, so checkpoints keep one size.
Every single value still goes to ``--metrics``, which streams.

Example::

    curve = Curve(limit=4)
    for loss in (4.0, 3.0, 2.0, 1.0, 0.5):
        curve.add(loss)
    curve.every, curve.points()          # (2, [3.5, 1.5, 0.5]): the last covers 1 step
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Curve", "Thinned", "POINTS"]

POINTS = 512  # enough for a plot or a sparkline; a few kilobytes in a checkpoint


def padded(values: list, limit: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``values`` in a tensor of ``limit`` entries (zeros after them): one size always."""
    tensor = torch.zeros(limit, dtype=dtype)
    tensor[:len(values)] = torch.tensor(values, dtype=dtype)
    return tensor


class Curve:
    """A per-step series as at most ``limit`` means of ``every`` steps each."""

    def __init__(self, limit: int | None = None):
        limit = POINTS if limit is None else limit
        if limit < 2 or limit % 2:
            raise ValueError(f"a curve's limit must be even and at least 2, got {limit}")
        self.limit = limit
        self.every = 1            # steps per point: a power of two
        self.steps = 0
        self._points: list[float] = []
        self._sum, self._count = 0.0, 0  # the steps not yet in a point

    def add(self, value: float) -> None:
        self.steps += 1
        self._sum += value
        self._count += 1
        if self._count < self.every:
            return
        self._points.append(self._sum / self.every)
        self._sum, self._count = 0.0, 0
        while len(self._points) >= self.limit:  # full: pairs merge, each covers twice more
            pairs = zip(self._points[::2], self._points[1::2])
            self._points = [(a + b) / 2 for a, b in pairs]
            self.every *= 2

    def points(self) -> list[float]:
        """The means, oldest first; the last covers the steps since the last full point."""
        partial = [self._sum / self._count] if self._count else []
        return self._points + partial

    def state_dict(self) -> dict[str, Any]:
        return {"every": self.every, "steps": self.steps, "kept": len(self._points),
                "points": padded(self._points, self.limit), "sum": self._sum,
                "count": self._count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.every, self.steps = int(state["every"]), int(state["steps"])
        self._points = state["points"][:int(state["kept"])].tolist()
        self._sum, self._count = float(state["sum"]), int(state["count"])


class Thinned:
    """At most ``limit`` records (flat dicts of numbers, e.g. an evaluation's), evenly
    spaced: record *n* (from 0) is kept while ``n % stride == 0``; when the records fill
    up, every other one goes and the stride doubles."""

    def __init__(self, limit: int | None = None):
        limit = POINTS if limit is None else limit
        if limit < 2 or limit % 2:
            raise ValueError(f"a thinned list's limit must be even and at least 2, got {limit}")
        self.limit = limit
        self.stride = 1
        self.seen = 0
        self.records: list[dict[str, int | float]] = []

    def add(self, record: dict[str, int | float]) -> None:
        if self.seen % self.stride == 0:
            self.records.append(record)
            if len(self.records) == self.limit:
                self.records = self.records[::2]
                self.stride *= 2
        self.seen += 1

    def state_dict(self) -> dict[str, Any]:
        """The records as one column per key (int64 where every value is an int), each
        ``limit`` long, with where each key is present."""
        keys = list(dict.fromkeys(k for record in self.records for k in record))
        columns, present = {}, {}
        for key in keys:
            values = [record.get(key, 0) for record in self.records]
            whole = all(type(v) is int for v in values)
            columns[key] = padded(values, self.limit, torch.int64 if whole else torch.float64)
            present[key] = padded([key in r for r in self.records], self.limit, torch.bool)
        return {"stride": self.stride, "seen": self.seen, "kept": len(self.records),
                "columns": columns, "present": present}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stride, self.seen = int(state["stride"]), int(state["seen"])
        kept = int(state["kept"])
        columns = {key: column[:kept].tolist() for key, column in state["columns"].items()}
        present = {key: mask[:kept].tolist() for key, mask in state["present"].items()}
        self.records = [{key: values[i] for key, values in columns.items() if present[key][i]}
                        for i in range(kept)]
