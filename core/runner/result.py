"""The :class:`~csrun.core.runner.events.RunResult` of a finished session: what it
trained, the reduced loss and metrics, throughput, per-replica shares, where its
checkpoints are, and ``params_sha256``."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .digests import params_sha256
from .events import Evaluated, RunResult
from .models import resolve_loss
from .tally import loss_fn_metrics

__all__ = ["run_result"]


def run_result(session: Any, status: str, evaluated: Evaluated | None,
               exported: str | None) -> RunResult:
    """The result of a :class:`~csrun.core.runner.session.Session` ended with ``status``
    (before its role's part of the job ends)."""
    state, checkpoints = session.state, session.checkpoints
    return RunResult(
        status=status, steps=state.step, total_steps=session.total_steps,
        epochs=state.step / session.steps_per_epoch if session.steps_per_epoch else None,
        examples=state.totals.examples, losses=state.curve.points(),
        losses_every=state.curve.every, first_loss=state.first_loss,
        final_loss=state.last_loss,
        metrics=_metrics(session, evaluated), throughput=_throughput(session),
        phases_s=state.session.mean_phases(), per_replica=_per_replica(session),
        replica_balance=_balance(session),
        # a ps job's other workers do not read every table whole for a digest that is
        # not the job's (the chief's is)
        params_sha256=params_sha256(session.model) if session.role.is_chief else None,
        strategy={"compute_devices": session.devices, "replicas": session.replicas,
                  "parameter_device":
                      session.strategy.extended.parameter_device.short_name,
                  "distribute": session.config.dataset.distribute},
        checkpoint={"dir": session.config.checkpoint.dir, "last": checkpoints.saved_path,
                    "last_step": checkpoints.saved_step,
                    "resumed_from_step": checkpoints.resumed_from,
                    **session.evaluator.best_checkpoint(checkpoints.best_path),
                    "export": exported},
        evaluations=list(session.evaluator.evaluations.records),
        evaluations_every=session.evaluator.evaluations.stride,
        early_stopped=session.evaluator.early_stopped)


def _metrics(session: Any, evaluated: Evaluated | None) -> dict[str, Any]:
    log, model = session.state.last_log, session.config.model
    metrics: dict[str, Any] = {
        "loss": model.loss if model.loss != "auto" else resolve_loss(model, session.data.task),
        "train_loss": log.loss if log else None,
        "train_accuracy": log.accuracy if log else None}
    if evaluated is not None:
        metrics.update(eval_loss=evaluated.loss, eval_accuracy=evaluated.accuracy,
                       eval_examples=evaluated.examples)
    metrics.update(loss_fn_metrics(session.state.totals, session.evaluator.metrics))
    return metrics


def _throughput(session: Any) -> dict[str, float]:
    mine = session.state.session
    seconds = max(session.seconds, 1e-9)
    return {"examples_per_s": mine.examples / seconds, "steps_per_s": mine.steps / seconds,
            "wall_s": session.seconds, "steps_this_session": mine.steps}


def _per_replica(session: Any) -> list[dict[str, Any]]:
    totals = session.state.totals
    total = max(totals.examples, 1)
    return [dict(stats.to_dict(), examples_share=stats.examples / total,
                 loss=stats.loss if math.isfinite(stats.loss) else None)
            for stats in totals.replica_stats(session.devices)]


def _balance(session: Any) -> dict[str, Any]:
    """How evenly the replicas shared the work (1.0: perfectly even)."""
    mine = session.state.session
    times = [s / max(mine.steps, 1) for s in mine.replica_seconds]
    examples = session.state.totals.replica_examples
    return {"step_time_max_over_min": max(times) / min(times) if min(times) > 0 else None,
            "slowest_replica": int(np.argmax(times)) if times else None,
            "examples_max_over_min": max(examples) / min(examples) if min(examples) > 0
            else None}
