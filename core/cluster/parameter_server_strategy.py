"""ParameterServerStrategy: the central-storage engine with its storage on ``ps`` tasks.

Without a cluster it *is* local central storage, as in TF. With one (from a cluster
resolver, an explicit ``cluster_spec`` + ``task_type`` + ``task_id``, or ``TF_CONFIG``):

* a **worker** (or the chief) runs the same engine over its local replicas: parameters
  are served from a local copy, gradients are summed locally, and ``optimizer.step()``
  pushes them to the parameter servers and pulls the new values (synchronous inside a
  worker, asynchronous between workers);
* a **ps** task calls ``strategy.extended.join()`` and serves its shard until the chief
  ends the job.

Variables are placed round-robin over the ps tasks in creation order (TF's rule), or
balanced by size with ``variable_placement="balanced"``.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Iterable

import torch

from ..distribute.devices import LogicalDevice, resolve_devices
from ..distribute.parameters import ParameterStore
from ..distribute.strategy import ParameterServerStrategyExtended, Strategy, StrategyOptions
from ..distribute.variables import Variable
from .client import ParameterServerClient
from .coordinator import JobCoordinator
from .remote_store import RemoteParameterStore
from .shard_index import build_index, check_index, sources_for
from .sharded_state import FORMAT, split_state, whole_state
from .sharded_variable import Partitioner
from .resolvers import ClusterResolver, SimpleClusterResolver, TFConfigClusterResolver
from .server import ParameterServer
from .transport import Stopped

__all__ = ["ParameterServerStrategy"]


class ParameterServerClusterExtended(ParameterServerStrategyExtended):
    """The engine of a ParameterServerStrategy task (worker, chief or ps)."""

    def __init__(self, container, compute, parameter, options, resolver: ClusterResolver | None,
                 variable_placement: str, timeout: float, stop: threading.Event | None = None,
                 partitioner: Partitioner | None = None, serve_embedding_rows: bool = True):
        self._resolver = resolver
        self._ps_server: ParameterServer | None = None
        self._lost: list[str] | None = None
        self._task_type = resolver.task_type if resolver else None
        self._task_id = resolver.task_id if resolver else None
        store = None
        workers, index = 1, 0
        if resolver is not None:
            spec = resolver.cluster_spec()
            self._worker_tasks = (["chief:0"] if spec.num_tasks("chief") else []) + \
                [f"worker:{i}" for i in range(spec.num_tasks("worker"))]
            workers = len(self._worker_tasks)
            me = f"{self._task_type}:{self._task_id}"
            chief = self._worker_tasks[0]  # chief:0, else worker:0: its heartbeat is watched
            if self._task_type == "ps":
                self._ps_server = ParameterServer(resolver, timeout, stop, chief)
            elif me in self._worker_tasks:
                index = self._worker_tasks.index(me)
                coordinator = JobCoordinator(resolver, timeout, stop, chief)
                client = ParameterServerClient(resolver, coordinator, timeout, stop)
                store = RemoteParameterStore(parameter, compute, options.copy_parameters,
                                             client, coordinator, variable_placement,
                                             partitioner, serve_embedding_rows)
            else:
                raise ValueError(f"task type {self._task_type!r} cannot train; tasks are "
                                 "chief, worker or ps")
        super().__init__(container, compute, parameter, parameter.name, options,
                         cluster_resolver=resolver, num_workers=workers, worker_index=index,
                         store=store)
        if resolver is not None:
            self._compute = [LogicalDevice(d.kind, d.index, self._task_type, self._task_id)
                             for d in compute]

    # -- roles -----------------------------------------------------------------------------
    @property
    def is_chief(self) -> bool:
        """The chief task, or worker 0 when the cluster has none (it checkpoints and logs)."""
        if self._resolver is None:
            return True
        return self._task_type == "chief" or (
            self._task_type == "worker" and self._task_id == 0
            and "chief:0" not in self._worker_tasks)

    @property
    def chief_task(self) -> str:
        """The chief's name: ``chief:0``, else ``worker:0``."""
        return self._worker_tasks[0] if self._resolver is not None else "worker:0"

    @property
    def should_checkpoint(self) -> bool:
        return self.is_chief

    should_save_summary = should_checkpoint
    experimental_should_init = should_checkpoint

    @property
    def is_ps(self) -> bool:
        return self._ps_server is not None

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        if self._resolver is None:
            return (self._parameter_spelling,)
        count = self._resolver.cluster_spec().num_tasks("ps")
        return tuple(f"/job:ps/replica:0/task:{k}/device:CPU:0" for k in range(count))

    def _remote(self) -> RemoteParameterStore:
        if not isinstance(self._store, RemoteParameterStore):
            raise RuntimeError("this task has no parameter servers to talk to")
        return self._store

    @property
    def coordinator(self) -> JobCoordinator:
        """The job's books as this worker sees them (lost, rejoined and unfinished
        workers, each one's applied steps): :class:`~.coordinator.JobCoordinator`."""
        return self._remote().coordinator

    # -- cluster operations ----------------------------------------------------------------
    def join(self, stop: threading.Event | None = None, grace: float = 60.0) -> bool:
        """On a ps task: serve variables until the chief ends the job.

        Args:
          stop: once set (e.g. by a signal handler), serve at most ``grace`` more seconds:
            time for the workers to stop and the chief to write its last checkpoint.

        Returns:
          True when the chief ended the job, False when the grace ran out first.

        Raises:
          JobAborted: the chief ended the job after a failure (its reason).
          ParameterServerError: ps:0, which holds the job's store, stopped answering.
        """
        if self._ps_server is None:
            raise RuntimeError(f"join() serves variables on ps tasks; this is "
                               f"{self._task_type}:{self._task_id}")
        return self._ps_server.serve(stop=stop, grace=grace)

    def variable_device(self, variable) -> str:
        """Where a variable lives: ``/job:ps/replica:0/task:k/device:CPU:0``; a
        partitioned one's shards, comma-separated in row order. ``variable``: a
        :class:`~csrun.core.Variable` made in this strategy's scope (TF's ``v.device``),
        or a parameter or tensor it registered."""
        tensor = variable.tensor if isinstance(variable, Variable) else variable
        remote = self._remote()
        remote.ensure_registered()
        if not isinstance(tensor, torch.Tensor) or not remote.owns(tensor):
            shape = tuple(getattr(variable, "shape", ()))
            raise ValueError(f"a {type(variable).__name__} of shape {shape} is not a variable "
                             "of this strategy: "
                             "create it in its scope (a module's parameters, or "
                             "csrun.core.Variable)")
        return ",".join(f"/job:ps/replica:0/task:{k}/device:CPU:0"
                        for k in remote.shard_devices(tensor))

    def transfer_stats(self) -> dict:
        """Bytes this worker moved to and from the ps tasks for its steps (lookups and
        pushes), in all and per step."""
        return self._remote().client.transfer_stats()

    @property
    def global_step(self) -> int:
        """Optimizer steps applied by all workers together (kept with ps:0's store)."""
        return self.coordinator.global_step

    def pull(self) -> None:
        """Fetch the current values of every variable from the parameter servers."""
        self._remote().pull()

    def ps_state(self) -> dict:
        """Every variable's value and optimizer state, whole (its shards joined), from
        the ps tasks (for the chief's checkpoints; :mod:`.sharded_state`)."""
        store = self._remote()
        store.ensure_registered()
        state = whole_state(store.client.state(), store.plan)
        # every worker's applied steps: a resumed job goes on from each one's own
        state["steps"] = {t: self.coordinator.steps_done(t) or 0 for t in self._worker_tasks}
        return state

    def load_ps_state(self, states: dict | list[dict],
                      optimizer: torch.optim.Optimizer | None = None,
                      step: int | None = None) -> None:
        """Restore the parameter servers from :meth:`ps_state` output, and every worker's
        step count with them (the global step is their sum).

        Pass the ``optimizer`` (made in ``scope()``) to restore its state too: the ps
        tasks build theirs from it first, so its state has somewhere to go. ``step``:
        every worker's count where the state has none (a checkpoint of an earlier
        csrun), e.g. the chief's restored step.
        """
        store = self._remote()
        store.ensure_registered(initialize=False)  # the state loaded next holds every value
        if optimizer is not None:
            store.ensure_optimizer(optimizer)
        if not (isinstance(states, dict) and states.get("format") == FORMAT) and \
                any(store.plan.partitioned(v) for v in range(len(store.plan.shapes))):
            raise ValueError("the checkpoint holds the ps tasks' state of an earlier csrun, "
                             "by ps task; resume it without strategy.variable_partitioner "
                             "(and with the same ps count), then save again")
        steps = states.get("steps") if isinstance(states, dict) else None
        if isinstance(states, dict):
            states = split_state(states, store.plan, store.client.state())
        store.client.load(states)
        if steps is None and step is not None:
            steps = {task: step for task in self._worker_tasks}
        if steps is not None:
            self.coordinator.set_steps({t: int(steps.get(t, 0)) for t in self._worker_tasks})
        else:  # every push reaches every ps that holds variables: the busiest counted all
            self.coordinator.set_global_step(max(int(s.get("version", 0)) for s in states))
        self.pull()

    def save_shards(self, directory: str, stem: str) -> tuple[list[dict], dict]:
        """Every ps writes its shards and their optimizer slots beside the chief's
        checkpoint (``directory/STEM.ps-K.safetensors``), all at once: no table passes
        through the chief. Returns the files (for the manifest) and the index (for the
        chief's payload: :mod:`.shard_index`)."""
        store = self._remote()
        store.ensure_registered()
        records = store.client.save(str(directory), stem, store.holding)
        steps = {t: self.coordinator.steps_done(t) or 0 for t in self._worker_tasks}
        files = [{k: r[k] for k in ("file", "bytes", "sha256")} for r in records]
        return files, build_index(records, store.plan, store.dtypes, steps)

    def restore_shards(self, index: dict, directory: str, listed: list[dict], path: str,
                       optimizer: torch.optim.Optimizer | None = None) -> None:
        """Every ps reads the rows of its shards from a checkpoint by shard (whatever ps
        or shard count wrote it), and every worker's step count is restored; ``index``
        is checked first (:func:`.shard_index.check_index`; ``path`` names the
        checkpoint in its errors)."""
        store = self._remote()
        store.ensure_registered(initialize=False)  # the checkpoint writes every row
        if optimizer is not None:
            store.ensure_optimizer(optimizer)
        check_index(index, store.plan, store.dtypes, self._worker_tasks, listed, path)
        sources = sources_for(index, store.plan, store.client.num_ps)
        store.client.restore(str(directory), sources, index["version"])
        self.coordinator.set_steps({t: int(index["steps"].get(t, 0))
                                    for t in self._worker_tasks})
        self.pull()

    def mark_initialized(self, info: dict | None = None) -> None:
        """Chief: the variables hold their starting values; other workers may go on.
        ``info`` (JSON data) reaches them through :meth:`wait_for_chief`."""
        self.coordinator.mark_initialized(info)

    def wait_for_chief(self, timeout: float = 600.0,
                       waiting: Callable[[float], None] | None = None) -> dict:
        """Non-chief workers: wait until the chief has initialized or restored the
        variables (:meth:`mark_initialized`), as TF's workers wait for the chief; returns
        the chief's ``info``. ``waiting(seconds_left)`` hears at once and every 10 s."""
        return self.coordinator.wait_initialized(timeout, waiting)

    def agree(self, name: str, value: dict) -> tuple[str, dict]:
        """Publish ``value`` as what every task must agree on under ``name`` (the first
        task's wins); returns that task and its value, to compare with ``value``."""
        if self._ps_server is not None:
            return self._ps_server.agree(name, value)
        return self.coordinator.agree(name, value)

    def abort(self, reason: str) -> None:
        """Chief: end the job after a failure; the ps tasks stop and workers that push
        afterwards fail with ``reason``."""
        self.coordinator.abort(reason)

    @property
    def worker_tasks(self) -> list[str]:
        """The tasks that train: ``chief:0`` (if any), then ``worker:0``, ``worker:1`` ..."""
        return list(self._worker_tasks)

    def wait_for_workers(self, timeout: float | None = None,
                         report: Callable[[str, str], None] | None = None) -> list[str]:
        """Chief: wait until every other worker finished or was lost, then pull the
        final values. Returns the lost workers; ``report(task, why)`` hears of each.

        Args:
          timeout: how long no worker may push an update before the unfinished ones
            count as lost (a stopped or hung process); the strategy's ``timeout``.

        Raises:
          Stopped: this task's ``stop`` was set (a signal); the others are not waited for.
        """
        if not self.is_chief:
            raise RuntimeError("only the chief waits for the other workers")
        if self._lost is None:
            coordinator = self.coordinator
            try:
                others = [t for t in self._worker_tasks if t != coordinator.task]
                self._lost = coordinator.wait_for_workers(others, timeout, report)
            except Stopped:
                self._lost = sorted(coordinator.lost_workers())  # finish() waits no more
                raise
            self.pull()
        return self._lost

    def finish(self, timeout: float | None = None,
               report: Callable[[str, str], None] | None = None) -> list[str]:
        """End this worker's part; the chief also waits for the others (unless
        :meth:`wait_for_workers` did: ``timeout`` is its) and ends the job.

        Returns the workers that were lost (chief only).
        """
        store = self._remote()
        lost = self.wait_for_workers(timeout, report) if self.is_chief else []
        store.coordinator.publish_transfers(store.client.transfer_stats())
        store.client.finish()
        store.coordinator.close()
        if self.is_chief:
            self.transfers = store.coordinator.transfers()
            self.ps_logs = store.coordinator.end_job()
        return lost

    def colocate_vars_with(self, colocate_with_variable: Any):
        self.check_colocation_target(colocate_with_variable)  # TF's ValueError/RuntimeError
        return _Colocation(self._store, colocate_with_variable)


class _Colocation:
    """Variables created inside go to the ps of ``target`` (TF's colocate_vars_with)."""

    def __init__(self, store: ParameterStore, target: Any):
        self._store, self._target = store, getattr(target, "tensor", target)
        self._before: set = set()

    def __enter__(self):
        self._before = set(id(t) for t in self._store.tensors())
        return self

    def __exit__(self, *exc):
        if isinstance(self._store, RemoteParameterStore):
            for tensor in self._store.tensors():
                if id(tensor) not in self._before:
                    self._store.colocations[tensor] = self._target


def _resolve_cluster(cluster_resolver, cluster_spec, task_type, task_id):
    if cluster_resolver is not None:
        if cluster_spec is not None:
            raise ValueError("give either cluster_resolver or cluster_spec, not both")
        return cluster_resolver
    if cluster_spec is not None:
        return SimpleClusterResolver(cluster_spec, task_type, task_id)
    if task_type is not None or task_id is not None:
        raise ValueError("task_type and task_id need a cluster_spec")
    if os.environ.get("TF_CONFIG", "").strip():
        return TFConfigClusterResolver()
    return None


class ParameterServerStrategy(Strategy):
    """TF's (contrib) ParameterServerStrategy over ``torch.distributed``.

    Args:
      cluster_resolver: where the cluster and this task come from (default: ``TF_CONFIG``
        when set, else no cluster -- local central storage).
      num_gpus_per_worker: local GPUs each worker replicates over (0: the CPU).
      cluster_spec, task_type, task_id: the cluster given directly (TF's ``configure``
        arguments); a spec without task_type or task_id is a ValueError, as in TF.
      compute_devices: the local replicas' devices instead of ``num_gpus_per_worker``
        (e.g. ``["CPU:0", "CPU:1"]`` for two logical CPU replicas per worker).
      variable_placement: ``"round_robin"`` (TF) or ``"balanced"`` (by size).
      timeout: seconds to wait for the parameter servers, and the bound of every store
        call and of the chief's silence (heartbeat) before a task gives up.
      options: csrun engine settings.
      variable_partitioner: TF's ``FixedShardsPartitioner``, ``MinSizePartitioner`` or
        ``MaxSizePartitioner`` (:mod:`.sharded_variable`), or any callable
        ``(shape, dtype) -> [n, 1, ...]`` as TF takes: variables split along dim 0 over
        the ps tasks.
      serve_embedding_rows: embedding tables are read by rows (False: served whole, the
        full table pushed and pulled every step, as csrun did before).
      stop: an event a signal handler sets: the waits for the ps tasks and the chief
        then end with :class:`~csrun.core.cluster.transport.Stopped`.

    Example (a worker; the same program runs on every task with its own ``TF_CONFIG``)::

        strategy = ParameterServerStrategy()
        if strategy.extended.is_ps:
            strategy.extended.join()
        else:
            with strategy.scope():
                model, opt = build()
            ...  # the usual run / optimizer.step() loop
            strategy.extended.finish()
    """

    def __init__(self, cluster_resolver: ClusterResolver | None = None,
                 num_gpus_per_worker: int = 0, *, cluster_spec=None, task_type=None,
                 task_id=None, compute_devices: Iterable | None = None,
                 variable_placement: str = "round_robin", timeout: float = 120.0,
                 options: StrategyOptions | None = None,
                 stop: threading.Event | None = None,
                 variable_partitioner: Partitioner | None = None,
                 serve_embedding_rows: bool = True):
        resolver = _resolve_cluster(cluster_resolver, cluster_spec, task_type, task_id)
        if compute_devices is not None:
            compute = resolve_devices(compute_devices)
        elif num_gpus_per_worker:
            compute = resolve_devices([f"GPU:{i}" for i in range(num_gpus_per_worker)])
        else:
            compute = resolve_devices(["CPU:0"])
        parameter = compute[0] if (len(compute) == 1 and resolver is None) \
            else LogicalDevice("CPU", 0)
        if variable_placement not in ("round_robin", "balanced"):
            raise ValueError(f"variable_placement must be 'round_robin' or 'balanced', got "
                             f"{variable_placement!r}")
        super().__init__(ParameterServerClusterExtended(
            self, compute, parameter, options or StrategyOptions(), resolver,
            variable_placement, timeout, stop, variable_partitioner, serve_embedding_rows))

    def configure(self, session_config=None, cluster_spec=None, task_type=None, task_id=None):
        if session_config is not None:
            raise NotImplementedError("session_config configures a TF session; PyTorch has "
                                      "no sessions. Pass the cluster to the constructor.")
        if cluster_spec is not None:
            raise NotImplementedError("a ParameterServerStrategy connects to its cluster "
                                      "when constructed; pass cluster_spec, task_type and "
                                      "task_id to ParameterServerStrategy(...)")
        return None

    def run(self, fn, args=(), kwargs=None, options=None):
        if self._extended.is_ps:
            raise RuntimeError("a ps task does not run replicas; call "
                               "strategy.extended.join() to serve variables")
        return super().run(fn, args, kwargs, options)
