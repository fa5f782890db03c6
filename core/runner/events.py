"""What a training run reports while it runs (the runner emits, the CLI renders).

The runner never prints: it calls ``on_event(event)`` with one of these dataclasses, and
returns a :class:`RunResult` at the end. ``to_dict()`` gives the JSON form of each.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["RunStarted", "StepDone", "StepLog", "ReplicaStats", "CheckpointSaved", "Notice",
           "Evaluated", "RunResult"]


class _Event:
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class RunStarted(_Event):
    """The run is set up: where it runs, on what, for how long."""

    compute_devices: list[str]
    parameter_device: str
    model: str
    parameters: int
    dataset: str
    train_examples: int
    holdout_examples: int
    global_batch_size: int
    distribute: str
    total_steps: int
    steps_per_epoch: int | None
    start_step: int
    seed: int


@dataclasses.dataclass
class StepDone(_Event):
    """One optimizer step finished (for progress bars); ``loss``: the newest step loss
    read, this step's where losses are read each step, else the last log's step's (None
    before the first: :mod:`csrun.core.runner.step_losses`)."""

    step: int
    total_steps: int
    loss: float | None


@dataclasses.dataclass
class ReplicaStats(_Event):
    """One replica's share of the steps since the last log."""

    replica: int
    device: str
    examples: int
    loss: float  # mean loss over its examples (nan when it had none)
    step_time_s: float  # mean wall time of its part of a step, inside strategy.run


@dataclasses.dataclass
class StepLog(_Event):
    """Every ``train.log_every`` steps: per-replica results and the phase times.

    ``phases_s`` holds the mean seconds per step of each phase, in order: distribute
    (next distributed batch), run (``strategy.run``), update (``optimizer.step``), reduce
    (``strategy.reduce`` of the step's results).
    """

    step: int
    total_steps: int
    epoch: int
    loss: float
    accuracy: float | None
    learning_rate: float
    replicas: list[ReplicaStats]
    phases_s: dict[str, float]


@dataclasses.dataclass
class CheckpointSaved(_Event):
    step: int
    path: str


@dataclasses.dataclass
class Notice(_Event):
    """Something the user should know that is not an error (resumed, dropped batches)."""

    message: str


@dataclasses.dataclass
class Evaluated(_Event):
    """Held-out metrics (``dataset.holdout``): after training, and every
    ``train.eval_every`` steps during it (``step`` set)."""

    examples: int
    loss: float
    accuracy: float | None
    step: int | None = None  # during training: after this step


@dataclasses.dataclass
class RunResult(_Event):
    """The outcome of a run (also ``csrun train --json``).

    ``status`` is ``"completed"`` or ``"interrupted"`` (Ctrl-C or SIGTERM: saved first;
    ``signal`` names which, and the CLI exits 128 + its number: 130 or 143).
    """

    status: str
    steps: int
    total_steps: int
    epochs: float | None  # None when the pipeline repeats forever
    examples: int
    # the loss curve: at most 512 points, each the mean loss of `losses_every` steps (a
    # power of two; the last point may cover fewer); every step's loss is in --metrics
    losses: list[float]
    losses_every: int
    first_loss: float | None
    final_loss: float | None
    metrics: dict[str, Any]
    throughput: dict[str, float]
    phases_s: dict[str, float]
    per_replica: list[dict[str, Any]]
    replica_balance: dict[str, Any]
    params_sha256: str | None  # None: a ps job's other worker (the chief's is the job's)
    strategy: dict[str, Any]
    checkpoint: dict[str, Any]
    signal: str | None = None  # "SIGINT" or "SIGTERM" when interrupted by one
    # the evaluations during training (``train.eval_every``): {"step", "eval_loss", ...};
    # at most 512, every `evaluations_every`-th (each is also a --metrics line)
    evaluations: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    evaluations_every: int = 1
    # ``train.early_stopping`` ended the run: {"step", "metric", "best", "best_step"}
    early_stopped: dict[str, Any] | None = None
