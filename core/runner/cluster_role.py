"""One task of a parameter-server job, as ``csrun train`` runs it.

Every task runs the same config; its cluster and task come from ``strategy.cluster`` /
``strategy.task`` or ``TF_CONFIG`` (:mod:`csrun.core.config.cluster`), and its role from
the ``ParameterServerStrategy`` built from them:

* a **ps** task serves its share of the variables until the chief ends the job
  (``strategy.extended.join()``), and exits 0;
* a **worker** trains as a central-storage run does, on its slice of every global batch
  (``experimental_distribute_dataset`` keeps this worker's replicas' part). Its loss is
  divided by the *cluster-wide* global batch, so the workers' gradients add up to the
  gradient of the global-batch mean; ``optimizer.step()`` pushes them to the ps tasks;
* the **chief** (the ``chief`` task, else ``worker:0``) also writes the checkpoints (with
  every ps task's variables and optimizer state), waits for the other workers at the end,
  evaluates the holdout on the final values, ends the job, and reports lost workers.

Non-chief workers wait until the chief has initialized (or restored) the variables, as
TF's workers wait for the chief's session. A ps that dies stops the workers with a
:class:`~csrun.core.runner.session.RunError` (exit 1) that names the last checkpoint, intact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import threading
import time
from typing import Any, Callable

import torch

from .checkpoint import CheckpointManager
from ..config.cluster import cluster_resolver
from .events import Evaluated, Notice, RunResult, RunStarted
from ..cluster.parameter_server import ParameterServerError
from ..cluster.parameter_server_strategy import ParameterServerStrategy
from .session import Outputs, RunError, Session, run_session
from ..distribute.strategy import StrategyOptions

__all__ = ["run_task", "connect", "ClusterSession", "ClusterJoined", "ClusterRunResult",
           "ServeResult"]


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


def run_task(config, resume: bool, outputs: Outputs, emit: Callable[[Any], None],
             stop: threading.Event) -> ClusterRunResult | ServeResult:
    """Connect to the cluster and play this task's part (the runner's ``train`` calls
    it for ``strategy.kind: parameter_server``)."""
    strategy = connect(config)
    joined = _joined(strategy, config)
    emit(joined)
    if strategy.extended.is_ps:
        return _serve(strategy, config, joined, stop)
    session = None
    try:
        session = ClusterSession(config, outputs, emit, strategy)
        return run_session(session, resume, stop)
    except BaseException as exc:
        reason = f"{joined.task} failed: {type(exc).__name__}: {exc}"
        if session is not None:
            session.abort(reason)
        elif strategy.extended.is_chief:  # failed while setting up: still end the job,
            with contextlib.suppress(Exception):  # or the ps tasks would serve forever
                strategy.extended.abort(reason)
        if isinstance(exc, ParameterServerError):
            note = session.checkpoint_note() if session else "no checkpoint was written"
            raise RunError(f"{exc}; {note}") from None
        raise


def connect(config) -> ParameterServerStrategy:
    """The ParameterServerStrategy of a parameter-server config's task, connected to its
    cluster (a ps task hosts or joins the store; a worker waits for the ps tasks).

    Raises:
      RunError: the parameter servers cannot be reached (or, on ps:0, its address hosted).
    """
    s = config.strategy
    try:
        return ParameterServerStrategy(
            cluster_resolver(s), s.num_gpus_per_worker, compute_devices=s.compute_devices,
            variable_placement=s.variable_placement, timeout=s.timeout_s,
            options=StrategyOptions(copy_parameters=s.copy_parameters, execution=s.execution))
    except ParameterServerError as exc:
        raise RunError(str(exc)) from None


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
    except RuntimeError as exc:  # the store on ps:0 went away: the job is over
        raise RunError(f"{joined.task} lost the cluster's store on ps:0: "
                       f"{str(exc).splitlines()[0][:200]}") from None
    return ServeResult("completed" if ended else "interrupted", joined.task,
                       time.perf_counter() - begin, joined.to_dict())


class ClusterSession(Session):
    """A worker's training session (see the module docstring for what differs)."""

    def __init__(self, config, outputs: Outputs, emit: Callable[[Any], None],
                 strategy: ParameterServerStrategy):
        self.ext = strategy.extended
        self.is_chief = self.ext.is_chief
        self.lost: list[str] = []
        self._reported: set[str] = set()
        self._sizes: Any = iter(())
        self._ps_state: list | None = None
        self._ended = False
        super().__init__(config, outputs, emit, strategy)

    # -- checkpoints: the chief's ---------------------------------------------------------
    def _checkpoints(self) -> CheckpointManager | None:
        # the chief's alone: other workers learn where to start from the chief itself
        return super()._checkpoints() if self.is_chief else None

    def save(self) -> None:
        if self.is_chief:
            super().save()

    def _payload(self) -> dict:
        return {**super()._payload(), "ps": self.ext.ps_state()}

    def _load(self, payload: dict) -> None:
        if "ps" not in payload:
            raise ValueError("it holds no parameter-server state (a central-storage run "
                             "wrote it); use another checkpoint.dir")
        super()._load(payload)
        self._ps_state = payload["ps"]

    def restore(self) -> None:
        """The chief restores itself and the ps tasks (values, optimizer state, global
        step); the other workers take its position when it is ready (:meth:`fit`)."""
        if not self.is_chief:
            return
        super().restore()
        if self._ps_state is not None:
            self.ext.load_ps_state(self._ps_state, self.optimizer)
        self._ps_state = None

    def checkpoint_note(self) -> str:
        """What a failure leaves behind: the last checkpoint, intact, or none."""
        if self.saved_path:
            return f"the last checkpoint (step {self.saved_step}, {self.saved_path}) is intact"
        return "no checkpoint was written" if self.is_chief else \
            "checkpoints are the chief's"

    # -- the loop -------------------------------------------------------------------------
    def fit(self, stop: threading.Event) -> None:
        where = ("step", "epoch", "position")
        if self.is_chief:
            self.ext.mark_initialized({k: getattr(self, k) for k in where})
        else:  # start where the chief starts (0, or the step it resumed from)
            start = self.ext.wait_for_chief(max(self.config.strategy.timeout_s, 600.0))
            self.step, self.epoch, self.position = (int(start[k]) for k in where)
            if self.step:
                self.resumed_from = self.step
                self.emit(Notice(f"starting at the chief's step {self.step} (epoch "
                                 f"{self.epoch}, batch {self.position})"))
        super().fit(stop)

    def _distribute(self):
        # the global batches of this pass, from the index plan: each step's loss is
        # divided by its whole batch, though this worker sees only its slice
        self._sizes = (len(b) for b in itertools.islice(self.pipeline.plan(self.epoch),
                                                         self.position, None))
        return super()._distribute()

    def global_examples(self, x: Any) -> int:
        return next(self._sizes)

    def _log(self) -> None:
        super()._log()
        if self.is_chief:
            for task, why in self.ext.lost_workers().items():
                self._report(task, why)

    def _report(self, task: str, why: str) -> None:
        if task not in self._reported:
            self._reported.add(task)
            self.emit(Notice(f"lost {task}; the job goes on without it ({why})"))

    def settle(self) -> None:
        """The chief waits for the other workers and pulls the final values, so that its
        last checkpoint, evaluation and digest are of the job's end."""
        if self.is_chief:
            self.lost = self.ext.wait_for_workers(report=self._report)

    # -- the end --------------------------------------------------------------------------
    def evaluate(self) -> Evaluated | None:
        """The chief evaluates the whole holdout on its copy of the final values."""
        if not self.is_chief or len(self.holdout) == 0:
            return None
        totals = {"loss": 0.0, "examples": 0, "correct": 0}
        self.model.eval()
        try:
            with torch.no_grad():
                for x, y in self.pipeline.eval_loader(self.holdout, self.pipeline.batch_size):
                    for key, value in self.eval_stats(x, y).items():
                        totals[key] += value.item()
        finally:
            self.model.train()
        return self.evaluated(totals)

    def _started(self) -> RunStarted:
        started = super()._started()
        started.parameter_device = ", ".join(f"ps:{k}" for k in range(
            len(self.ext.parameter_devices)))
        return started

    def finish(self, status: str) -> ClusterRunResult:
        result = super().finish(status)
        cluster = self._cluster()
        self.lost = self.ext.finish(report=self._report)  # the chief ends the job here
        self._ended = True
        if self.is_chief:
            cluster["lost_workers"] = self.lost
            cluster["updates"] = _updates(getattr(self.ext, "ps_logs", []))
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
        return ClusterRunResult(**fields, cluster=cluster)

    def _cluster(self) -> dict[str, Any]:
        resolver = self.strategy.cluster_resolver
        return {"task": f"{resolver.task_type}:{resolver.task_id}",
                "role": "chief" if self.is_chief else "worker",
                "cluster": resolver.cluster_spec().as_dict(),
                "replicas_in_sync": self.replicas,
                "variable_placement": self.config.strategy.variable_placement,
                "variables": {name: self.ext.variable_device(p)
                              for name, p in self.model.named_parameters()},
                "global_step": self.ext.global_step}

    def abort(self, reason: str) -> None:
        """After a failure: the chief ends the job (the ps tasks stop)."""
        if self.is_chief and not self._ended:
            self._ended = True
            self.ext.abort(reason)


def _updates(logs: list) -> dict[str, int]:
    """Updates applied per worker, from the ps tasks' logs (a push reaches every ps
    that holds variables, so the longest log has them all)."""
    counts: dict[str, int] = {}
    for worker, _ in max(logs, key=len, default=[]):
        counts[worker] = counts.get(worker, 0) + 1
    return counts
