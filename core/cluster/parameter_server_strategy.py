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
import warnings
import weakref
from typing import Any, Callable, Iterable

import torch

from ..distribute import context
from ..distribute.devices import LogicalDevice, resolve_devices
from ..distribute.parameters import ParameterStore
from ..distribute.strategy import ParameterServerStrategyExtended, Strategy, StrategyOptions
from .client import ParameterServerClient, Push
from .embedding_lookup import (SPARSE_OPTIMIZERS, RowTable, find_tables, serve_by_rows,
                               sparse_update_problem, table_label)
from .sharded_state import FORMAT, split_state, whole_state
from .sharded_variable import Layout, Partitioner
from .resolvers import ClusterResolver, SimpleClusterResolver, TFConfigClusterResolver
from .server import ParameterServer
from .transport import Stopped

__all__ = ["ParameterServerStrategy"]


class RemoteParameterStore(ParameterStore):
    """A worker's parameter store whose central copy lives on the parameter servers:
    variables served whole are kept here too (pulled after each push), lookup tables
    are read by rows (:mod:`.embedding_lookup`)."""

    def __init__(self, parameter_device, compute_devices, copy_parameters,
                 client: ParameterServerClient, variable_placement: str,
                 partitioner: Partitioner | None = None, serve_embedding_rows: bool = True):
        super().__init__(parameter_device, compute_devices, copy_parameters)
        # Leaves of its own even for one replica: a failed run's gradients must never
        # reach the parameter servers, which other workers share
        self.direct = False
        self.client = client
        self.variable_placement = variable_placement
        self.partitioner = partitioner
        self.serve_embedding_rows = serve_embedding_rows
        self.layout: Layout | None = None
        self._ids: dict = {}          # central tensor -> variable id (creation order)
        self._optimizer = None
        self.colocations: dict = {}   # tensor -> tensor whose ps it must share
        self.tables: dict[int, RowTable] = {}  # var id -> served by rows
        self._sparse: set[int] = set()         # var ids of sparse=True modules
        self._whole: list[list[torch.Tensor]] = [[] for _ in range(client.num_ps)]
        self.served_whole: list[str] = []  # tables that could not be served by rows, why
        self._row_served: set[int] = set()     # ids of the tables served by rows
        self._holding: list[bool] = []          # per ps: holds any shard
        self._counting_ps = 0

    def begin_run(self, reads: bool = True):
        self.ensure_registered()
        return super().begin_run(reads)

    def ensure_registered(self) -> None:
        """Give every new variable an id and shards on the ps tasks; the first worker's
        values win. Lookup tables are then served by rows and freed here."""
        tensors = self.tensors()
        if len(tensors) == len(self._ids):
            return
        index = {t: i for i, t in enumerate(tensors)}
        colocate = {index[t]: index[c] for t, c in self.colocations.items()
                    if t in index and c in index}
        self.layout = Layout.of(tensors, self.client.num_ps, self.variable_placement,
                                colocate, self.partitioner)
        self._ids = index
        modules = list(self._adopted)
        tables = self._tables_to_serve(modules, tensors, index)
        self._sparse = {index[m.weight] for m in modules
                        if getattr(m, "sparse", False) is True and m.weight in index}
        held: list[list] = [[] for _ in range(self.client.num_ps)]
        self._whole = [[] for _ in range(self.client.num_ps)]
        for shard in self.layout.shards:
            tensor = tensors[shard.var]
            piece = tensor.detach()[shard.start:shard.stop] if tensor.dim() else tensor.detach()
            held[shard.ps].append((shard, piece, {"rows": shard.var in tables}))
            if shard.var not in tables:
                self._whole[shard.ps].append(piece)
        self.client.register(held, self._whole)
        self._holding = [bool(shards) for shards in held]  # the ps tasks a push goes to
        self._counting_ps = self._holding.index(True)
        for var, module in tables.items():
            central = tensors[var]
            self.tables[var] = RowTable(var, tuple(central.shape), central.dtype,
                                        var in self._sparse, self._fetcher(var),
                                        self._assigner(var), self._weight(central))
            self._row_served.add(id(central))
            serve_by_rows(module, self.tables[var])
        # never served ahead to a replica: a read of one there is refused (check_device)
        self._fresh = [key for key in self._fresh if key not in self._row_served]

    def _tables_to_serve(self, modules, tensors, index) -> dict[int, torch.nn.Module]:
        """The lookup tables to serve by rows (var id -> module); says once which are
        served whole, and why."""
        found, self.served_whole = find_tables(modules)
        if not self.serve_embedding_rows:
            return {}
        if any(self.copies) and found:  # mirrors copy every variable whole to replicas
            self.served_whole += [f"{table_label(m)}: its replicas get copies (GPU workers "
                                  "or copy_parameters)" for m in found.values()]
            found = {}
        if self.served_whole:
            warnings.warn("served whole, not by rows (read in full by every worker): " +
                          "; ".join(self.served_whole), stacklevel=3)
        return {index[t]: found[id(t)] for t in tensors if id(t) in found}

    def _weight(self, central: torch.Tensor):
        """The table as a lookup's backward sees it: in a replica, that replica's alias
        (its gradients are summed in replica order, as every parameter's); taken here,
        not through the module, whose reads in a replica are refused."""
        ref = weakref.ref(central)

        def weight() -> torch.Tensor:
            table, serving = ref(), context.current_serving()
            if serving is None or serving.store is not self:
                return table
            return self.alias(serving.replica_id, table)
        return weight

    def check_device(self, central: torch.Tensor, owner, name: str) -> None:
        if id(central) in self._row_served:
            raise RuntimeError(
                f"{owner.path(name)} is an embedding table served by rows from the ps tasks "
                "(a worker holds none of it), and this replica reads it other than by its "
                "module's lookup; serve it whole: strategy.serve_embedding_rows: false "
                "(ParameterServerStrategy(serve_embedding_rows=False))")
        super().check_device(central, owner, name)

    def discard_run(self, servings) -> None:
        """A failed run's lookups leave no gradient behind on the tables' aliases."""
        super().discard_run(servings)
        for serving in servings:
            for key in self._row_served:
                entry = self._aliases[serving.replica_id].get(key)
                if entry is not None:
                    entry[1].grad = None

    def _fetcher(self, var: int):
        def fetch(ids: torch.Tensor) -> torch.Tensor:
            shape = self.layout.shapes[var]
            rows = torch.empty((len(ids), *shape[1:]), dtype=self.tables[var].dtype)
            parts = self.layout.split_rows(var, ids)
            requests: list[list] = [[] for _ in range(self.client.num_ps)]
            for shard, where in parts:
                if len(where):
                    requests[shard.ps].append((shard.id, ids[where] - shard.start))
            # a step's lookups count as what it moved, not an evaluation's or a
            # state_dict's (its reads run without gradients)
            answers = self.client.lookup(requests, rows.dtype, torch.is_grad_enabled())
            for shard, where in parts:
                if len(where):
                    rows[where] = answers[shard.ps].pop(0).view(len(where), *shape[1:])
            return rows
        return fetch

    def _assigner(self, var: int):
        def assign(ids: torch.Tensor, rows: torch.Tensor) -> None:
            writes: list[list] = [[] for _ in range(self.client.num_ps)]
            for shard, where in self.layout.split_rows(var, ids):
                if len(where):
                    writes[shard.ps].append((shard.id, ids[where] - shard.start, rows[where]))
            self.client.assign(writes)
        return assign

    def shard_devices(self, tensor: torch.Tensor) -> list[int]:
        """The ps tasks that hold ``tensor``'s shards, in row order."""
        self.ensure_registered()
        return [s.ps for s in self.layout.shards_of(self._ids[tensor])]

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.flush_pending()
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not any(self.owns(p) for p in params):
            return
        self.ensure_optimizer(optimizer)
        pushes = [Push() if holds else None for holds in self._holding]
        for p in params:
            if p.grad is not None and p in self._ids:
                self._add_push(pushes, self._ids[p], p.grad)
        lrs = [float(group["lr"]) for group in optimizer.param_groups]
        self.client.push_pull(pushes, lrs, self._whole, self._counting_ps)
        for p in params:  # updated remotely: the local step must do nothing
            p.grad = None
        self.client.count_step()

    def _add_push(self, pushes: list[Push], var: int, grad: torch.Tensor) -> None:
        """A variable's gradient to the ps tasks of its shards: dense slices, or (row
        ids, rows) of a sparse one -- to every shard, an empty part where no row fell,
        so each shard's optimizer steps as the whole variable's would."""
        if grad.layout == torch.sparse_coo:
            grad = grad.coalesce()
            ids, values = grad.indices()[0], grad.values()
            mode = "dense" if var in self.tables and not self.tables[var].sparse \
                else "sparse"
            for shard, where in self.layout.split_rows(var, ids):
                pushes[shard.ps].rows.append((shard.id, ids[where] - shard.start,
                                              values[where], mode))
        elif grad.layout != torch.strided:
            raise RuntimeError(f"variable {var} has a {grad.layout} gradient; a "
                               "parameter-server job pushes dense or sparse COO gradients")
        else:
            for shard in self.layout.shards_of(var):
                piece = grad[shard.start:shard.stop] if grad.dim() else grad
                pushes[shard.ps].dense.append((shard.id, piece))

    def ensure_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Build ``optimizer``'s twin on every ps (once; its state lives there)."""
        self.ensure_registered()
        if self._optimizer is None:
            check_sparse_support(optimizer, [self._name(v) for v in sorted(self._sparse)])
            groups = {self._ids[p]: g for g, group in enumerate(optimizer.param_groups)
                      for p in group["params"] if p in self._ids}
            self.client.register_optimizer(optimizer, groups)
            self._optimizer = optimizer
            for p in list(optimizer.state):  # kept on the ps: none of it here (Adagrad's
                if id(p) in self._row_served:  # sums of a table are a table)
                    del optimizer.state[p]
        elif optimizer is not self._optimizer:
            raise RuntimeError("a ParameterServerStrategy job trains with one optimizer; "
                               "its state lives on the parameter servers")

    def _name(self, var: int) -> str:
        tensor = next(t for t, i in self._ids.items() if i == var)
        return self.name_of(tensor)

    def pull(self) -> None:
        self.ensure_registered()
        self.client.pull(self._whole)


def check_sparse_support(optimizer: torch.optim.Optimizer, sparse: list[str]) -> None:
    """Refuse an optimizer (or a group's settings) without a sparse update for variables
    with sparse gradients, before any step: the ps tasks would fail at the first."""
    if not sparse:
        return
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    why = sparse_update_problem(type(optimizer), groups)
    if why is not None:
        name = type(optimizer).__name__
        raise ValueError(f"{', '.join(sparse[:3])} get sparse gradients (sparse=True), which "
                         f"{name} with these settings cannot apply ({why}); use one of "
                         f"{', '.join(SPARSE_OPTIMIZERS)} without the setting, or build the "
                         "embedding with sparse=False")


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
                client = ParameterServerClient(resolver, timeout, stop, chief)
                store = RemoteParameterStore(parameter, compute, options.copy_parameters,
                                             client, variable_placement, partitioner,
                                             serve_embedding_rows)
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

    # -- cluster operations ----------------------------------------------------------------
    def join(self, stop: threading.Event | None = None, grace: float = 60.0) -> bool:
        """On a ps task: serve variables until the chief ends the job.

        Args:
          stop: once set (e.g. by a signal handler), serve at most ``grace`` more seconds:
            time for the workers to stop and the chief to write its last checkpoint.

        Returns:
          True when the chief ended the job, False when the grace ran out first.
        """
        if self._ps_server is None:
            raise RuntimeError(f"join() serves variables on ps tasks; this is "
                               f"{self._task_type}:{self._task_id}")
        return self._ps_server.serve(stop=stop, grace=grace)

    def variable_device(self, tensor: torch.Tensor) -> str:
        """Where a variable lives: ``/job:ps/replica:0/task:k/device:CPU:0``; a
        partitioned one's shards, comma-separated in row order."""
        return ",".join(f"/job:ps/replica:0/task:{k}/device:CPU:0"
                        for k in self._remote().shard_devices(tensor))

    def transfer_stats(self) -> dict:
        """Bytes this worker moved to and from the ps tasks for its steps (lookups and
        pushes), in all and per step."""
        return self._remote().client.transfer_stats()

    @property
    def global_step(self) -> int:
        """Optimizer steps applied by all workers together (kept with ps:0's store)."""
        return self._remote().client.global_step

    def pull(self) -> None:
        """Fetch the current values of every variable from the parameter servers."""
        self._remote().pull()

    def ps_state(self) -> dict:
        """Every variable's value and optimizer state, whole (its shards joined), from
        the ps tasks (for the chief's checkpoints; :mod:`.sharded_state`)."""
        store = self._remote()
        store.ensure_registered()
        state = whole_state(store.client.state(), store.layout)
        # every worker's applied steps: a resumed job goes on from each one's own
        state["steps"] = {t: store.client.steps_done(t) or 0 for t in self._worker_tasks}
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
        store.ensure_registered()
        if optimizer is not None:
            store.ensure_optimizer(optimizer)
        if not (isinstance(states, dict) and states.get("format") == FORMAT) and \
                any(store.layout.partitioned(v) for v in range(len(store.layout.shapes))):
            raise ValueError("the checkpoint holds the ps tasks' state of an earlier csrun, "
                             "by ps task; resume it without strategy.variable_partitioner "
                             "(and with the same ps count), then save again")
        steps = states.get("steps") if isinstance(states, dict) else None
        if isinstance(states, dict):
            states = split_state(states, store.layout, store.client.state())
        store.client.load(states)
        if steps is None and step is not None:
            steps = {task: step for task in self._worker_tasks}
        if steps is not None:
            store.client.set_steps({t: int(steps.get(t, 0)) for t in self._worker_tasks})
        else:  # every push reaches every ps that holds variables: the busiest counted all
            store.client.set_global_step(max(int(s.get("version", 0)) for s in states))
        self.pull()

    def steps_done(self, task: str | None = None) -> int | None:
        """Steps the ps tasks applied for ``task`` (default: this worker) in this job;
        None before its first (a restarted worker continues there)."""
        return self._remote().client.steps_done(task)

    def mark_initialized(self, info: dict | None = None) -> None:
        """Chief: the variables hold their starting values; other workers may go on.
        ``info`` (JSON data) reaches them through :meth:`wait_for_chief`."""
        self._remote().client.mark_initialized(info)

    def wait_for_chief(self, timeout: float = 600.0,
                       waiting: Callable[[float], None] | None = None) -> dict:
        """Non-chief workers: wait until the chief has initialized or restored the
        variables (:meth:`mark_initialized`), as TF's workers wait for the chief; returns
        the chief's ``info``. ``waiting(seconds_left)`` hears at once and every 10 s."""
        return self._remote().client.wait_initialized(timeout, waiting)

    def agree(self, name: str, value: dict) -> tuple[str, dict]:
        """Publish ``value`` as what every task must agree on under ``name`` (the first
        task's wins); returns that task and its value, to compare with ``value``."""
        if self._ps_server is not None:
            return self._ps_server.agree(name, value)
        return self._remote().client.agree(name, value)

    def abort(self, reason: str) -> None:
        """Chief: end the job after a failure; the ps tasks stop and workers that push
        afterwards fail with ``reason``."""
        self._remote().client.abort(reason)

    def lost_workers(self) -> dict[str, str]:
        return self._remote().client.lost_workers()

    def unfinished_workers(self) -> list[str]:
        """The other workers that neither finished nor were lost, so far."""
        return self._remote().client.unfinished(self._others())

    @property
    def worker_tasks(self) -> list[str]:
        """The tasks that train: ``chief:0`` (if any), then ``worker:0``, ``worker:1`` ..."""
        return list(self._worker_tasks)

    def _others(self) -> list[str]:
        me = f"{self._task_type}:{self._task_id}"
        return [t for t in self._worker_tasks if t != me]

    def rejoined_workers(self) -> list[str]:
        """Workers restarted during the job that joined it again."""
        return self._remote().client.rejoined_workers()

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
            client = self._remote().client
            try:
                self._lost = client.wait_for_workers(self._others(), timeout, report)
            except Stopped:
                self._lost = sorted(client.lost_workers())  # finish() waits no more
                raise
            self.pull()
        return self._lost

    def finish(self, timeout: float | None = None,
               report: Callable[[str, str], None] | None = None) -> list[str]:
        """End this worker's part; the chief also waits for the others (unless
        :meth:`wait_for_workers` did: ``timeout`` is its) and ends the job.

        Returns the workers that were lost (chief only).
        """
        client = self._remote().client
        lost = self.wait_for_workers(timeout, report) if self.is_chief else []
        client.publish_transfers()
        client.finish()
        if self.is_chief:
            self.transfers = client.transfers()
            self.ps_logs = client.end_job()
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
      variable_partitioner: TF's ``FixedShardsPartitioner`` or ``MinSizePartitioner``
        (:mod:`.sharded_variable`): variables split along dim 0 over the ps tasks.
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
