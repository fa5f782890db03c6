"""Whether an evaluated metric improved: for early stopping (``train.early_stopping``) and
for the best checkpoint (``checkpoint.keep_best``). The state is plain data, checkpointed,
so that a resumed run keeps knowing the best.

Example::

    watch = MetricWatch("eval_loss", "min", min_delta=0.0)
    if watch.update(step=100, value=0.31): ...   # True: a new best
    watch.bad                                     # evaluations since the best
"""

from __future__ import annotations

import math

__all__ = ["MetricWatch"]


class MetricWatch:
    """The best value of ``metric`` so far (``mode``: ``min`` or ``max``); a change of
    more than ``min_delta`` counts as an improvement."""

    def __init__(self, metric: str, mode: str, min_delta: float = 0.0):
        self.metric, self.mode, self.min_delta = metric, mode, min_delta
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad = 0

    def improves(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.best is None:
            return True
        gain = self.best - value if self.mode == "min" else value - self.best
        return gain > self.min_delta

    def update(self, step: int, value: float) -> bool:
        """Record an evaluation; True when it is a new best."""
        if self.improves(value):
            self.best, self.best_step, self.bad = value, step, 0
            return True
        self.bad += 1
        return False

    def state(self) -> dict:
        return {"best": self.best, "best_step": self.best_step, "bad": self.bad}

    def load(self, state: dict | None) -> None:
        if state:
            self.best, self.best_step, self.bad = state["best"], state["best_step"], \
                state["bad"]
