"""Divergence without NaN: a loss that runs away to 1e9 while staying finite.

The rule (docs/reliability.md): the *smoothed* loss -- the mean over a window of
``train.log_every`` steps, what each log reports -- is compared with the run's *start*,
the loss of its first step (before any update). A run has diverged when the smoothed
loss exceeds ``train.divergence`` times the start in ``WINDOWS`` consecutive windows, or
in the last window of the run (a run must not end as a success on a loss that ran
away). It needs only the first step's loss and the last ``WINDOWS`` windows' losses,
which checkpoints keep, so a resumed run judges as an uninterrupted one does.
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["diverged", "WINDOWS"]

WINDOWS = 3


def diverged(losses: Sequence[float], window: int, factor: float | None,
             last: bool, *, first: float | None = None, steps: int | None = None
             ) -> str | None:
    """Why the run diverged (a message), or None. ``last``: this is the run's end.

    ``losses``: every step's loss; or, with ``first`` (the first step's) and ``steps``
    (how many there were), the most recent ones (at least ``WINDOWS * window`` of them).
    """
    first = losses[0] if first is None and losses else first
    steps = len(losses) if steps is None else steps
    if factor is None or first is None or not first > 0:
        return None  # no check, or a start of 0 that no factor can scale
    start, limit = first, factor * first
    needed = 1 if last else WINDOWS
    end = len(losses)  # the windows end at the newest loss; none takes the first step's
    means = [_mean(losses[end - (k + 1) * window:end - k * window])
             for k in range(needed)
             if steps - (k + 1) * window >= 1 and end - (k + 1) * window >= 0]
    if len(means) < needed or any(mean <= limit for mean in means):
        return None
    return (f"the loss diverged: {means[0]:.3g} over the last {window} steps, more than "
            f"{factor:g}x the first step's {start:.3g}"
            + ("" if last else f" for {WINDOWS} logs in a row")
            + "; try a lower optimizer.lr (train.divergence sets the factor; null turns "
            "the check off)")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
