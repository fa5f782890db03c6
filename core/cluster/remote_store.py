"""A worker's parameter store whose central copy lives on the ps tasks.

Variables served whole are kept here too (their new values come back with each push);
embedding tables are read by rows (:mod:`.embedding_lookup`). At registration the store
makes the job's plan (:mod:`.plan`) and offers each ps its shards; at each
``optimizer.step()`` it pushes one request per ps with all of that step's gradients
(:meth:`.client.ParameterServerClient.push_pull`).
"""

from __future__ import annotations

import math
import warnings
import weakref

import torch

from ..distribute import context
from ..distribute.parameters import ParameterStore
from .client import ParameterServerClient, Push
from .coordinator import JobCoordinator
from .deferred_table import DeferredTable, deferred_tables
from .embedding_lookup import (SPARSE_OPTIMIZERS, RowTable, find_tables, is_lookup,
                               serve_by_rows, sparse_update_problem, table_label, unservable)
from .combined_optimizer import CombinedOptimizer
from .optimizer_spec import group_settings, optimizer_spec
from .plan import ShardingPlan
from .sharded_variable import Partitioner

__all__ = ["RemoteParameterStore", "check_sparse_support"]


class RemoteParameterStore(ParameterStore):
    """A worker's parameter store whose central copy lives on the parameter servers."""

    def __init__(self, parameter_device, compute_devices, copy_parameters,
                 client: ParameterServerClient, coordinator: JobCoordinator,
                 variable_placement: str, partitioner: Partitioner | None = None,
                 serve_embedding_rows: bool = True):
        super().__init__(parameter_device, compute_devices, copy_parameters)
        # Leaves of its own even for one replica: a failed run's gradients must never
        # reach the parameter servers, which other workers share
        self.direct = False
        self.client, self.coordinator = client, coordinator
        self.variable_placement = variable_placement
        self.partitioner = partitioner
        self.serve_embedding_rows = serve_embedding_rows
        self.plan: ShardingPlan | None = None
        self.dtypes: list[str] = []   # each variable's, as the checkpoint index spells it
        self._ids: dict = {}          # central tensor -> variable id (creation order)
        # the worker's optimizers, each built on the ps over its own variables (key: its
        # place here), and the groups' settings the ps have of each
        self._optimizers: list[torch.optim.Optimizer] = []
        self._sent_settings: list[list[dict]] = []
        self.colocations: dict = {}   # tensor -> tensor whose ps it must share
        self.tables: dict[int, RowTable] = {}  # var id -> served by rows
        self._sparse: set[int] = set()         # var ids of sparse=True modules
        self._whole: list[list[torch.Tensor]] = [[] for _ in range(client.num_ps)]
        self.served_whole: list[str] = []  # tables that could not be served by rows, why
        self._row_served: set[int] = set()     # ids of the tables served by rows
        self.holding: list[bool] = []           # per ps: holds any shard
        self._counting_ps = 0

    def begin_run(self, reads: bool = True):
        self.ensure_registered()
        return super().begin_run(reads)

    def stand_in(self, module, name: str, param: torch.Tensor) -> torch.Tensor | None:
        """A table that will be served by rows is not made here: its weight is a
        stand-in that records its initialization, which the ps tasks run by shard at
        registration (:mod:`.deferred_table`)."""
        if (name != "weight" or not is_lookup(module) or not self.serve_embedding_rows
                or any(self.copies) or unservable(module) is not None
                or isinstance(param, DeferredTable) or param.device.type != "cpu"
                or not param.is_floating_point() or param.dim() != 2
                or context.current_entry().replica is not None):
            return None
        return DeferredTable.standing_for(
            param, f"{type(module).__name__}({param.shape[0]}, {param.shape[1]})")

    def ensure_registered(self, initialize: bool = True) -> None:
        """Give every new variable an id and shards on the ps tasks; the first worker's
        values win. Lookup tables are then served by rows and freed here; those still
        deferred are made by the ps tasks, by shard (``initialize=False``: a checkpoint
        writes them next, nothing to run)."""
        tensors = self.tensors()
        if len(tensors) == len(self._ids):
            return
        index = {t: i for i, t in enumerate(tensors)}
        colocate = {index[t]: index[c] for t, c in self.colocations.items()
                    if t in index and c in index}
        self.plan = ShardingPlan.of(tensors, self.client.num_ps, self.variable_placement,
                                    colocate, self.partitioner)
        self._ids = index
        self.dtypes = [str(t.dtype).replace("torch.", "") for t in tensors]
        modules = self.adopted_modules()
        tables = self._tables_to_serve(modules, tensors, index)
        self._sparse = {index[m.weight] for m in modules
                        if getattr(m, "sparse", False) is True and m.weight in index}
        deferred = self._deferred(tensors, index, tables)
        held: list[list] = [[] for _ in range(self.client.num_ps)]
        self._whole = [[] for _ in range(self.client.num_ps)]
        for shard in self.plan.shards:
            tensor, flags = tensors[shard.var], {"rows": shard.var in tables}
            if shard.var in deferred:  # made there: its shape travels, no value
                piece = torch.empty((shard.stop - shard.start, *tensor.shape[1:]),
                                    dtype=tensor.dtype, device="meta")
                flags["init"] = "steps" if initialize else "restored"
            else:
                piece = tensor.detach()[shard.start:shard.stop] if tensor.dim() else \
                    tensor.detach()
            held[shard.ps].append((shard, piece, flags))
            if shard.var not in tables:
                self._whole[shard.ps].append(piece)
        self.client.register(held, self._whole, {
            var: table.initializer.to_json() for var, table in deferred.items()
            if initialize})
        for table in deferred.values():
            table.served()
        self.holding = [bool(shards) for shards in held]  # the ps tasks a push goes to
        self._counting_ps = self.holding.index(True)
        for var, module in tables.items():
            central = tensors[var]
            self.tables[var] = RowTable(var, tuple(central.shape), central.dtype,
                                        var in self._sparse, self._fetcher(var),
                                        self._assigner(var), self._weight(central),
                                        self.fetch_many, table_label(module))
            self._row_served.add(id(central))
            serve_by_rows(module, self.tables[var])
        # never served ahead to a replica: a read of one there is refused (check_device)
        self.serve_when_read(self._row_served)

    @staticmethod
    def _deferred(tensors, index, tables) -> dict[int, DeferredTable]:
        """The deferred tables the ps tasks make (var id -> stand-in); one served whole,
        or given its values, is built here first (:meth:`DeferredTable.materialize`)."""
        deferred = {}
        for table in deferred_tables(tensors):
            if index[table] in tables and table.initializer.given is None:
                deferred[index[table]] = table
            else:
                table.materialize()
        return deferred

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
            self.drop_alias_grads(serving.replica_id, self._row_served)

    # -- rows ------------------------------------------------------------------------------
    def _fetcher(self, var: int):
        def fetch(ids: torch.Tensor) -> torch.Tensor:
            return self.fetch_many([(var, ids)])[0]
        return fetch

    def fetch_many(self, wanted: list[tuple[int, torch.Tensor]]) -> list[torch.Tensor]:
        """The rows ``ids`` (sorted, unique) of each table ``var`` of ``wanted``, in one
        request per ps for all of them, every ps at once (one per dtype, if they differ)."""
        dtypes = {self.tables[var].dtype for var, _ in wanted}
        if len(dtypes) > 1:
            rows = {}
            for dtype in dtypes:
                part = [(i, w) for i, w in enumerate(wanted) if self.tables[w[0]].dtype == dtype]
                rows.update(zip([i for i, _ in part], self.fetch_many([w for _, w in part])))
            return [rows[i] for i in range(len(wanted))]
        requests: list[list] = [[] for _ in range(self.client.num_ps)]
        routed = []
        for var, ids in wanted:
            parts = [(shard, where) for shard, where in self.plan.split_rows(var, ids)
                     if where.stop > where.start]
            width = math.prod(self.plan.shapes[var][1:])
            for shard, where in parts:
                requests[shard.ps].append((shard.id, ids[where] - shard.start, width))
            routed.append(parts)
        # a step's lookups count as what it moved, not an evaluation's or a state_dict's
        # (its reads run without gradients)
        answers = self.client.lookup(requests, self.tables[wanted[0][0]].dtype,
                                     torch.is_grad_enabled())
        out = []
        for (var, ids), parts in zip(wanted, routed):
            shape = self.plan.shapes[var]
            # the shards' rows in row order (sorted ids): joined, or one shard's as it came
            pieces = [answers[shard.ps].pop(0).view(-1, *shape[1:]) for shard, _ in parts]
            out.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces
                       else torch.empty((0, *shape[1:]), dtype=self.tables[var].dtype))
        return out

    def _assigner(self, var: int):
        def assign(ids: torch.Tensor, rows: torch.Tensor) -> None:
            writes: list[list] = [[] for _ in range(self.client.num_ps)]
            for shard, where in self.plan.split_rows(var, ids):
                if where.stop > where.start:
                    writes[shard.ps].append((shard.id, ids[where] - shard.start, rows[where]))
            self.client.assign(writes)
        return assign

    def shard_devices(self, tensor: torch.Tensor) -> list[int]:
        """The ps tasks that hold ``tensor``'s shards, in row order."""
        self.ensure_registered()
        return [s.ps for s in self.plan.shards_of(self._ids[tensor])]

    # -- updates ---------------------------------------------------------------------------
    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.flush_pending()
        if isinstance(optimizer, CombinedOptimizer):
            return  # each of its optimizers pushes its own, as it steps
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if not any(self.owns(p) for p in params):
            return
        key = self.ensure_optimizer(optimizer)
        pushes = [Push() if holds else None for holds in self.holding]
        for p in params:
            if p.grad is not None and p in self._ids:
                self._add_push(pushes, self._ids[p], p.grad)
        settings = group_settings(optimizer)
        changed = settings != self._sent_settings[key]  # a schedule changed them: they travel
        # the job's step is counted once, at its first optimizer's push
        self.client.push_pull(pushes, settings if changed else [], self._whole,
                              self._counting_ps if key == 0 else -1, key)
        self._sent_settings[key] = settings
        for p in params:  # updated remotely: the local step must do nothing
            p.grad = None
        if key == 0:
            self.coordinator.stepped()

    def _add_push(self, pushes: list[Push], var: int, grad: torch.Tensor) -> None:
        """A variable's gradient to the ps tasks of its shards: dense slices, or (row
        ids, rows) of a sparse one -- to every shard, an empty part where no row fell,
        so each shard's optimizer steps as the whole variable's would."""
        if grad.layout == torch.sparse_coo:
            grad = grad.coalesce()
            ids, values = grad.indices()[0], grad.values()
            mode = "dense" if var in self.tables and not self.tables[var].sparse \
                else "sparse"
            for shard, where in self.plan.split_rows(var, ids):
                pushes[shard.ps].rows.append((shard.id, ids[where] - shard.start,
                                              values[where], mode))
        elif grad.layout != torch.strided:
            raise RuntimeError(f"variable {var} has a {grad.layout} gradient; a "
                               "parameter-server job pushes dense or sparse COO gradients")
        else:
            for shard in self.plan.shards_of(var):
                piece = grad[shard.start:shard.stop] if grad.dim() else grad
                pushes[shard.ps].dense.append((shard.id, piece))

    def ensure_optimizer(self, optimizer: torch.optim.Optimizer) -> int:
        """Build ``optimizer``'s twin on every ps (once; its state lives there) over the
        variables it trains; returns its key. A :class:`.CombinedOptimizer`: each of its
        optimizers."""
        self.ensure_registered()
        if isinstance(optimizer, CombinedOptimizer):
            for inner in optimizer.optimizers:
                self.ensure_optimizer(inner)
            return -1
        if any(optimizer is o for o in self._optimizers):
            return next(k for k, o in enumerate(self._optimizers) if o is optimizer)
        groups = {self._ids[p]: g for g, group in enumerate(optimizer.param_groups)
                  for p in group["params"] if p in self._ids}
        taken = {self._ids[p] for o in self._optimizers for g in o.param_groups
                 for p in g["params"] if p in self._ids}
        if taken & set(groups):
            raise RuntimeError(
                f"{self._name(min(taken & set(groups)))} is trained by two optimizers "
                f"({type(optimizer).__name__} and an earlier one); in a ParameterServerStrategy "
                "job each variable's optimizer state lives on its ps: give each parameter "
                "to one optimizer")
        check_sparse_support(optimizer, [self._name(v) for v in sorted(self._sparse)
                                         if v in groups])
        key = len(self._optimizers)
        spec = optimizer_spec(optimizer, groups, key)
        self.client.register_optimizer(spec)
        self._optimizers.append(optimizer)
        self._sent_settings.append(spec["groups"])
        for p in list(optimizer.state):  # kept on the ps: none of it here (Adagrad's
            if id(p) in self._row_served:  # sums of a table are a table)
                del optimizer.state[p]
        return key

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
