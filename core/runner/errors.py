"""What a failed run raises: errors the user can act on (the CLI's exit code 1)."""

from __future__ import annotations

__all__ = ["RunError", "NonFiniteLoss"]


class RunError(RuntimeError):
    """A run that failed for a reason the user can act on (exit code 1)."""


class NonFiniteLoss(RunError):
    """A replica's loss became NaN or infinite; the run stopped before the update."""
