"""One task of a parameter-server job, as ``csrun train`` runs it.

Every task runs the same config; its cluster and task come from ``strategy.cluster`` /
``strategy.task`` or ``TF_CONFIG`` (:mod:`csrun.core.runner.preflight.cluster`), and its role from
the ``ParameterServerStrategy`` built from them:

* a **ps** task serves its share of the variables until the chief ends the job
  (``strategy.extended.join()``), and exits 0;
* a **worker** trains as a central-storage run does, on its share of every global batch
  (it reads only that: :mod:`csrun.core.runner.batches`). Its loss is divided by the
  *cluster-wide* global batch, so the workers' gradients add up to the gradient of the
  global-batch mean; ``optimizer.step()`` pushes them to the ps tasks. A restarted
  worker continues at the steps the ps tasks applied for it;
* the **chief** (the ``chief`` task, else ``worker:0``) also writes the checkpoints (with
  every ps task's variables and optimizer state), waits for the other workers at the end,
  evaluates the holdout on the final values, ends the job, and reports lost workers.

A worker is a :class:`~csrun.core.runner.session.Session` with a :class:`ClusterRole`,
which does those parts. Non-chief workers wait until the chief has initialized (or
restored) the variables, as TF's workers wait for the chief's session. A ps that dies
stops the workers with a :class:`~csrun.core.runner.errors.RunError` (exit 1) that names
the last checkpoint, intact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from typing import Any, Callable

import torch

from .preflight.cluster import cluster_resolver
from ..config.problems import ConfigError, Problem
from .events import Notice, RunResult
from ..cluster.client import HandlerError
from ..cluster.heartbeat import ChiefGone, intact
from ..cluster.transport import (ClusterMismatch, DuplicateTask, JobAborted,
                                 ParameterServerError, Stopped, StoppedAnswering, bounded,
                                 transport_error)
from ..cluster.embedding_lookup import ServedModel
from ..cluster.parameter_server_strategy import ParameterServerStrategy
from ..cluster.shard_index import FORMAT as SHARDS_FORMAT, CheckpointIndexError
from ..cluster.sharded_variable import partitioner_from_config
from .checkpoint import CheckpointError
from .checkpointing import run_identity
from .errors import RunError
from .session import Outputs, Session, run_session
from ..distribute.strategy import StrategyOptions

# after a second Ctrl-C or SIGTERM, how long the chief tries to tell the job it ends (the
# ps tasks and workers otherwise end when its heartbeat stands still: strategy.timeout_s)
ABORT_NOTICE_S = 2.0

__all__ = ["run_task", "connect", "ClusterRole", "ClusterJoined", "ClusterRunResult",
           "ServeResult", "StoppedWaiting"]


@dataclasses.dataclass
class ClusterJoined:
    """This task connected to its cluster (emitted before anything else)."""

    task: str                  # "worker:1"
    role: str                  # "chief", "worker" or "ps"
    workers: list[str]         # the tasks that train: ["worker:0", "worker:1"]
    ps: list[str]              # ["ps:0"]
    replicas_in_sync: int      # workers x local replicas
    variable_placement: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class ClusterRunResult(RunResult):
    """A worker's :class:`RunResult` plus its cluster: ``cluster["lost_workers"]``
    (chief), where each variable lives, the global step."""

    cluster: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ServeResult:
    """What a ps task reports: it served until the chief ended the job (``completed``),
    or a signal stopped it first (``interrupted``)."""

    status: str
    task: str
    wall_s: float
    cluster: dict[str, Any]
    signal: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class StoppedWaiting:
    """What a task reports when a signal stopped it while it waited (for the ps tasks,
    the store, the chief) before it had any part in the job."""

    task: str
    waited_for: str
    wall_s: float
    status: str = "interrupted"
    signal: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def run_task(config, resume: bool, outputs: Outputs, emit: Callable[[Any], None],
             stop: threading.Event) -> ClusterRunResult | ServeResult | StoppedWaiting:
    """Connect to the cluster and play this task's part (:func:`csrun.core.runner.train.train`
    calls it for ``strategy.kind: parameter_server``)."""
    begin = time.perf_counter()
    try:
        return _play(config, resume, outputs, emit, stop)
    except Stopped as exc:  # a signal while waiting: a clean stop, nothing to save
        resolver = cluster_resolver(config.strategy)
        return StoppedWaiting(f"{resolver.task_type}:{resolver.task_id}", exc.waited_for,
                              time.perf_counter() - begin)


def _play(config, resume: bool, outputs: Outputs, emit: Callable[[Any], None],
          stop: threading.Event) -> ClusterRunResult | ServeResult:
    strategy = connect(config, stop)
    joined = _joined(strategy, config)
    _agree_on_the_job(strategy, config, joined.task)
    emit(joined)
    if strategy.extended.is_ps:
        return _serve(strategy, config, joined, stop)
    role, session = ClusterRole(strategy, config, emit), None
    try:
        session = Session(config, outputs, emit, role)
        return run_session(session, resume, stop)
    except BaseException as exc:
        # the chief ends the job even when it failed while setting up, or the ps tasks
        # would serve forever
        line = _one_line(exc, role, session)  # the cluster failed: the job's reason
        first = str(exc).splitlines()[0] if str(exc) else ""  # never torch's C++ frames
        reason = str(line) if line else f"{joined.task} failed: {type(exc).__name__}: {first}"
        if isinstance(exc, KeyboardInterrupt):  # a second signal: no long wait for a store
            with contextlib.suppress(Exception):
                bounded(lambda: role.abort(reason), ABORT_NOTICE_S, "the job's store")
        else:
            role.abort(reason)
        if isinstance(exc, ClusterMismatch):  # a config problem: nothing of it ran
            raise ConfigError([Problem("model", str(exc), "run every task with the same "
                                       "config")]) from None
        if line is not None:  # the cluster's line, instead of the exception that said it
            raise line from None
        raise


def _one_line(exc: BaseException, role: "ClusterRole", session) -> RunError | None:
    """The line a worker ends with when the cluster failed: a ps that stopped answering
    with the checkpoint the job leaves; the job another task ended, with its reason
    (the first failure's), nothing of this worker's own. None: not the cluster's."""
    if isinstance(exc, StoppedAnswering):
        return RunError(exc.line(role.checkpoint_note(session)))
    if isinstance(exc, (JobAborted, HandlerError, DuplicateTask)):  # no checkpoint of
        return RunError(str(exc))  # this task's own is at stake: the reason alone
    if isinstance(exc, ParameterServerError) and not isinstance(exc, ClusterMismatch):
        return RunError(f"{exc}; {role.checkpoint_note(session)}")
    return None


def connect(config, stop: threading.Event | None = None) -> ParameterServerStrategy:
    """The ParameterServerStrategy of a parameter-server config's task, connected to its
    cluster (a ps task hosts or joins the store; a worker waits for the ps tasks);
    ``stop`` (set by a signal) ends the waits with :class:`~csrun.core.cluster.transport.Stopped`.

    Raises:
      RunError: the parameter servers cannot be reached (or, on ps:0, its address hosted).
    """
    s = config.strategy
    try:
        return ParameterServerStrategy(
            cluster_resolver(s), s.num_gpus_per_worker, compute_devices=s.compute_devices,
            variable_placement=s.variable_placement, timeout=s.timeout_s,
            options=StrategyOptions(copy_parameters=s.copy_parameters, execution=s.execution,
                                    bytes_per_pack=s.bytes_per_pack),
            stop=stop, variable_partitioner=partitioner_from_config(s.variable_partitioner),
            serve_embedding_rows=s.serve_embedding_rows)
    except StoppedAnswering as exc:
        raise RunError(exc.line()) from None
    except ParameterServerError as exc:
        raise RunError(str(exc)) from None


def job_settings(config) -> dict[str, Any]:
    """What every task of a job must agree on, as dotted keys: the model, optimizer,
    data and seed (a checkpoint's identity), how long it trains, and where variables go.
    Not the devices: each machine has its own."""
    settings = {k: v for k, v in run_identity(config, 0).items() if k != "strategy.replicas"}
    partitioner = config.strategy.variable_partitioner
    settings.update({"train.steps": config.train.steps, "train.epochs": config.train.epochs,
                     "strategy.variable_placement": config.strategy.variable_placement,
                     "strategy.variable_partitioner":
                         partitioner.model_dump() if partitioner is not None else None,
                     "strategy.serve_embedding_rows": config.strategy.serve_embedding_rows})
    return settings


def _agree_on_the_job(strategy: ParameterServerStrategy, config, task: str) -> None:
    """Refuse (exit 2) a task whose job-defining settings differ from the first task's:
    it would train another model, or for another number of steps, silently."""
    mine = job_settings(config)
    try:
        first, theirs = strategy.extended.agree("settings", mine)
    except StoppedAnswering as exc:
        raise RunError(exc.line()) from None
    except ParameterServerError as exc:
        raise RunError(str(exc)) from None
    differ = [k for k in sorted(set(mine) | set(theirs)) if mine.get(k) != theirs.get(k)]
    if differ:
        raise ConfigError([Problem(key, f"{task}'s config differs from {first}'s, which "
                                   f"joined the job first: {first} has "
                                   f"{theirs.get(key)!r}, {task} has {mine.get(key)!r}",
                                   "every task of a job must run the same config")
                           for key in differ])


def _joined(strategy: ParameterServerStrategy, config) -> ClusterJoined:
    ext = strategy.extended
    resolver = strategy.cluster_resolver
    spec = resolver.cluster_spec()
    role = "ps" if ext.is_ps else "chief" if ext.is_chief else "worker"
    workers = [f"{job}:{i}" for job in ("chief", "worker") for i in range(spec.num_tasks(job))]
    return ClusterJoined(f"{resolver.task_type}:{resolver.task_id}", role, workers,
                         [f"ps:{k}" for k in range(spec.num_tasks("ps"))],
                         strategy.num_replicas_in_sync, config.strategy.variable_placement)


def _serve(strategy, config, joined: ClusterJoined, stop: threading.Event) -> ServeResult:
    begin = time.perf_counter()
    try:
        ended = strategy.extended.join(stop=stop, grace=config.strategy.timeout_s)
    except ChiefGone as exc:  # nobody would end the job: this ps ended it
        raise RunError(f"{joined.task}: {exc}; the ps ended the job") from None
    except StoppedAnswering as exc:  # ps:0, which holds the job's store, died
        raise RunError(exc.line()) from None
    except ParameterServerError as exc:  # the job was ended: its one line
        raise RunError(str(exc)) from None
    except RuntimeError as exc:  # gloo's or the store's own, as the job ends: never raw
        raise RunError(f"{joined.task} lost the job's store on ps:0: "
                       f"{transport_error(exc)}") from None
    return ServeResult("completed" if ended else "interrupted", joined.task,
                       time.perf_counter() - begin, joined.to_dict())


class ClusterRole:
    """A worker's part in the job, for its :class:`~csrun.core.runner.session.Session`
    (the interface: :class:`~csrun.core.runner.roles.Role`; see the module docstring
    for what the chief does besides)."""

    sliced = True  # the loss is divided by the whole global batch; the chief evaluates it all

    def __init__(self, strategy: ParameterServerStrategy, config,
                 emit: Callable[[Any], None]):
        self.strategy, self.config, self.emit = strategy, config, emit
        self.ext = strategy.extended
        self.is_chief = self.ext.is_chief
        self.lost: list[str] = []
        self._reported: set[str] = set()
        self._restored: list | None = None  # ps state from a checkpoint, for begin()
        self._files: dict = {}  # where that checkpoint's files are, and which
        self._index: dict | None = None  # the last checkpoint's index of the ps shards
        self._saved_global: int | None = None  # the global step it held
        self._ended = False

    @property
    def parameter_device(self) -> str:
        return ", ".join(f"ps:{k}" for k in range(len(self.ext.parameter_devices)))

    # -- checkpoints: the chief's; each ps writes its own shards beside them ------------
    def write_files(self, directory, stem: str) -> list[dict]:
        """Each ps writes its shards and their optimizer slots (the chief keeps the
        index): called by the checkpointer before :meth:`state_dict`."""
        files, self._index = self.ext.save_shards(str(directory), stem)
        self._saved_global = self.ext.global_step
        return files

    def state_dict(self) -> dict:
        return {"ps": self._index}

    def load_state_dict(self, payload: dict) -> None:
        if "ps" not in payload:
            raise ValueError("it holds no parameter-server state (a central-storage run "
                             "wrote it); use another checkpoint.dir")
        self._restored, self._files = payload["ps"], payload.get("files") or {}

    def unsaved(self) -> bool:
        """The chief, after waiting for the others: whether any update was applied since
        its last checkpoint (then the last one is written again, with all of them)."""
        return self.is_chief and self._saved_global is not None and \
            self.ext.global_step != self._saved_global

    def saved(self, step: int, path: str) -> None:
        """The checkpointer wrote ``path`` whole: the chief tells the other tasks, which
        name it if the job fails later (ps:0, the store, may be gone by then)."""
        if self.is_chief:
            self.ext.coordinator.heartbeat.checkpointed(step, path)

    def checkpoint_note(self, session) -> str:
        """What a failure leaves behind: the chief's last checkpoint (on another
        worker: the newest it heard of), intact."""
        if self.is_chief:
            saved = session.checkpoints if session else None
            if saved is None or not saved.saved_path:
                return "no checkpoint was written"
            return intact(saved.saved_step, saved.saved_path)
        watch = self.ext.coordinator.watch
        return (watch.note() if watch is not None else None) or \
            "no checkpoint that this task heard of"

    def checkpointed(self, model: torch.nn.Module):
        """The model's checkpoint entry: without the tables served by rows (the ps tasks
        write those beside the checkpoint)."""
        return ServedModel(model)

    def _restore(self, where: dict, optimizer: torch.optim.Optimizer) -> None:
        restored, self._restored = self._restored, None
        if isinstance(restored, dict) and restored.get("format") == SHARDS_FORMAT:
            files = self._files
            try:
                self.ext.restore_shards(restored, files["directory"], files["listed"],
                                        files["payload"], optimizer)
            except CheckpointIndexError as exc:
                raise CheckpointError(str(exc)) from None
            return
        try:  # an earlier csrun's whole variables (each worker's steps, or the chief's)
            self.ext.load_ps_state(restored, optimizer, int(where["step"]))
        except ValueError as exc:  # a checkpoint by ps task, into shards
            raise ConfigError([Problem("strategy.variable_partitioner", str(exc),
                                       "resume without it, then save again")]) from None

    # -- the run ---------------------------------------------------------------------------
    def begin(self, where: dict, optimizer: torch.optim.Optimizer) -> dict:
        """The chief initializes the variables (restores the ps tasks from its
        checkpoint, every worker's step count with them) and lets the other workers go.
        Another worker starts at the steps the ps tasks applied for it in this job (or
        the checkpoint's count of them): a restarted or resumed one goes on where it
        was (no step is trained twice); a fresh one where the chief starts."""
        if self.is_chief:
            if self._restored is not None:
                self._restore(where, optimizer)
            self.ext.mark_initialized(where)
            return where
        timeout = max(self.config.strategy.timeout_s, 600.0)
        start = self.ext.wait_for_chief(timeout, self._waiting)
        done = self.ext.coordinator.steps_done()
        if done is not None and done != int(start["step"]):
            self.emit(Notice(f"continuing at step {done}, the steps the ps tasks applied "
                             f"for this worker in this job"))
            return {"step": done}
        if start["step"]:
            self.emit(Notice(f"starting at the chief's step {start['step']} (epoch "
                             f"{start['epoch']}, batch {start['position']})"))
        return start

    def _waiting(self, seconds_left: float) -> None:
        chief = self.ext.chief_task
        until = time.strftime("%H:%M:%S", time.localtime(time.time() + seconds_left))
        self.emit(Notice(f"waiting for the chief {chief} to initialize the variables "
                         f"(until {until}, {seconds_left:.0f} s more)"))

    def logged(self) -> None:
        if self.is_chief:
            for task, why in self.ext.coordinator.lost_workers().items():
                self._report(task, why)
            self._rejoined()

    def _report(self, task: str, why: str) -> None:
        if task not in self._reported:
            self._reported.add(task)
            self.emit(Notice(f"lost {task}; the job goes on without it ({why})"))

    def _rejoined(self) -> list[str]:
        """Workers restarted since; those reported lost are news (and may be lost again)."""
        rejoined = self.ext.coordinator.rejoined_workers()
        for task in sorted(self._reported.intersection(rejoined)):
            self._reported.discard(task)
            self.emit(Notice(f"rejoined {task}: it was restarted and trains again"))
        return rejoined

    def settle(self) -> None:
        """The chief waits for the other workers and pulls the final values, so that its
        last checkpoint, evaluation and digest are of the job's end. A worker silent for
        ``strategy.timeout_s`` is lost; a signal ends the wait (the chief then saves what
        the ps tasks hold, and the run is interrupted)."""
        if not self.is_chief:
            return
        coordinator = self.ext.coordinator
        others = [t for t in self.ext.worker_tasks if t != coordinator.task]
        waiting = [t for t in coordinator.unfinished(others) if t not in self._reported]
        if waiting:
            self.emit(Notice(f"waiting for {', '.join(waiting)} to finish (each counts as "
                             f"lost after {self.config.strategy.timeout_s:g} s without an "
                             "update: strategy.timeout_s)"))
        try:
            self.lost = self.ext.wait_for_workers(report=self._report)
        except Stopped:
            self.emit(Notice("stopped waiting for the other workers: the job ends here"))

    # -- the end ---------------------------------------------------------------------------
    def end(self, result: RunResult, model: torch.nn.Module) -> ClusterRunResult:
        cluster = self._cluster(model)
        # the store lives until the chief ends the job: ask before finish() does (the
        # others have finished: settle() waited for them)
        self._rejoined_before_end = self._rejoined() if self.is_chief else []
        counts = {t: self.ext.coordinator.steps_done(t) or 0 for t in self.ext.worker_tasks} \
            if self.is_chief else {}
        self.lost = self.ext.finish(report=self._report)  # the chief ends the job here
        self._ended = True
        cluster["transfers"] = self.ext.transfer_stats()
        if self.is_chief:
            cluster["lost_workers"] = self.lost
            cluster["rejoined_workers"] = self._rejoined_before_end
            logs = getattr(self.ext, "ps_logs", [])
            # counted where each update was applied, as the global step: they agree
            cluster["updates"] = counts
            cluster["worker_transfers"] = dict(sorted(getattr(self.ext, "transfers",
                                                              {}).items()))
            cluster["ps"] = {f"ps:{k}": {"held_bytes": log.get("held_bytes"),
                                         "shards": log.get("shards")}
                             for k, log in enumerate(logs)}
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
        return ClusterRunResult(**fields, cluster=cluster)

    def _cluster(self, model: torch.nn.Module) -> dict[str, Any]:
        resolver = self.strategy.cluster_resolver
        return {"task": f"{resolver.task_type}:{resolver.task_id}",
                "role": "chief" if self.is_chief else "worker",
                "cluster": resolver.cluster_spec().as_dict(),
                "replicas_in_sync": self.strategy.num_replicas_in_sync,
                "variable_placement": self.config.strategy.variable_placement,
                "variables": {name: self.ext.variable_device(p)
                              for name, p in model.named_parameters()},
                # the chief reads it after the other workers finished: the job's last;
                # another worker when it finished, while the rest may still be training
                "global_step": self.ext.global_step,
                "global_step_when": "the job ended" if self.is_chief
                else "this worker finished"}

    def abort(self, reason: str) -> None:
        """After a failure: the chief ends the job (the ps tasks stop), unless it has; a
        failure to do so must not hide the one being reported."""
        if self.is_chief and not self._ended:
            self._ended = True
            with contextlib.suppress(Exception):
                self.ext.abort(reason)
