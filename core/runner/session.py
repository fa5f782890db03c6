"""The training run of a config: distribute -> run -> reduce, with checkpoints.

Uses only csrun's public strategy API, as a user script would::

    with strategy.scope():
        model, optimizer = ...                              # central parameters
    for batch in strategy.experimental_distribute_dataset(loader):   # distribute
        optimizer.zero_grad(set_to_none=True)
        out = strategy.run(step_fn, args=(batch,))          # run: grads summed centrally
        optimizer.step()                                    # update, once, centrally
        totals = strategy.reduce("SUM", out, axis=None)     # reduce

``step_fn`` divides each replica's summed loss by the *global* batch size, so the summed
gradients are those of the global-batch mean, whatever the replica count.

The runner never prints: it reports :mod:`csrun.core.runner.events` to ``on_event`` and returns a
:class:`~csrun.core.runner.events.RunResult`.

Where a process's part in the job matters (a parameter-server worker's, vs. a
central-storage run's), the Session asks its :class:`Role`; :mod:`csrun.core.runner.train`
picks the role and is the entry to use::

    result = train(load_config("configs/quickstart.yaml"), on_event=print)
    print(result.params_sha256)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import pathlib
import random
import signal
import threading
import time
from typing import Any, Callable, Iterator, Protocol, Sequence

import numpy as np
import torch

from ..distribute import CentralStorageStrategy, InputOptions, InputReplicationMode, StrategyOptions
from .checkpoint import CheckpointError, CheckpointManager
from ..config.schema import RunConfig
from ..data.pipeline import Pipeline
from ..data.sources import load_source, split_holdout
from .digests import file_sha256, params_sha256
from .divergence import diverged
from .events import (CheckpointSaved, Evaluated, Notice, ReplicaStats, RunResult, RunStarted,
                     StepDone, StepLog)
from .metrics import MetricSinks
from .models import build_model, count_parameters, resolve_loss
from .objectives import PendingCorrect, make_objective
from .export import export_safetensors
from .improvement import MetricWatch
from .optimizers import build_optimizer, unmatched_groups
from .precision import Precision
from .schedules import build_schedule, schedule_interval
from .plots import write_plot

__all__ = ["RunError", "NonFiniteLoss", "Outputs", "Role", "LocalRole", "Session",
           "run_session", "stop_on_signals", "Aborted"]

PHASES = ("distribute", "run", "update", "reduce")


class RunError(RuntimeError):
    """A run that failed for a reason the user can act on (exit code 1)."""


class Aborted(KeyboardInterrupt):
    """A second Ctrl-C or SIGTERM while training: stop at once, without saving (a
    first one outside training is a plain KeyboardInterrupt)."""


class NonFiniteLoss(RunError):
    """A replica's loss became NaN or infinite; the run stopped before the update."""


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
        return session.finish("interrupted" if stop.is_set() else "completed")
    finally:
        session.close()


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event, received: list):
    """While training, the first Ctrl-C or SIGTERM (a scheduler's preemption) asks for a
    clean stop, which saves a checkpoint; a second one aborts. ``received`` gets the
    signals' names."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        received.append(signal.Signals(signum).name)
        if stop.is_set():
            raise Aborted
        stop.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy and Python's random."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def _short(device_name: str) -> str:
    """``/job:localhost/replica:0/task:0/device:CPU:1`` -> ``CPU:1``."""
    return device_name.rsplit("device:", 1)[-1]


def _identity(config: RunConfig, replicas: int) -> dict[str, Any]:
    """What must match to resume bit-for-bit, flattened to dotted keys."""
    dump = config.model_dump(mode="json")
    dataset = {k: v for k, v in dump["dataset"].items() if k not in ("workers", "pin_memory")}
    flat: dict[str, Any] = {"train.seed": dump["train"]["seed"], "strategy.replicas": replicas}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, list) and value:
            for i, item in enumerate(value):
                walk(f"{prefix}.{i}", item)
        else:
            flat[prefix] = value

    for name, section in (("model", dump["model"]), ("optimizer", dump["optimizer"]),
                          ("dataset", dataset)):
        walk(name, section)
    return _with_data_digest(flat, config)


def _with_data_digest(flat: dict[str, Any], config: RunConfig) -> dict[str, Any]:
    """A data file is identified by its contents, not its path: a file changed in place
    must not resume silently, a moved one may."""
    path = flat.pop("dataset.source.path", None)
    if path is not None:
        flat["dataset.source.path.sha256"] = file_sha256(path)
    return flat


def _rng_state() -> dict:
    numpy_state = np.random.get_state(legacy=False)
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"key": torch.from_numpy(numpy_state["state"]["key"].astype(np.int64)),
                       "pos": int(numpy_state["state"]["pos"]),
                       "has_gauss": int(numpy_state["has_gauss"]),
                       "gauss": float(numpy_state["gauss"])}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    numpy_state = state["numpy"]
    np.random.set_state({"bit_generator": "MT19937",
                         "state": {"key": numpy_state["key"].numpy().astype(np.uint32),
                                   "pos": numpy_state["pos"]},
                         "has_gauss": numpy_state["has_gauss"], "gauss": numpy_state["gauss"]})
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _Tally:
    """Sums over a span of steps: overall and per replica (checkpointed, so a resumed run
    reports what an uninterrupted one does)."""

    def __init__(self, replicas: int):
        self.steps = self.examples = self.correct = 0
        self.loss = 0.0
        self.replica_examples = [0] * replicas
        self.replica_loss = [0.0] * replicas
        self.replica_seconds = [0.0] * replicas
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.metrics: dict[str, float] = {}  # sums of a loss function's metrics

    def add(self, per_replica: Sequence[dict], phases: dict[str, float]) -> None:
        """A step's numbers; its correct predictions come later (``_count_correct``)."""
        self.steps += 1
        for r, stats in enumerate(per_replica):  # Python numbers (_replica_numbers)
            _add_metrics(vars(self), stats)
            examples, loss = stats["examples"], stats["loss"]
            self.examples += examples
            self.loss += loss
            self.replica_examples[r] += examples
            self.replica_loss[r] += loss
            self.replica_seconds[r] += stats["seconds"]
        for name, seconds in phases.items():
            self.phases[name] += seconds

    def replica_stats(self, devices: Sequence[str]) -> list[ReplicaStats]:
        steps = max(self.steps, 1)
        return [ReplicaStats(r, device, n, self.replica_loss[r] / n if n else math.nan,
                             self.replica_seconds[r] / steps)
                for r, (device, n) in enumerate(zip(devices, self.replica_examples))]

    def mean_phases(self) -> dict[str, float]:
        return {name: total / max(self.steps, 1) for name, total in self.phases.items()}

    def state(self) -> dict:
        return dict(vars(self))

    def load(self, state: dict) -> None:
        vars(self).update(state)


class Role(Protocol):
    """This process's part in the job, asked by its :class:`Session` at the points where
    the parts differ, and only there: the whole job (:class:`LocalRole`, a central-storage
    run) or one worker of a parameter-server job (``ClusterRole`` in
    :mod:`csrun.core.runner.cluster_role`)."""

    strategy: Any          # the strategy the session trains with
    is_chief: bool         # writes and restores the checkpoints, evaluates the holdout
    sliced: bool           # the strategy feeds this process only its slice of a global batch
    parameter_device: str  # where the parameters live, as RunStarted names it

    def checkpoint_state(self) -> dict:
        """Entries to add to a checkpoint being written."""

    def load_checkpoint_state(self, payload: dict) -> None:
        """Take them from a checkpoint being restored (ValueError: it has none)."""

    def begin(self, where: dict, optimizer: torch.optim.Optimizer) -> dict:
        """Before the first step: where training starts, from this process's ``where``
        (``step``, ``epoch``, ``position``)."""

    def logged(self) -> None:
        """After each :class:`StepLog`."""

    def settle(self) -> None:
        """After the last step, before the last checkpoint."""

    def end(self, result: RunResult, model: torch.nn.Module) -> RunResult:
        """The result to report; this process's part of the job is over."""


class LocalRole:
    """The whole job in this process: the config's CentralStorageStrategy, its own chief;
    nothing to agree on with anyone (see :class:`Role`)."""

    is_chief, sliced = True, False

    def __init__(self, config: RunConfig):
        s = config.strategy
        self.strategy = CentralStorageStrategy(
            s.compute_devices, s.parameter_device,
            options=StrategyOptions(copy_parameters=s.copy_parameters, execution=s.execution))
        self.parameter_device = self.strategy.extended.parameter_device.short_name

    def checkpoint_state(self) -> dict:
        return {}

    def load_checkpoint_state(self, payload: dict) -> None:
        pass

    def begin(self, where: dict, optimizer: torch.optim.Optimizer) -> dict:
        return where

    def logged(self) -> None:
        pass

    def settle(self) -> None:
        pass

    def end(self, result: RunResult, model: torch.nn.Module) -> RunResult:
        return result


class Session:
    """One training run of a config in this process: the strategy, model, data and the
    loop's state; ``role`` (default: a :class:`LocalRole`) is this process's part in the
    job."""

    def __init__(self, config: RunConfig, outputs: Outputs, emit: Callable[[Any], None],
                 role: Role | None = None):
        self.config, self.outputs, self.emit = config, outputs, emit
        seed = config.train.seed
        seed_everything(seed)  # before the model: initial weights follow the seed
        self.data = load_source(config.dataset.source)
        train_indices, self.holdout = split_holdout(len(self.data), config.dataset.holdout, seed)
        self.pipeline = Pipeline(config.dataset, self.data, train_indices, seed)
        self.role = role or LocalRole(config)
        self.strategy = self.role.strategy
        self.replicas = self.strategy.num_replicas_in_sync
        self.devices = [_short(name) for name in self.strategy.extended.worker_devices]
        self.objective = make_objective(config.model, self.data.task)
        with self.strategy.scope():  # parameters and optimizer state live centrally
            self.model = build_model(config.model, self.data.feature_shape, self.data.outputs)
            self.optimizer = build_optimizer(config.optimizer, self.model.named_parameters())
            self.schedule = build_schedule(config.optimizer.schedule, self.optimizer)
        self._check_groups()
        self.interval = schedule_interval(config.optimizer.schedule)
        self.precision = Precision(config.train.precision,
                                   self.strategy.extended.parameter_device.torch_device)
        self.forward_model = _compiled(self.model) if config.train.compile else self.model
        self.accumulate = config.train.accumulate_steps
        batches = self.pipeline.steps_per_epoch(self.replicas)  # an optimizer step takes
        self.steps_per_epoch = batches and -(-batches // self.accumulate)  # N of them
        self.total_steps = config.train.steps or config.train.epochs * self.steps_per_epoch
        self.manager = self._checkpoints()
        self.sinks = MetricSinks(outputs.metrics, outputs.tensorboard)
        self.pending_correct = PendingCorrect()  # counted into the tallies when read
        self.step = self.epoch = self.position = 0
        self.losses: list[float] = []
        self.totals, self.window = _Tally(self.replicas), _Tally(self.replicas)
        self.last_log: StepLog | None = None
        self.resumed_from: int | None = None
        self.saved_step: int | None = None
        self.saved_path: str | None = None
        self.session = _Tally(self.replicas)  # this process's steps only, for throughput
        self.session_seconds = 0.0
        self.step_times: list[list[float]] = []  # per step, per replica (for --plot)
        self._sizes: Iterator[int] = iter(())  # global batch sizes of the pass (sliced role)
        self.eval_metrics: dict[str, float] = {}  # a loss function's, on the holdout
        self.evaluations: list[dict[str, Any]] = []  # train.eval_every's, in step order
        self._last_eval: Evaluated | None = None
        self.early_stopped: dict[str, Any] | None = None
        stopping, best = config.train.early_stopping, config.checkpoint.keep_best
        self.stopper = stopping and MetricWatch(stopping.metric, stopping.mode,
                                                stopping.min_delta)
        self.best = best and MetricWatch(best.metric, best.mode)

    @property
    def classify(self) -> bool:
        """Whether there are correct predictions to count (accuracy)."""
        return self.objective.classify

    def close(self) -> None:
        self.sinks.close()
        if self.manager is not None:
            self.manager.release()

    def _check_groups(self) -> None:
        unmatched = unmatched_groups(self.config.optimizer,
                                     (n for n, _ in self.model.named_parameters()))
        if unmatched:
            self.emit(Notice(f"optimizer.param_groups: no parameter name matches "
                             f"{', '.join(map(repr, unmatched))}; those groups are empty"))

    def _checkpoints(self) -> CheckpointManager | None:
        """The checkpoint manager (None without ``checkpoint.dir``, or when they are the
        chief's), rid of what a crash mid-save left (the complete ones are untouched)."""
        if not self.config.checkpoint.dir or not self.role.is_chief:
            return None
        manager = CheckpointManager(self.config.checkpoint.dir, self.config.checkpoint.keep,
                                    _identity(self.config, self.replicas))
        manager.claim()  # one run per directory (exit 2 if another holds it)
        removed = manager.remove_incomplete()
        if removed:
            self.emit(Notice(f"removed {len(removed)} incomplete checkpoint file(s) left by "
                             f"an interrupted save: {', '.join(removed)}"))
        return manager

    # -- checkpoints -----------------------------------------------------------------------
    def _payload(self) -> dict:
        return {"step": self.step, "epoch": self.epoch, "position": self.position,
                "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "schedule": self.schedule.state_dict() if self.schedule else None,
                "rng": _rng_state(), "losses": torch.tensor(self.losses, dtype=torch.float64),
                "totals": self.totals.state(), "window": self.window.state(),
                "last_log": self.last_log.to_dict() if self.last_log else None,
                "evaluations": self.evaluations, "scaler": self.precision.state_dict(),
                "watches": {"stopper": self.stopper and self.stopper.state(),
                            "best": self.best and self.best.state()},
                **self.role.checkpoint_state()}

    def save(self) -> None:
        if self.manager is None or self.saved_step == self.step or self.step == 0:
            return
        if self.saved_step is None and self.resumed_from is None:
            # a run that starts over replaces the checkpoints of earlier runs, so that
            # --resume never picks an older run's newer step
            removed = self.manager.clear()
            if removed:
                self.emit(Notice(f"started over (no --resume): replaced {removed} "
                                 f"checkpoint(s) of an earlier run in "
                                 f"{str(self.manager.directory)!r}"))
        self._count_correct()  # the tallies are saved
        path = self.manager.save(self.step, self._payload())
        self.saved_step, self.saved_path = self.step, str(path)
        self.emit(CheckpointSaved(self.step, str(path)))

    def restore(self) -> None:
        """Continue from the newest checkpoint (model, optimizer, schedule, RNG, data)."""
        if self.manager is None:  # not the chief: start where it does (fit)
            return
        loaded = self.manager.load_latest()
        if loaded is None:
            self.emit(Notice(f"--resume: no checkpoint in {self.config.checkpoint.dir!r} "
                             "yet; starting at step 0"))
            return
        payload, manifest = loaded
        path = str(self.manager.directory / manifest["file"])
        try:
            self._load(payload)
        except (RuntimeError, KeyError, ValueError, TypeError, AttributeError) as exc:
            # verified and from this config, yet not what this csrun writes: say so
            raise CheckpointError(f"checkpoint {path!r} does not fit this model and "
                                  f"optimizer: {type(exc).__name__}: {exc}") from None
        self.resumed_from = self.saved_step = self.step
        self.saved_path = path
        self.emit(Notice(f"resumed from step {self.step} (epoch {self.epoch}, batch "
                         f"{self.position}) of {path}"))
        self._past_the_end()

    def _past_the_end(self) -> None:
        """A checkpoint beyond ``train.steps`` (lowered since): nothing is left to train,
        and the run ends at the checkpoint's step, not at "300/200"."""
        if self.step > self.total_steps:
            self.emit(Notice(f"the checkpoint's step {self.step} is past the "
                             f"{self.total_steps} steps configured: nothing to train "
                             "(raise train.steps or epochs to go on)"))
            self.total_steps = self.step

    def _load(self, payload: dict) -> None:
        """Restore the session from a verified payload (KeyError etc. if it is not one
        this csrun wrote)."""
        self.role.load_checkpoint_state(payload)
        self.model.load_state_dict(payload["model"])
        self.optimizer.load_state_dict(payload["optimizer"])
        if self.schedule is not None:
            self.schedule.load_state_dict(payload["schedule"])
        self.step, self.epoch, self.position = payload["step"], payload["epoch"], \
            payload["position"]
        self.losses = payload["losses"].tolist()
        self.totals.load(payload["totals"])
        self.window.load(payload["window"])
        last = payload.get("last_log")
        self.last_log = _step_log_from(last) if last else None
        self.evaluations = list(payload.get("evaluations", []))
        self.precision.load_state_dict(payload.get("scaler"))
        watches = payload.get("watches", {})
        for name in ("stopper", "best"):
            if getattr(self, name) is not None:
                getattr(self, name).load(watches.get(name))
        if self.best is not None and self.manager is not None:
            self.manager.best_step = self.best.best_step  # the rotation keeps it
        _set_rng_state(payload["rng"])

    # -- the loop --------------------------------------------------------------------------
    def fit(self, stop: threading.Event) -> None:
        """Train until ``total_steps`` or until ``stop`` is set; save at the end."""
        here = {"step": self.step, "epoch": self.epoch, "position": self.position}
        start = self.role.begin(here, self.optimizer)  # a cluster's worker: the chief's
        self.step, self.epoch, self.position = (int(start[k]) for k in here)
        if self.step != here["step"]:
            self.resumed_from = self.step
        self.emit(self._started())
        begin = time.perf_counter()
        with self.strategy.scope():  # cross-replica context, as in TF
            while self._going(stop):
                start_position = self.position
                if not self._epoch(stop):
                    break
                if self.position == start_position == 0:
                    raise RunError(f"the pipeline yielded no step in epoch {self.epoch}")
                self.epoch, self.position = self.epoch + 1, 0  # the pass ended: next one
                if self.schedule is not None and self.interval == "epoch":
                    self.schedule.step()
        self.session_seconds += time.perf_counter() - begin
        if stop.is_set():
            self.emit(Notice(f"interrupted after step {self.step}"))
        self.role.settle()
        self.save()

    def _going(self, stop: threading.Event) -> bool:
        return self.step < self.total_steps and not stop.is_set() and not self.early_stopped

    def _epoch(self, stop: threading.Event) -> bool:
        """Run steps of the current pass; True when the pass ran out of batches. A step
        takes ``train.accumulate_steps`` batches (the pass's last one, those left)."""
        iterator = iter(self._distribute())
        try:
            while self._going(stop):
                begin = time.perf_counter()
                batches = list(itertools.islice(iterator, self.accumulate))
                if batches:
                    self._train_step(batches, time.perf_counter() - begin)
                if len(batches) < self.accumulate:
                    return True
            return False
        finally:
            iterator.close()

    def _distribute(self):
        """The distributed dataset of the current pass, from the current position."""
        config, pipeline = self.config.dataset, self.pipeline
        if self.role.sliced:  # the sizes of the global batches this process sees slices of
            self._sizes = (len(b) for b in itertools.islice(pipeline.plan(self.epoch),
                                                             self.position, None))
        pin = config.pin_memory if config.pin_memory != "auto" else torch.cuda.is_available() \
            and any(d.startswith("GPU") for d in self.devices)
        buffer = pipeline.prefetch
        if config.distribute == "global":
            loader = pipeline.loader(self.epoch, self.position, pin_memory=pin)
            return self.strategy.experimental_distribute_dataset(
                loader, InputOptions(experimental_per_replica_buffer_size=buffer))
        per_worker = config.replication == "per_worker"
        mode = InputReplicationMode.PER_WORKER if per_worker else \
            InputReplicationMode.PER_REPLICA
        epoch, position = self.epoch, self.position

        def dataset_fn(context):
            # one pipeline deals `replicas` batches per step; per-replica ones one each
            skip = position * (context.num_replicas_in_sync if per_worker else 1)
            return pipeline.loader(
                epoch, skip, pipelines=context.num_input_pipelines,
                pipeline_id=context.input_pipeline_id, pin_memory=pin,
                batch_size=context.get_per_replica_batch_size(pipeline.batch_size))

        return self.strategy.distribute_datasets_from_function(
            dataset_fn, InputOptions(experimental_replication_mode=mode,
                                     experimental_per_replica_buffer_size=buffer))

    def _replica_step(self, batch: Any, step_examples: int, scale: float
                      ) -> tuple[torch.Tensor, _Carried]:
        """One replica's part of a step (replica context): forward, backward; returns
        the summed loss (reduced) and the stats to tally after the run."""
        begin = time.perf_counter()
        if self.precision.dtype is None:  # fp32: no autocast to enter
            stats = self.objective.stats(self.forward_model, batch)
        else:
            with self.precision.autocast(_device_type(batch)):
                stats = self.objective.stats(self.forward_model, batch)
        # divided by all the step's examples (every replica, every accumulated batch):
        # the summed gradients are those of the step's mean
        loss = stats["loss"]
        loss = (loss if loss.dtype == torch.float32 else loss.float()) / step_examples
        (loss * scale if scale != 1.0 else loss).backward()
        stats["loss"] = stats["loss"].detach()
        stats["seconds"] = time.perf_counter() - begin  # a number: no op for a replica
        return stats["loss"], _Carried(stats)

    def _train_step(self, batches: list, distribute_s: float) -> None:
        """One optimizer step over ``batches`` (``train.accumulate_steps`` of them): each
        is run, the gradients add up centrally, then one update."""
        strategy = self.strategy
        examples = sum(self._global_examples(_first_leaf(b)) for b in batches)
        clear_grads(self.optimizer)
        scale = self.precision.loss_scale()
        t0 = time.perf_counter()
        outs = [strategy.run(self._replica_step, args=(b, examples, scale)) for b in batches]
        t1 = time.perf_counter()
        per_replica, correct = _replica_numbers(
            [[c.stats for c in strategy.experimental_local_results(carried)]
             for _, carried in outs], self.objective)
        self._check_finite(per_replica)
        grad_norm = self._update()
        t2 = time.perf_counter()
        loss = sum(float(strategy.reduce("SUM", losses, axis=None)) for losses, _ in outs) / \
            sum(s["examples"] for s in per_replica)
        t3 = time.perf_counter()
        self._record(per_replica, correct, loss, {"distribute": distribute_s,
                                                  "run": t1 - t0, "update": t2 - t1,
                                                  "reduce": t3 - t2}, len(batches), grad_norm)

    def _update(self) -> float | None:
        """Unscale (fp16), clip (``train.grad_clip_norm``), step, schedule; returns the
        gradient norm before clipping (None without clipping)."""
        self.precision.unscale(self.optimizer)
        clip, norm = self.config.train.grad_clip_norm, None
        if clip is not None:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            norm = float(torch.nn.utils.clip_grad_norm_(params, clip))
        self.precision.step(self.optimizer)
        if self.schedule is not None and self.interval == "step":
            self.schedule.step()
        return norm

    def _global_examples(self, x: Any) -> int:
        """The examples of this step's global batch; a step function divides its summed
        loss by it, so that the summed gradients are those of the global-batch mean."""
        if self.role.sliced:
            return next(self._sizes)
        return sum(int(t.shape[0]) for t in self.strategy.experimental_local_results(x))

    def _check_finite(self, per_replica: Sequence[dict]) -> None:
        for replica, stats in enumerate(per_replica):
            value = stats["loss"]
            if not math.isfinite(value):
                raise NonFiniteLoss(
                    f"the loss is {value} at step {self.step + 1} on replica {replica} "
                    f"({self.devices[replica]}); stopped before the update, "
                    f"{self.checkpoint_note()}. Try a lower optimizer.lr, or check the data "
                    "for NaN/inf values")

    def checkpoint_note(self) -> str:
        """What a failure leaves behind: the last checkpoint, intact, or none."""
        if self.saved_path:
            return f"the last checkpoint (step {self.saved_step}, {self.saved_path}) is intact"
        return "no checkpoint was written" if self.role.is_chief else \
            "checkpoints are the chief's"

    def _record(self, per_replica: Sequence[dict], correct: Any, loss: float, phases: dict,
                batches: int = 1, grad_norm: float | None = None) -> None:
        self.step += 1
        self.position += batches
        self.losses.append(loss)
        for tally in (self.totals, self.window, self.session):
            tally.add(per_replica, phases)
        self.pending_correct.add(correct)
        seconds = [s["seconds"] for s in per_replica]
        if self.outputs.plot:
            self.step_times.append(seconds)
        if self.sinks.active:  # (the step's correct predictions are counted only then)
            self._write_record(per_replica, loss, seconds, phases, grad_norm)
        self.emit(StepDone(self.step, self.total_steps, loss))
        if self.step % self.config.train.log_every == 0 or self.step == self.total_steps:
            self._log()
        if self.config.train.eval_every and self.step % self.config.train.eval_every == 0:
            self._evaluate_during()  # before a save at this step: it holds the new best
        every = self.config.checkpoint.every_steps
        if every and self.step % every == 0:
            self.save()

    def _write_record(self, per_replica: Sequence[dict], loss: float, seconds: list,
                      phases: dict, grad_norm: float | None) -> None:
        """The step's ``--metrics`` / TensorBoard record."""
        examples = sum(s["examples"] for s in per_replica)
        correct = self._count_correct()
        record = {"step": self.step, "epoch": self.epoch, "loss": loss,
                  "accuracy": correct / examples if self.classify else None,
                  "examples": examples, "learning_rate": self._lr(),
                  "step_time_s": seconds, "phases_s": phases}
        if grad_norm is not None:
            record["grad_norm"] = grad_norm  # before clipping
        self.sinks.write(record)

    def _count_correct(self) -> int:
        """Count the correct predictions waiting since the last count into the tallies
        (before they are read: a log line, a record, a checkpoint); returns them."""
        correct = self.pending_correct.take()
        for tally in (self.totals, self.window, self.session):
            tally.correct += correct
        return correct

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def _log(self) -> None:
        self._count_correct()
        window = self.window
        self.last_log = StepLog(
            step=self.step, total_steps=self.total_steps, epoch=self.epoch,
            loss=window.loss / max(window.examples, 1),
            accuracy=window.correct / max(window.examples, 1) if self.classify else None,
            learning_rate=self._lr(), replicas=window.replica_stats(self.devices),
            phases_s=window.mean_phases())
        self.emit(self.last_log)
        self.window = _Tally(self.replicas)
        self.role.logged()
        self._check_divergence()

    def _check_divergence(self) -> None:
        """A loss that ran away yet stayed finite fails the run (:mod:`.divergence`)."""
        why = diverged(self.losses, self.config.train.log_every,
                       self.config.train.divergence, last=self.step == self.total_steps)
        if why:
            raise RunError(why)

    def _started(self) -> RunStarted:
        return RunStarted(
            compute_devices=self.devices,
            parameter_device=self.role.parameter_device,
            model=f"{self.config.model.kind} ({type(self.model).__name__})",
            parameters=count_parameters(self.model), dataset=self.data.name,
            train_examples=len(self.pipeline.indices), holdout_examples=len(self.holdout),
            global_batch_size=self.pipeline.batch_size,
            distribute=self.config.dataset.distribute, total_steps=self.total_steps,
            steps_per_epoch=self.steps_per_epoch, start_step=self.step,
            seed=self.config.train.seed)

    # -- the end ---------------------------------------------------------------------------
    def evaluate(self) -> Evaluated | None:
        """Loss and accuracy on the held-out examples (the chief's to compute)."""
        if not self.role.is_chief or len(self.holdout) == 0:
            return None
        loader = self.pipeline.eval_loader(self.holdout, self.pipeline.batch_size)
        # a sliced role's strategy would feed this process only its slice: go around it
        batches = self._eval_here(loader) if self.role.sliced else \
            self._eval_distributed(loader)
        totals = {"loss": 0.0, "examples": 0, "correct": 0}
        self.model.eval()
        try:
            for stats in batches:
                for key in ("loss", "examples", "correct"):
                    totals[key] += float(stats[key])  # a tensor, or the count's int
                _add_metrics(totals, stats)
        finally:
            self.model.train()
        examples = int(totals["examples"])
        self.eval_metrics = {name: value / examples
                             for name, value in totals.get("metrics", {}).items()}
        return Evaluated(examples, totals["loss"] / examples,
                         totals["correct"] / examples if self.classify else None)

    def _eval_distributed(self, loader) -> Iterator[dict[str, torch.Tensor]]:
        """Each held-out batch's stats, distributed like training, summed over replicas."""
        def eval_step(batch):
            # grad mode and autocast are per thread: set them in the replica
            with torch.no_grad(), self.precision.autocast(_device_type(batch)):
                stats = self.objective.tally(self.objective.stats(self.forward_model, batch))
            for key in ("examples", "correct"):  # Python numbers: reduced with the rest
                stats[key] = torch.as_tensor(stats[key])
            return stats

        with self.strategy.scope():
            for batch in self.strategy.experimental_distribute_dataset(loader):
                yield self.strategy.reduce("SUM", self.strategy.run(eval_step, (batch,)),
                                           axis=None)

    def _eval_here(self, loader) -> Iterator[dict[str, torch.Tensor]]:
        """Each held-out batch's stats, on this process's copy of the parameters."""
        with torch.no_grad():
            for batch in loader:
                with self.precision.autocast(_device_type(batch)):
                    yield self.objective.tally(self.objective.stats(self.forward_model,
                                                                    batch))

    def _evaluate_during(self) -> None:
        """``train.eval_every``: evaluate, report (event, ``--metrics`` line, result), and
        feed early stopping and the best checkpoint."""
        evaluated = self.evaluate()
        if evaluated is None:
            return
        evaluated.step, self._last_eval = self.step, evaluated
        record = {"step": self.step, **self._eval_record(evaluated)}
        self.evaluations.append(record)
        self.sinks.write({"step": self.step, "epoch": self.epoch, "eval": record})
        self.emit(evaluated)
        if self.best is not None and self.best.update(self.step, self._watched(self.best,
                                                                               record)):
            self.manager.best_step = self.step  # set first: this save's pruning keeps it
            self.save()
        if self.stopper is not None:
            self.stopper.update(self.step, self._watched(self.stopper, record))
            if self.stopper.bad >= self.config.train.early_stopping.patience:
                self.early_stopped = {"step": self.step, "metric": self.stopper.metric,
                                      "best": self.stopper.best,
                                      "best_step": self.stopper.best_step}
                self.emit(Notice(f"early stopping at step {self.step}: "
                                 f"{self.stopper.metric} has not improved for "
                                 f"{self.stopper.bad} evaluations (best "
                                 f"{self.stopper.best:.6g} at step "
                                 f"{self.stopper.best_step})"))

    def _eval_record(self, evaluated: Evaluated) -> dict[str, Any]:
        record = {"eval_loss": evaluated.loss, "eval_examples": evaluated.examples}
        if evaluated.accuracy is not None:
            record["eval_accuracy"] = evaluated.accuracy
        record |= {f"eval_{name}": value for name, value in self.eval_metrics.items()
                   if name != "accuracy"}
        return record

    def _watched(self, watch: MetricWatch, record: dict[str, Any]) -> float:
        if watch.metric not in record:
            known = ", ".join(k for k in record if k not in ("step", "eval_examples"))
            raise RunError(f"{watch.metric!r} is not an evaluated metric of this run; "
                           f"evaluations report: {known}")
        return float(record[watch.metric])

    def finish(self, status: str) -> RunResult:
        """Evaluate (unless interrupted), export, write the plot, and assemble the result;
        the role's part of the job ends here."""
        evaluated = None
        if status == "completed":
            last = self._last_eval  # evaluated at this very step already: the same numbers
            evaluated = last if last is not None and last.step == self.step else \
                self.evaluate()
            if evaluated is not None and evaluated is not last:
                self.emit(evaluated)
        exported = self._export() if status == "completed" else None
        if self.outputs.plot:
            first = (self.resumed_from or 0) + 1
            write_plot(self.outputs.plot, self.losses, self.step_times, self.devices, first)
        result = RunResult(
            status=status, steps=self.step, total_steps=self.total_steps,
            epochs=self.step / self.steps_per_epoch if self.steps_per_epoch else None,
            examples=self.totals.examples, losses=list(self.losses),
            final_loss=self.losses[-1] if self.losses else None,
            metrics=self._metrics(evaluated), throughput=self._throughput(),
            phases_s=self.session.mean_phases(), per_replica=self._per_replica(),
            replica_balance=self._balance(), params_sha256=params_sha256(self.model),
            strategy={"compute_devices": self.devices, "replicas": self.replicas,
                      "parameter_device": self.strategy.extended.parameter_device.short_name,
                      "distribute": self.config.dataset.distribute},
            checkpoint={"dir": self.config.checkpoint.dir, "last": self.saved_path,
                        "last_step": self.saved_step, "resumed_from_step": self.resumed_from,
                        **self._best_checkpoint(), "export": exported},
            evaluations=list(self.evaluations), early_stopped=self.early_stopped)
        return self.role.end(result, self.model)

    def _best_checkpoint(self) -> dict[str, Any]:
        if self.best is None or self.manager is None or self.best.best_step is None:
            return {}
        return {"best": str(self.manager.path_of(self.best.best_step)),
                "best_step": self.best.best_step,
                "best_metric": {self.best.metric: self.best.best}}

    def _export(self) -> str | None:
        """``checkpoint.export``: the final weights as ``<dir>/model.safetensors``."""
        if self.config.checkpoint.export is None or not self.role.is_chief:
            return None
        path = pathlib.Path(self.config.checkpoint.dir) / "model.safetensors"
        try:
            export_safetensors(self.model, path)
        except OSError as exc:
            raise RunError(f"cannot export the final weights to {str(path)!r}: "
                           f"{exc.strerror or exc}; {self.checkpoint_note()}") from None
        self.emit(Notice(f"exported the final weights to {path}"))
        return str(path)

    def _metrics(self, evaluated: Evaluated | None) -> dict[str, Any]:
        log = self.last_log
        metrics: dict[str, Any] = {
            "loss": self.config.model.loss if self.config.model.loss != "auto" else
            resolve_loss(self.config.model, self.data.task),
            "train_loss": log.loss if log else None,
            "train_accuracy": log.accuracy if log else None}
        if evaluated is not None:
            metrics.update(eval_loss=evaluated.loss, eval_accuracy=evaluated.accuracy,
                           eval_examples=evaluated.examples)
        metrics.update(_loss_fn_metrics(self.totals, self.eval_metrics))
        return metrics

    def _throughput(self) -> dict[str, float]:
        seconds = max(self.session_seconds, 1e-9)
        return {"examples_per_s": self.session.examples / seconds,
                "steps_per_s": self.session.steps / seconds, "wall_s": self.session_seconds,
                "steps_this_session": self.session.steps}

    def _per_replica(self) -> list[dict[str, Any]]:
        total = max(self.totals.examples, 1)
        return [dict(stats.to_dict(), examples_share=stats.examples / total,
                     loss=stats.loss if math.isfinite(stats.loss) else None)
                for stats in self.totals.replica_stats(self.devices)]

    def _balance(self) -> dict[str, Any]:
        """How evenly the replicas shared the work (1.0: perfectly even)."""
        times = [s / max(self.session.steps, 1) for s in self.session.replica_seconds]
        examples = self.totals.replica_examples
        return {"step_time_max_over_min": max(times) / min(times) if min(times) > 0 else None,
                "slowest_replica": int(np.argmax(times)) if times else None,
                "examples_max_over_min": max(examples) / min(examples) if min(examples) > 0
                else None}


def clear_grads(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``, without the profiler span and dynamo
    guard torch wraps it in (~20 µs a step uncontended, 0.1 ms beside running replicas,
    for 6 parameters). An optimizer class with a ``zero_grad`` of its own keeps it."""
    if type(optimizer).zero_grad is not torch.optim.Optimizer.zero_grad \
            or "zero_grad" in vars(optimizer):  # a class's own, or one patched on
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None


def _compiled(model: torch.nn.Module) -> torch.nn.Module:
    """``torch.compile`` of the model for the replicas to call; checkpoints and exports
    keep using ``model`` itself (its own ``state_dict`` keys)."""
    return torch.compile(model)


def _device_type(batch: Any) -> str:
    """Where a replica's slice lives (``cpu``, ``cuda``): the autocast device."""
    leaf = _first_leaf(batch)
    return leaf.device.type if isinstance(leaf, torch.Tensor) else "cpu"


class _Carried:
    """A replica's step stats, carried through ``run`` as one opaque value: ``run``'s
    nest handling (regroup, and the watch for a backward through outputs after the run)
    then looks at one leaf, not at each number and the output kept for the tally (~30
    µs a step less with 2 replicas); nothing backpropagates through that output."""

    __slots__ = ("stats",)

    def __init__(self, stats: dict):
        self.stats = stats


def _replica_numbers(runs: list[Sequence[dict]], objective
                     ) -> tuple[list[dict[str, Any]], Any]:
    """Each replica's stats as Python numbers summed over the runs of an accumulated step
    (converted once here, then read by the checks, tallies and the step record), and the
    step's correct predictions, tallied after the run (``objective.tally_step``): a
    number, or outputs for :class:`PendingCorrect` to count."""
    correct = objective.tally_step(runs)  # (takes the outputs out of the stats)
    numbers = []
    for replica in zip(*runs):
        total: dict[str, Any] = {"loss": 0.0, "examples": 0, "seconds": 0.0}
        for stats in replica:
            total["loss"] += float(stats["loss"])
            total["examples"] += stats["examples"]
            total["seconds"] += stats["seconds"]
            _add_metrics(total, stats)
        numbers.append(total)
    return numbers, correct


def _first_leaf(batch: Any) -> Any:
    """The first tensor (or PerReplica) of a batch of any structure: it counts examples."""
    while isinstance(batch, (tuple, list, dict)):
        batch = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return batch


def _add_metrics(totals: dict, stats: dict) -> None:
    """Sum a loss function's metrics (``stats["metrics"]``) into ``totals["metrics"]``;
    a named loss has none, and adds no ``metrics`` entry (a step's hot path)."""
    if "metrics" not in stats:
        return
    sums = totals.setdefault("metrics", {})
    for name, value in stats["metrics"].items():
        sums[name] = sums.get(name, 0.0) + float(value)


def _loss_fn_metrics(totals: "_Tally", evaluated: dict[str, float]) -> dict[str, float]:
    """A loss function's metrics: ``train_<name>`` over every training example of the
    run, ``eval_<name>`` over the held-out ones (``accuracy`` is reported as correct
    predictions already)."""
    examples = max(totals.examples, 1)
    found = {f"train_{name}": value / examples for name, value in totals.metrics.items()}
    found |= {f"eval_{name}": value for name, value in evaluated.items()}
    return {key: value for key, value in found.items() if not key.endswith("_accuracy")}


def _step_log_from(data: dict) -> StepLog:
    replicas = [ReplicaStats(**r) for r in data.pop("replicas")]
    return StepLog(replicas=replicas, **data)
