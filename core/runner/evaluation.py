"""Evaluation on the held-out examples (``dataset.holdout``): at the end of a run, and
every ``train.eval_every`` steps, where it feeds early stopping
(``train.early_stopping``) and the best checkpoint (``checkpoint.keep_best``).

The chief evaluates; a central-storage run distributes the held-out batches like the
training ones, a parameter-server chief evaluates them on its own copy of the final
values. What was evaluated and the watches' bests are checkpointed, so that a resumed run
stops, and keeps the best, as an uninterrupted one does.

Example::

    evaluator = Evaluator(config, parts, holdout)
    new_best = evaluator.during(step, epoch, sinks)    # True: save the best checkpoint
    final = evaluator.final(step)                       # an Evaluated, or None
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Iterator, Sequence

import torch

from ..config.schema import RunConfig
from .errors import RunError
from .curve import Thinned
from .events import Evaluated, Notice
from .failures import located
from .improvement import MetricWatch
from .metrics import MetricSinks
from .replica_step import device_type
from .signals import Interrupted, interrupting
from .tally import add_metrics

__all__ = ["Evaluator", "EvalParts", "abandoned"]

_POLL_S = 0.5  # the main thread's wait for the final evaluation, in slices
_ABANDONED: list[threading.Thread] = []  # final evaluations a signal let go


def abandoned() -> bool:
    """Whether a final evaluation that a signal let go still runs (the CLI then exits
    without waiting for it: it is in user code or in torch's C)."""
    _ABANDONED[:] = [t for t in _ABANDONED if t.is_alive()]
    return bool(_ABANDONED)


@dataclasses.dataclass
class EvalParts:
    """What evaluating needs of the session: where, what and how it computes."""

    strategy: Any
    role: Any
    pipeline: Any
    objective: Any
    precision: Any
    model: torch.nn.Module
    forward_model: torch.nn.Module  # the compiled model, or ``model``
    emit: Callable[[Any], None]
    devices: Sequence[str]          # each replica's, to name one that failed


class Evaluator:
    """Evaluates ``holdout`` (indices into the data) and keeps what was evaluated."""

    def __init__(self, config: RunConfig, parts: EvalParts, holdout: Sequence[int]):
        self.config, self.parts, self.holdout = config, parts, holdout
        self.metrics: dict[str, float] = {}  # a loss function's, on the holdout
        self.evaluations = Thinned()  # train.eval_every's, in step order (bounded)
        self.last: Evaluated | None = None
        self.early_stopped: dict[str, Any] | None = None
        stopping, best = config.train.early_stopping, config.checkpoint.keep_best
        self.stopper = stopping and MetricWatch(stopping.metric, stopping.mode,
                                                stopping.min_delta)
        self.best = best and MetricWatch(best.metric, best.mode)

    def evaluate(self, step: int, stop: threading.Event | None = None) -> Evaluated | None:
        """Loss and accuracy on the held-out examples after ``step`` (the chief's to
        compute); None when ``stop`` is set before it ends (a signal: it is let go)."""
        parts = self.parts
        if not parts.role.is_chief or len(self.holdout) == 0:
            return None
        loader = parts.pipeline.eval_loader(self.holdout, parts.pipeline.batch_size)
        # a sliced role's strategy would feed this process only its slice: go around it
        batches = self._here(loader) if parts.role.sliced else self._distributed(loader)
        totals = {"loss": 0.0, "examples": 0, "correct": 0}
        parts.model.eval()
        try:
            for stats in batches:
                if stop is not None and stop.is_set():
                    return None
                for key in ("loss", "examples", "correct"):
                    totals[key] += float(stats[key])  # a tensor, or the count's int
                add_metrics(totals, stats)
        except Exception as exc:  # noqa: BLE001 - the user's model or loss: say where
            raise located(exc, f"the evaluation after step {step}", parts.objective,
                          parts.devices)
        finally:
            parts.model.train()
        examples = int(totals["examples"])
        self.metrics = {name: value / examples
                        for name, value in totals.get("metrics", {}).items()}
        return Evaluated(examples, totals["loss"] / examples,
                         totals["correct"] / examples if parts.objective.classify else None)

    def _distributed(self, loader) -> Iterator[dict[str, torch.Tensor]]:
        """Each held-out batch's stats, distributed like training, summed over replicas."""
        strategy, objective, precision = self.parts.strategy, self.parts.objective, \
            self.parts.precision
        model = self.parts.forward_model

        def eval_step(batch):
            # grad mode and autocast are per thread: set them in the replica
            with torch.no_grad(), precision.autocast(device_type(batch)):
                stats = objective.tally(objective.stats(model, batch))
            for key in ("examples", "correct"):  # Python numbers: reduced with the rest
                stats[key] = torch.as_tensor(stats[key])
            return stats

        with strategy.scope():
            for batch in strategy.experimental_distribute_dataset(loader):
                yield strategy.reduce("SUM", strategy.run(eval_step, (batch,)), axis=None)

    def _here(self, loader) -> Iterator[dict[str, torch.Tensor]]:
        """Each held-out batch's stats, on this process's copy of the parameters."""
        objective, model = self.parts.objective, self.parts.forward_model
        with torch.no_grad():
            for batch in loader:
                with self.parts.precision.autocast(device_type(batch)):
                    yield objective.tally(objective.stats(model, batch))

    def during(self, step: int, epoch: int, sinks: MetricSinks) -> bool:
        """``train.eval_every``: evaluate, report (event, ``--metrics`` line, result), and
        feed early stopping; True when the best checkpoint's metric improved (the caller
        saves that checkpoint)."""
        evaluated = self.evaluate(step)
        if evaluated is None:
            return False
        evaluated.step, self.last = step, evaluated
        record = {"step": step, **self._record(evaluated)}
        self.evaluations.add(record)
        sinks.write({"step": step, "epoch": epoch, "eval": record})
        self.parts.emit(evaluated)
        improved = self.best is not None and \
            self.best.update(step, self._watched(self.best, record))
        if self.stopper is not None:
            self._watch_for_stop(step, record)
        return improved

    def _watch_for_stop(self, step: int, record: dict[str, Any]) -> None:
        stopper = self.stopper
        stopper.update(step, self._watched(stopper, record))
        if stopper.bad >= self.config.train.early_stopping.patience:
            self.early_stopped = {"step": step, "metric": stopper.metric,
                                  "best": stopper.best, "best_step": stopper.best_step}
            self.parts.emit(Notice(
                f"early stopping at step {step}: {stopper.metric} has not improved for "
                f"{stopper.bad} evaluations (best {stopper.best:.6g} at step "
                f"{stopper.best_step})"))

    def final(self, step: int, stop: threading.Event | None = None) -> Evaluated | None:
        """The evaluation at the end of a completed run (reported as an event unless this
        very step was evaluated already: the same numbers). Unlike those during training,
        which a resumed run could not redo, it stops when ``stop`` is set, and a Ctrl-C or
        SIGTERM interrupts it at once, mid-batch (:func:`~.signals.interrupting`): the
        step's checkpoint is written before it."""
        last = self.last
        if last is not None and last.step == step:
            return last
        evaluated = self._interruptible(step, stop)
        if evaluated is not None:
            self.parts.emit(evaluated)
        return evaluated

    def _interruptible(self, step: int, stop: threading.Event | None) -> Evaluated | None:
        """:meth:`evaluate` on a thread of its own, waited for in the main thread, where a
        signal interrupts the wait at once (:func:`~.signals.interrupting`): a replica
        may be deep in C (an OpenMP team) or in a slow batch, where no handler runs. An
        interrupted evaluation is let go: it ends at its next batch (``stop`` is set) and
        :func:`abandoned` tells the CLI not to wait for it at exit."""
        if stop is None or threading.current_thread() is not threading.main_thread():
            return self.evaluate(step, stop)
        box: dict[str, Any] = {}

        def work():
            try:
                box["value"] = self.evaluate(step, stop)
            except BaseException as exc:  # noqa: BLE001 - raised again in the caller
                box["error"] = exc
        worker = threading.Thread(target=work, name="csrun-final-evaluation", daemon=True)
        worker.start()
        try:
            with interrupting():
                while worker.is_alive():
                    worker.join(_POLL_S)
        except Interrupted:
            _ABANDONED.append(worker)
            return None
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _record(self, evaluated: Evaluated) -> dict[str, Any]:
        record = {"eval_loss": evaluated.loss, "eval_examples": evaluated.examples}
        if evaluated.accuracy is not None:
            record["eval_accuracy"] = evaluated.accuracy
        record |= {f"eval_{name}": value for name, value in self.metrics.items()
                   if name != "accuracy"}
        return record

    @staticmethod
    def _watched(watch: MetricWatch, record: dict[str, Any]) -> float:
        if watch.metric not in record:
            known = ", ".join(k for k in record if k not in ("step", "eval_examples"))
            raise RunError(f"{watch.metric!r} is not an evaluated metric of this run; "
                           f"evaluations report: {known}")
        return float(record[watch.metric])

    @property
    def best_step(self) -> int | None:
        return self.best.best_step if self.best is not None else None

    def best_checkpoint(self, path_of: Callable[[int], str | None]) -> dict[str, Any]:
        """The result's ``checkpoint.best`` entries (none without a best yet)."""
        path = path_of(self.best_step) if self.best_step is not None else None
        if path is None:
            return {}
        return {"best": path, "best_step": self.best_step,
                "best_metric": {self.best.metric: self.best.best}}

    def state_dict(self) -> dict:
        return {"evaluations": self.evaluations.state_dict(),
                "watches": {"stopper": self.stopper and self.stopper.state(),
                            "best": self.best and self.best.state()},
                "early_stopped": self.early_stopped}

    def load_state_dict(self, payload: dict) -> None:
        self.evaluations = Thinned()
        evaluations = payload.get("evaluations", [])
        if isinstance(evaluations, list):  # an older checkpoint: every evaluation
            for record in evaluations:
                self.evaluations.add(record)
        else:
            self.evaluations.load_state_dict(evaluations)
        watches = payload.get("watches", {})
        for name in ("stopper", "best"):
            if getattr(self, name) is not None:
                getattr(self, name).load(watches.get(name))
        self.early_stopped = self._stopped(payload.get("early_stopped"), payload["step"])

    def _stopped(self, saved: dict | None, step: int) -> dict | None:
        """Whether the checkpointed run had stopped early, by today's ``patience``: a
        run resumed with a larger one trains on."""
        stopper = self.stopper
        if stopper is None or stopper.bad < self.config.train.early_stopping.patience:
            return None
        return saved or {"step": step, "metric": stopper.metric, "best": stopper.best,
                         "best_step": stopper.best_step}  # (older checkpoints lack it)
