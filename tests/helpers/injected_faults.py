"""A user model that fails on cue, for the training-fault tests.

Configs name it as any importable model (the repository is on ``PYTHONPATH`` in the
tests)::

    model: {kind: import, target: "tests.helpers.injected_faults:FaultyMLP",
            kwargs: {features: 6, classes: 3, batch_norm: true}}

What goes wrong, and where, is ``"MODE:STEP:REPLICA"`` in :data:`FAULT` (in-process
tests set it) or in the environment variable ``CSRUN_TEST_FAULT`` (subprocesses):
``nan`` makes that replica's output NaN at that training step, ``inf`` makes its
logits so extreme that its loss overflows to infinity; ``raise`` raises
``RuntimeError("injected fault ...")`` in that replica at that step, *before* its
BatchNorm, where the other replicas wait for it (the layers created in
``strategy.scope()`` all-reduce their statistics).
"""

from __future__ import annotations

import os

import torch
from torch import nn

import csrun.core as cs

FAULT: str | None = None


def _fault() -> tuple[str, int, int] | None:
    spec = FAULT or os.environ.get("CSRUN_TEST_FAULT")
    if not spec:
        return None
    mode, step, replica = spec.split(":")
    return mode, int(step), int(replica)


class FaultyMLP(nn.Module):
    """Linear -> (BatchNorm) -> ReLU -> Linear; counts each replica's training steps."""

    def __init__(self, features: int, classes: int, batch_norm: bool = False):
        super().__init__()
        self.first = nn.Linear(features, 16)
        self.norm = nn.BatchNorm1d(16) if batch_norm else nn.Identity()
        self.last = nn.Linear(16, classes)
        self.steps: dict[int, int] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fault = _fault()
        replica = self._replica()
        step = self._count(replica)
        hit = fault is not None and step == fault[1] and replica == fault[2]
        if hit and fault[0] == "raise":
            raise RuntimeError(f"injected fault at step {step}")
        out = self.last(torch.relu(self.norm(self.first(x))))
        if hit and fault[0] == "nan":
            out = out * float("nan")
        elif hit:  # finite logits whose cross-entropy overflows float32: an infinite loss
            extreme = torch.full_like(out, -3e38)
            extreme[:, 0] = 3e38
            out = out * 0 + extreme
        return out

    def _replica(self) -> int | None:
        """This replica's id while training inside ``strategy.run``, else None."""
        if not self.training or not cs.has_strategy() or cs.in_cross_replica_context():
            return None
        return cs.get_replica_context().replica_id_in_sync_group

    def _count(self, replica: int | None) -> int | None:
        if replica is None:
            return None
        self.steps[replica] = self.steps.get(replica, 0) + 1
        return self.steps[replica]
