"""The training run of a config: distribute -> run -> reduce, with checkpoints.

Uses only csrun's public strategy API, as a user script would::

    with strategy.scope():
        model, optimizer = ...                              # central parameters
    for batch in strategy.experimental_distribute_dataset(loader):   # distribute
        optimizer.zero_grad(set_to_none=True)
        out = strategy.run(step_fn, args=(batch,))          # run: grads summed centrally
        optimizer.step()                                    # update, once, centrally
        totals = strategy.reduce("SUM", out, axis=None)     # reduce

The :class:`Session` is the loop; its parts do the rest (torchtitan's habit): the state
(:mod:`.state`), the batches of each pass (:mod:`.batches`), a replica's step
(:mod:`.replica_step`), evaluation (:mod:`.evaluation`), checkpoints
(:mod:`.checkpointing`, whose payload is the parts' ``state_dict``), the result
(:mod:`.result`), and this process's :class:`~csrun.core.runner.roles.Role` in the job.

The runner never prints: it reports :mod:`csrun.core.runner.events` to ``emit`` and returns
a :class:`~csrun.core.runner.events.RunResult`. :mod:`csrun.core.runner.train` picks the
role and is the entry to use::

    result = train(load_config("configs/quickstart.yaml"), on_event=print)
    print(result.params_sha256)
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Any, Callable, Sequence

import torch

from ..config.schema import RunConfig
from ..data.pipeline import Pipeline, is_worker_death, worker_died
from ..data.sources import load_source, split_holdout
from . import replica_step
from .batches import PassBatches
from .checkpointing import Checkpointer, Entry
from .curve import Curve
from .divergence import WINDOWS, diverged
from .errors import RunError
from .evaluation import EvalParts, Evaluator
from .events import Notice, RunResult, RunStarted, StepDone
from .export import export_final
from .failures import located
from .metrics import MetricSinks
from .models import build_model, count_parameters
from .objectives import make_objective
from .optimizers import build_optimizer, table_parameters, unmatched_groups
from .plots import write_plot
from .precision import Precision
from .result import run_result
from .rng import GlobalGenerators, seed_everything
from .roles import LocalRole, Role
from .schedules import ScheduleSteps, build_schedule, schedule_interval
from .state import TrainState, position_at
from .step_losses import StepLosses, check_finite

__all__ = ["Outputs", "Session", "run_session"]


@dataclasses.dataclass
class Outputs:
    """Optional files a run writes besides checkpoints.

    Attributes:
      metrics: JSON-lines file; one record per step is appended.
      plot: image of the loss curve and per-replica step times (needs matplotlib).
      tensorboard: directory of TensorBoard event files (needs tensorboard).
      result: where the caller writes the result (``--json``); only checked here.
    """

    metrics: str | None = None
    plot: str | None = None
    tensorboard: str | None = None
    result: str | None = None


def run_session(session: "Session", resume: bool, stop: threading.Event) -> RunResult:
    """Restore (with ``resume``), train until done or ``stop``, and assemble the result."""
    try:
        if resume:
            session.restore()
        session.fit(stop)
        return session.finish("interrupted" if stop.is_set() else "completed", stop)
    except RuntimeError as exc:  # torch's SIGCHLD handler raises it anywhere
        if is_worker_death(exc):
            raise worker_died(exc, session.pipeline.loaded()) from None
        raise
    finally:
        session.close()


class Session:
    """One training run of a config in this process: the strategy, model, data and the
    loop; ``role`` (default: a :class:`LocalRole`) is this process's part in the job."""

    def __init__(self, config: RunConfig, outputs: Outputs, emit: Callable[[Any], None],
                 role: Role | None = None):
        self.config, self.outputs, self.emit = config, outputs, emit
        seed_everything(config.train.seed)  # before the model: initial weights follow it
        self.data = load_source(config.dataset.source)
        train_indices, holdout = split_holdout(len(self.data), config.dataset.holdout,
                                               config.train.seed)
        self.pipeline = Pipeline(config.dataset, self.data, train_indices, config.train.seed)
        self.role = role or LocalRole(config)
        self.strategy = self.role.strategy
        self.replicas = self.strategy.num_replicas_in_sync
        self.devices = [name.rsplit("device:", 1)[-1]  # /job:.../device:CPU:1 -> CPU:1
                        for name in self.strategy.extended.worker_devices]
        self.objective = make_objective(config.model, self.data.task)
        self._build_model()
        self.precision = Precision(config.train.precision,
                                   self.strategy.extended.parameter_device.torch_device)
        forward = replica_step.compiled(self.model) if config.train.compile else self.model
        self.replica_step = replica_step.ReplicaStep(self.objective, self.precision, forward)
        self.batches = PassBatches(config.dataset, self.pipeline, self.strategy,
                                   self.devices, self.role.sliced)
        batches = self.batches.steps_per_epoch()  # of this worker's share, in a ps job
        self.steps_per_epoch = batches and -(-batches // config.train.accumulate_steps)
        self.total_steps = config.train.steps or config.train.epochs * self.steps_per_epoch
        self.checkpoints = Checkpointer(config, self.replicas, self.role.is_chief, emit)
        self.sinks = MetricSinks(outputs.metrics, outputs.tensorboard)
        self.state = TrainState(self.replicas, recent=WINDOWS * config.train.log_every)
        # a --metrics record or a schedule stepped on each step's loss reads each step
        self.losses = StepLosses(self.sinks.active or self.schedule_steps.reads_step_loss)
        self.evaluator = Evaluator(config, EvalParts(
            self.strategy, self.role, self.pipeline, self.objective, self.precision,
            self.model, forward, emit, self.devices), holdout)
        self.seconds = 0.0  # this process's time in fit
        self.step_times = [Curve() for _ in range(self.replicas)]  # this process's (--plot)

    def _build_model(self) -> None:
        config = self.config
        with self.strategy.scope():  # parameters and optimizer state live centrally
            self.model = build_model(config.model, self.data.feature_shape, self.data.outputs)
            self.optimizer = build_optimizer(config.optimizer, self.model.named_parameters(),
                                             table_parameters(self.model))
            self.schedule = build_schedule(config.optimizer.schedule, self.optimizer)
        self.schedule_steps = ScheduleSteps(self.schedule,
                                            schedule_interval(config.optimizer.schedule),
                                            evaluates=bool(config.train.eval_every))
        unmatched = unmatched_groups(config.optimizer,
                                     (n for n, _ in self.model.named_parameters()))
        if unmatched:
            self.emit(Notice(f"optimizer.param_groups: no parameter name matches "
                             f"{', '.join(map(repr, unmatched))}; those groups are empty"))

    def close(self) -> None:
        self.sinks.close()
        self.checkpoints.close()

    # -- checkpoints: the parts, in the order they are restored ----------------------------
    def _parts(self) -> list:
        return [self.role, Entry("model", self.role.checkpointed(self.model)),
                Entry("optimizer", self.optimizer),
                Entry("schedule", self.schedule), self.state, self.evaluator,
                Entry("scaler", self.precision, required=False),
                Entry("rng", GlobalGenerators())]

    def save(self, again: bool = False) -> None:
        self._read_losses()  # the state saved holds every step's loss (none is NaN)
        self.checkpoints.save(self.state.step, self._parts(), again)

    def restore(self) -> None:
        """Continue from the newest checkpoint (model, optimizer, schedule, RNG, data)."""
        if self.checkpoints.restore(self._parts()) is None:
            return
        self.checkpoints.keep_best(self.evaluator.best_step)  # the rotation keeps it
        state = self.state
        self.emit(Notice(f"resumed from step {state.step} (epoch {state.epoch}, batch "
                         f"{state.position}) of {self.checkpoints.saved_path}"))
        stopped = self.evaluator.early_stopped
        if stopped:
            self.emit(Notice(f"the run stopped early at step {stopped['step']} "
                             f"({stopped['metric']} did not improve): nothing to train "
                             "(raise train.early_stopping.patience to go on)"))
        if state.step == self.total_steps:
            self.emit(Notice(f"the checkpoint's run is complete (step {state.step} of "
                             f"{self.total_steps}): nothing to train (raise train.steps or "
                             "epochs to go on)"))
        if state.step > self.total_steps:  # train.steps was lowered since
            self.emit(Notice(f"the checkpoint's step {state.step} is past the "
                             f"{self.total_steps} steps configured: nothing to train "
                             "(raise train.steps or epochs to go on)"))
            self.total_steps = state.step  # the run ends there, not at "300/200"

    def checkpoint_note(self) -> str:
        """What a failure leaves behind: the last checkpoint, intact, or none."""
        return self.checkpoints.note()

    # -- the loop --------------------------------------------------------------------------
    def fit(self, stop: threading.Event) -> None:
        """Train until ``total_steps`` or until ``stop`` is set; save at the end."""
        state = self.state
        here = {"step": state.step, "epoch": state.epoch, "position": state.position}
        start = self._start(self.role.begin(here, self.optimizer))
        state.step, state.epoch, state.position = (int(start[k]) for k in here)
        if state.step != here["step"]:
            self.checkpoints.resumed_from = state.step
        self.emit(self._started())
        begin = time.perf_counter()
        with self.strategy.scope():  # cross-replica context, as in TF
            while self._going(stop):
                start_position = state.position
                if not self._epoch(stop):
                    break
                if state.position == start_position == 0:
                    raise RunError(f"the pipeline yielded no step in epoch {state.epoch}")
                self._read_losses()  # the pass's mean loss
                self.schedule_steps.after_pass(state.end_pass())  # the pass ended
        self.seconds += time.perf_counter() - begin
        if stop.is_set():
            self.emit(Notice(f"interrupted after step {state.step}"))
        self.role.settle()
        self.save(again=self.role.unsaved())  # all the job's updates, in a ps job

    def _start(self, start: dict) -> dict:
        """Where the role says training starts; a restarted worker that hears only its
        step takes its place in its share from it (each worker's steps per epoch are
        those of its share)."""
        if "epoch" in start and "position" in start:
            return start
        epoch, position = position_at(int(start["step"]), self.steps_per_epoch,
                                      self.config.train.accumulate_steps)
        return {"step": start["step"], "epoch": epoch, "position": position}

    def _going(self, stop: threading.Event) -> bool:
        return self.state.step < self.total_steps and not stop.is_set() \
            and not self.evaluator.early_stopped

    def _epoch(self, stop: threading.Event) -> bool:
        """Run steps of the current pass; True when the pass ran out of batches. A step
        takes ``train.accumulate_steps`` batches (the pass's last one, those left)."""
        accumulate = self.config.train.accumulate_steps
        iterator = iter(self.batches.distributed(self.state.epoch, self.state.position))
        try:
            while self._going(stop):
                begin = time.perf_counter()
                batches = list(itertools.islice(iterator, accumulate))
                if batches:
                    self._train_step(batches, time.perf_counter() - begin)
                if len(batches) < accumulate:
                    return True
            return False
        finally:
            iterator.close()

    def _train_step(self, batches: list, distribute_s: float) -> None:
        """One optimizer step over ``batches`` (``train.accumulate_steps`` of them): each
        is run, the gradients add up centrally, then one update. The losses stay where
        they were computed until read (:mod:`.step_losses`): no wait for a GPU a step."""
        strategy = self.strategy
        examples = sum(self.batches.global_examples(replica_step.first_leaf(b))
                       for b in batches)
        replica_step.clear_grads(self.optimizer)
        scale = self.precision.loss_scale()
        t0 = time.perf_counter()
        try:
            outs = [strategy.run(self.replica_step, args=(b, examples, scale))
                    for b in batches]
        except Exception as exc:  # noqa: BLE001 - the user's model or loss: say where
            raise located(exc, f"step {self.state.step + 1}", self.objective, self.devices)
        t1 = time.perf_counter()
        per_replica, correct = replica_step.replica_numbers(
            [[c.stats for c in strategy.experimental_local_results(carried)]
             for _, carried in outs], self.objective)
        reduced = [strategy.reduce("SUM", losses, axis=None) for losses, _ in outs]
        t2 = time.perf_counter()
        self.losses.add(self.state.step + 1, [s.pop("losses") for s in per_replica],
                        reduced, sum(s["examples"] for s in per_replica))
        if self.losses.due():  # a loss on the CPU: checked before the update
            self._read_losses()
        grad_norm = self._update()
        t3 = time.perf_counter()
        self._record(per_replica, correct, {"distribute": distribute_s, "run": t1 - t0,
                                            "update": t3 - t2, "reduce": t2 - t1},
                     len(batches), grad_norm)

    def _read_losses(self) -> None:
        """Read the held steps' losses into the state (at a log, an evaluation, a save,
        a pass's end; each step where reading costs no wait); a non-finite one fails
        the run (before anything is saved)."""
        for read in self.losses.read():
            check_finite(read, self.state.step, self.devices, self.checkpoint_note)
            self.state.add_loss(read.loss, read.replicas)

    def _update(self) -> torch.Tensor | None:
        """Unscale (fp16), clip (``train.grad_clip_norm``), step, schedule; returns the
        gradient norm before clipping (None without clipping), unread: only a
        ``--metrics`` record reads it."""
        self.precision.unscale(self.optimizer)
        clip, norm = self.config.train.grad_clip_norm, None
        if clip is not None:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            norm = torch.nn.utils.clip_grad_norm_(params, clip)
        self.precision.step(self.optimizer)
        self.schedule_steps.after_update()
        return norm

    def _record(self, per_replica: Sequence[dict], correct: Any, phases: dict, batches: int,
                grad_norm: torch.Tensor | None = None) -> None:
        """After a step: the state, its record and events, a log, an evaluation and a
        checkpoint when they are due."""
        state, train = self.state, self.config.train
        state.record(per_replica, correct, phases, batches)
        due_log = state.step % train.log_every == 0 or state.step == self.total_steps
        due_eval = bool(train.eval_every) and state.step % train.eval_every == 0
        every = self.config.checkpoint.every_steps
        if due_log or due_eval or (every and state.step % every == 0):
            self._read_losses()  # what they report or save holds every step's loss
        loss = state.last_loss  # this step's where read each step, else the last read
        self.schedule_steps.after_step(loss)  # (it reads each step: StepLosses)
        seconds = [s["seconds"] for s in per_replica]
        if self.outputs.plot:
            for curve, replica_seconds in zip(self.step_times, seconds):
                curve.add(replica_seconds)
        if self.sinks.active:  # (the step's correct predictions are counted only then)
            self._write_record(per_replica, loss, seconds, phases, grad_norm)
        self.emit(StepDone(state.step, self.total_steps, loss))
        if due_log:
            self._log()
        if due_eval:
            # before a save at this step: it holds the new best
            best = self.evaluator.during(state.step, state.epoch, self.sinks)
            if self.evaluator.last is not None and self.evaluator.last.step == state.step:
                self.schedule_steps.after_evaluation(self.evaluator.last.loss)
            if best:
                self.checkpoints.keep_best(state.step)  # first: this save's pruning keeps it
                self.save()
        if every and state.step % every == 0:
            self.save()

    def _write_record(self, per_replica: Sequence[dict], loss: float | None, seconds: list,
                      phases: dict, grad_norm: torch.Tensor | None) -> None:
        """The step's ``--metrics`` / TensorBoard record."""
        examples = sum(s["examples"] for s in per_replica)
        correct = self.state.count_correct()
        record = {"step": self.state.step, "epoch": self.state.epoch, "loss": loss,
                  "accuracy": correct / examples if self.objective.classify else None,
                  "examples": examples, "learning_rate": self._lr(),
                  "step_time_s": seconds, "phases_s": phases}
        if grad_norm is not None:
            record["grad_norm"] = float(grad_norm)  # before clipping
        self.sinks.write(record)

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _log(self) -> None:
        """The log window's :class:`StepLog`; a loss that ran away yet stayed finite
        fails the run (:mod:`.divergence`)."""
        state, train = self.state, self.config.train
        self.emit(state.log(self.total_steps, self._lr(), self.devices,
                            self.objective.classify))
        self.role.logged()
        why = diverged(list(state.recent), train.log_every, train.divergence,
                       last=state.step == self.total_steps, first=state.first_loss,
                       steps=state.step)
        if why:
            raise RunError(why)

    def _started(self) -> RunStarted:
        return RunStarted(
            compute_devices=self.devices, parameter_device=self.role.parameter_device,
            model=f"{self.config.model.kind} ({type(self.model).__name__})",
            parameters=count_parameters(self.model), dataset=self.data.name,
            train_examples=len(self.pipeline.indices),
            holdout_examples=len(self.evaluator.holdout),
            global_batch_size=self.pipeline.batch_size,
            distribute=self.config.dataset.distribute, total_steps=self.total_steps,
            steps_per_epoch=self.steps_per_epoch, start_step=self.state.step,
            seed=self.config.train.seed)

    # -- the end ---------------------------------------------------------------------------
    def finish(self, status: str, stop: threading.Event | None = None) -> RunResult:
        """Evaluate (unless interrupted), export, write the plot, and assemble the result;
        the role's part of the job ends here. A ``stop`` during the final evaluation
        interrupts the run there (its last checkpoint is saved already)."""
        completed = status == "completed"
        evaluated = self.evaluator.final(self.state.step, stop) if completed else None
        if completed and stop is not None and stop.is_set():
            status, completed, evaluated = "interrupted", False, None
            self.emit(Notice(f"interrupted during the final evaluation, after step "
                             f"{self.state.step}"))
        exported = export_final(self.config, self.model, self.role.is_chief, self.emit,
                                self.checkpoint_note) if completed else None
        if self.outputs.plot:
            first = (self.checkpoints.resumed_from or 0) + 1
            write_plot(self.outputs.plot, self.state.curve, self.step_times, self.devices,
                       first)
        return self.role.end(run_result(self, status, evaluated, exported), self.model)
