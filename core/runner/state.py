"""Where training is and what it has seen so far: the loop's state as one object.

:class:`TrainState` is checkpointed whole (``state_dict``/``load_state_dict``), so that a
resumed run continues the step count, the data position, the loss curve and the tallies
of an uninterrupted one and logs what it would have logged. Its size does not grow with
the steps: the losses are a bounded :class:`~csrun.core.runner.curve.Curve`, the first
step's and the last few log windows' (what the divergence rule reads).

Example::

    state = TrainState(replicas=2, recent=150)
    state.record(per_replica, correct, phases=phases, batches=1)
    state.add_loss(loss=0.7, replicas=[0.5, 0.9])   # when read (:mod:`.step_losses`)
    log = state.log(total_steps=100, learning_rate=0.01, devices=["CPU:0", "CPU:1"],
                    classify=True)
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

from .curve import Curve, padded
from .events import ReplicaStats, StepLog
from .objectives import PendingCorrect
from .tally import Tally

__all__ = ["TrainState", "position_at"]


def position_at(step: int, steps_per_epoch: int | None, accumulate_steps: int
                ) -> tuple[int, int]:
    """The ``(epoch, position)`` at which a run stands after ``step`` optimizer steps: a
    restarted parameter-server worker's own place in its share, from its step count.

    A pass is ``steps_per_epoch`` steps of ``accumulate_steps`` batches each (its last
    step may take fewer, so it ends the pass); without a known length (a pipeline that
    repeats forever, a stream) the run is in its first pass.

    Example::

        position_at(25, steps_per_epoch=10, accumulate_steps=2)   # (2, 10)
    """
    if not steps_per_epoch:
        return 0, step * accumulate_steps
    epoch, steps = divmod(step, steps_per_epoch)
    return epoch, steps * accumulate_steps


class TrainState:
    """The step, epoch and position in the pass (batches consumed), the losses, and the
    tallies: the whole run's, the current log window's, and this process's (``session``:
    its throughput, not checkpointed). ``recent``: how many of the newest losses to keep
    (the divergence rule's windows)."""

    def __init__(self, replicas: int, recent: int):
        self.replicas = replicas
        self.step = self.epoch = self.position = 0
        self.curve = Curve()
        self.first_loss: float | None = None
        self.pass_loss, self.pass_steps = 0.0, 0  # this pass's, for a schedule on it
        self.recent: collections.deque[float] = collections.deque(maxlen=recent)
        self.totals, self.window = Tally(replicas), Tally(replicas)
        self.session = Tally(replicas)
        self.last_log: StepLog | None = None
        self.pending_correct = PendingCorrect()  # counted into the tallies when read

    def record(self, per_replica: Sequence[dict], correct: Any,
               phases: dict[str, float], batches: int) -> None:
        """A finished optimizer step over ``batches`` batches of the pass; its losses
        come when read (:meth:`add_loss`)."""
        self.step += 1
        self.position += batches
        for tally in (self.totals, self.window, self.session):
            tally.add(per_replica, phases)
        self.pending_correct.add(correct)

    def add_loss(self, loss: float, replicas: Sequence[float]) -> None:
        """A step's loss (its mean) and each replica's summed loss, read
        (:mod:`csrun.core.runner.step_losses`), in step order."""
        self._add_loss(loss)
        for tally in (self.totals, self.window, self.session):
            tally.add_loss(replicas)

    def end_pass(self) -> float:
        """The pass over the data ended: the next one begins; returns the ended pass's
        mean step loss."""
        mean = self.pass_loss / max(self.pass_steps, 1)
        self.epoch, self.position = self.epoch + 1, 0
        self.pass_loss, self.pass_steps = 0.0, 0
        return mean

    def _add_loss(self, loss: float) -> None:
        if self.first_loss is None:
            self.first_loss = loss
        self.pass_loss += loss
        self.pass_steps += 1
        self.curve.add(loss)
        self.recent.append(loss)

    @property
    def last_loss(self) -> float | None:
        return self.recent[-1] if self.recent else None

    def count_correct(self) -> int:
        """Count the correct predictions waiting since the last count into the tallies
        (before they are read: a log line, a record, a checkpoint); returns them."""
        correct = self.pending_correct.take()
        for tally in (self.totals, self.window, self.session):
            tally.correct += correct
        return correct

    def log(self, total_steps: int, learning_rate: float, devices: Sequence[str],
            classify: bool) -> StepLog:
        """The log window's :class:`StepLog`; a new window starts."""
        self.count_correct()
        window = self.window
        self.last_log = StepLog(
            step=self.step, total_steps=total_steps, epoch=self.epoch,
            loss=window.loss / max(window.examples, 1),
            accuracy=window.correct / max(window.examples, 1) if classify else None,
            learning_rate=learning_rate, replicas=window.replica_stats(devices),
            phases_s=window.mean_phases())
        self.window = Tally(self.replicas)
        return self.last_log

    def state_dict(self) -> dict:
        self.count_correct()  # the tallies are saved: their counts must be in
        return {"step": self.step, "epoch": self.epoch, "position": self.position,
                "loss_curve": self.curve.state_dict(), "first_loss": self.first_loss,
                "recent_losses": padded(list(self.recent), self.recent.maxlen),
                "recent_kept": len(self.recent),
                "pass_loss": [self.pass_loss, self.pass_steps],
                "totals": self.totals.state_dict(), "window": self.window.state_dict(),
                "last_log": self.last_log.to_dict() if self.last_log else None}

    def load_state_dict(self, payload: dict) -> None:
        self.step, self.epoch, self.position = payload["step"], payload["epoch"], \
            payload["position"]
        if "losses" in payload:  # an older checkpoint: every step's loss, replayed
            self.curve, self.first_loss, self.recent = Curve(), None, \
                collections.deque(maxlen=self.recent.maxlen)
            for loss in payload["losses"].tolist():
                self._add_loss(loss)
        else:
            self.curve.load_state_dict(payload["loss_curve"])
            self.first_loss = payload["first_loss"]
            self.recent.clear()
            self.recent.extend(payload["recent_losses"][:payload["recent_kept"]].tolist())
        self.pass_loss, self.pass_steps = payload.get("pass_loss", (0.0, 0))
        self.totals.load_state_dict(payload["totals"])
        self.window.load_state_dict(payload["window"])
        last = payload.get("last_log")
        self.last_log = _step_log_from(dict(last)) if last else None


def _step_log_from(data: dict) -> StepLog:
    replicas = [ReplicaStats(**r) for r in data.pop("replicas")]
    return StepLog(replicas=replicas, **data)
