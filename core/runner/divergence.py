"""Divergence without NaN: a loss that runs away to 1e9 while staying finite.

The rule (docs/reliability.md): the *smoothed* loss -- the mean over a window of
``train.log_every`` steps, what each log reports -- is compared with the run's *start*,
the loss of its first step (before any update). A run has diverged when the smoothed
loss exceeds ``train.divergence`` times the start in ``WINDOWS`` consecutive windows, or
in the last window of the run (a run must not end as a success on a loss that ran
away). It is computed from the per-step losses alone, which checkpoints keep, so a
resumed run judges as an uninterrupted one does.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["diverged", "WINDOWS"]

WINDOWS = 3


def diverged(losses: Sequence[float], window: int, factor: float | None,
             last: bool) -> str | None:
    """Why the run diverged (a message), or None. ``last``: this is the run's end."""
    if factor is None or not losses or not losses[0] > 0:
        return None  # no check, or a start of 0 that no factor can scale
    start, limit = losses[0], factor * losses[0]
    needed = 1 if last else WINDOWS
    means = [_mean(losses[len(losses) - (k + 1) * window:len(losses) - k * window])
             for k in range(needed) if len(losses) - (k + 1) * window >= 1]
    if len(means) < needed or any(mean <= limit for mean in means):
        return None
    return (f"the loss diverged: {means[0]:.3g} over the last {window} steps, more than "
            f"{factor:g}x the first step's {start:.3g}"
            + ("" if last else f" for {WINDOWS} logs in a row")
            + "; try a lower optimizer.lr (train.divergence sets the factor; null turns "
            "the check off)")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
