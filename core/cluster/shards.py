"""What a ps task holds: its shards of the variables and the optimizer state of each, and
how a request reads or changes them.

Pushes are applied one at a time (the optimizer's state must not be stepped by two at
once): that and registration take the lock. Lookups and the values a reply carries
read without it, as TF's ps reads do: a read during an update may see some rows new,
others old (asynchronous training; one worker alone never meets an update it did not
wait for). Sparse rows are applied as the optimizer's sparse update; a table the model
reads densely (``sparse=False``) too, when that is exact
(:func:`.optimizer_spec.sparse_exact`: Adagrad, SGD), and otherwise through one
gradient buffer per table that only the pushed rows are written into and cleared in.
"""

from __future__ import annotations

import collections
import pathlib
import threading

import torch

from .initializers import RANDOM_STEPS, TableInitializer, chunking_holds
from .optimizer_spec import (OptimizerRefused, apply_settings, built, optimizer_class,
                             sparse_exact)
from .row_updates import row_update_exact, row_updater
from .shard_files import ShardFile, ShardFileError, write_file
from .transport import (Gathered, flat_by_dtype, settings_from_json, unflatten_into,
                        views_like)

__all__ = ["HeldShards", "Refused", "LOG_LIMIT"]

LOG_LIMIT = 10_000  # applied pushes a ps remembers in order (the newest)


class Refused(Exception):
    """A worker's request that cannot be served (its model is not the job's)."""


def _rows_like(table: torch.Tensor, count: int) -> torch.Tensor:
    """What ``count`` rows of ``table`` look like (no memory): to cut received buffers."""
    return torch.empty((count, *table.shape[1:]), dtype=table.dtype, device="meta")


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a copy when it shares a larger storage (a view into a buffer)."""
    shared = tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size()
    return tensor.clone() if shared else tensor


def _sparse(ids: torch.Tensor, values: torch.Tensor, shape) -> torch.Tensor:
    # the ids are unique and sorted: the worker coalesced the gradient, and the ps checked
    # every id against the shard's rows (_checked_rows), so torch's invariant check would
    # only repeat ours; it is disabled for this tensor alone (and warns of that otherwise)
    return torch.sparse_coo_tensor(ids.unsqueeze(0), values, shape, is_coalesced=True,
                                   check_invariants=False)


class HeldShards:
    """One ps task's shards (by shard id), their optimizers and their books."""

    def __init__(self, task_id: int):
        self.task_id = task_id
        self._vars: dict[int, torch.Tensor] = {}   # shard id -> its rows
        self._specs: dict[int, dict] = {}          # shard id -> var, start, rows?, group
        self._whole: list[torch.Tensor] = []       # shards served whole, by id (pulled)
        # the worker's optimizers by key (per-table optimizers: SparseAdam for the tables
        # beside AdamW for the rest), each over the shards of its own variables
        self._optimizers: dict[int, torch.optim.Optimizer | None] = {}  # None: none here
        self._group_index: dict[int, list[int]] = {}  # key -> the worker's group of ours
        self._group_of: dict[int, dict] = {}       # id(shard) -> its optimizer group
        self._owner: dict[int, torch.optim.Optimizer] = {}  # id(shard) -> its optimizer
        self._made: dict[int, tuple] = {}          # key -> (class, its variables)
        self._sparse_exact: dict[int, bool] = {}      # id(group) -> sparse_exact()
        self._rows_exact: dict[int, bool] = {}  # id(group) -> row_update_exact()
        self._buffers: dict[int, torch.Tensor] = {}  # shard id -> dense gradient buffer
        self._lock = threading.Lock()
        self.version = 0
        # (worker, version) of the newest applied pushes, and every worker's count: what the
        # chief reports, bounded however long the job runs
        self.log: collections.deque[tuple[str, int]] = collections.deque(maxlen=LOG_LIMIT)
        self.updates: dict[str, int] = {}

    # -- registration ----------------------------------------------------------------------
    def register(self, meta: dict, flats: list[torch.Tensor]) -> dict:
        """The first worker's values initialize the shards; later ones take them. A
        worker offers its values only when asked (``need_values``): a table of a GiB is
        not sent by every worker."""
        specs = sorted(meta["shards"], key=lambda v: v["id"])
        with self._lock:
            if self._vars:
                self._check_same_model(specs)
                return {"need_values": False}
            if not meta.get("with_values"):
                return {"need_values": True}
            given = [v for v in specs if not v.get("init")]
            if meta["with_values"] == "per_shard":  # the received buffers themselves,
                # or, when they came packed in one receive buffer, copies: a shard must
                # not keep that buffer (Channel.recv's, PACK_BYTES) alive
                made = {v["id"]: _own(f).view(v["shape"]) for v, f in zip(given, flats)}
            else:
                made = {v["id"]: torch.empty(v["shape"], dtype=getattr(torch, v["dtype"]))
                        for v in given}
                unflatten_into(list(made.values()), flats)
            made.update(_initialized(specs, meta.get("initializers", {})))
            for spec in specs:
                tensor = made[spec["id"]]
                self._vars[spec["id"]] = tensor.requires_grad_(tensor.is_floating_point())
                self._specs[spec["id"]] = spec
            self._whole = [self._vars[i] for i in sorted(self._vars)
                           if not self._specs[i]["rows"]]
            return {"need_values": False}

    def _check_same_model(self, specs: list[dict]) -> None:
        """A worker whose model (or partitioning) differs from the first one's would push
        gradients that do not fit: refuse it, naming the first shard that differs."""
        def key(spec):
            return (spec["var"], spec["start"], spec["dtype"], list(spec["shape"]))
        theirs = {v["id"]: key(v) for v in specs}
        ours = {i: key(v) for i, v in self._specs.items()}
        for shard in sorted(set(ours) | set(theirs)):
            if ours.get(shard) != theirs.get(shard):
                def shown(spec):
                    return (f"variable {spec[0]} from row {spec[1]}: {spec[2]} {spec[3]}"
                            if spec else "nothing")
                raise Refused(
                    f"this worker's model or partitioning differs from the job's: shard "
                    f"{shard} on ps:{self.task_id} is {shown(ours.get(shard))} in the job, "
                    f"{shown(theirs.get(shard))} here; every task must build the same "
                    "model with the same strategy.variable_partitioner")

    def make_optimizer(self, spec: dict) -> None:
        """Build the worker's optimizer ``spec["key"]`` over the shards of its variables
        (once: every worker registers it)."""
        key = int(spec.get("key", 0))
        made = (spec["class"], sorted(int(v) for v in spec.get("var_groups", {})))
        with self._lock:
            if key in self._optimizers and self._made[key] != made:
                raise Refused(f"this worker's optimizer {key} is {made[0]} over variables "
                              f"{made[1][:5]}, the job's {self._made[key][0]} over "
                              f"{self._made[key][1][:5]}: every worker must make the same "
                              "optimizers, and step them first in the same order")
            if key in self._optimizers or not self._vars:
                return
            self._made[key] = made
            try:
                cls = optimizer_class(spec["class"])
            except OptimizerRefused as exc:
                raise Refused(str(exc)) from None
            var_groups = {int(k): g for k, g in spec.get("var_groups", {}).items()}
            mine = {i: var_groups[s["var"]] for i, s in self._specs.items()
                    if s["var"] in var_groups}
            taken = [i for i in mine if id(self._vars[i]) in self._owner]
            if taken:
                raise Refused(f"variable {self._specs[taken[0]]['var']} is in two of the "
                              "worker's optimizers; give each parameter to one optimizer")
            groups, self._group_index[key] = [], []
            for index, settings in enumerate(spec["groups"]):
                params = [self._vars[i] for i in sorted(mine) if mine[i] == index]
                if params:
                    groups.append({**settings_from_json(settings), "params": params})
                    self._group_index[key].append(index)
            if not groups:  # none of its variables is on this ps: its pushes are empty
                self._optimizers[key] = None
                return
            optimizer = built(cls, groups, settings_from_json(spec["defaults"]))
            self._optimizers[key] = optimizer
            for group in optimizer.param_groups:
                self._sparse_exact[id(group)] = sparse_exact(cls, group)
                self._rows_exact[id(group)] = row_update_exact(cls, group)
                for p in group["params"]:
                    self._group_of[id(p)], self._owner[id(p)] = group, optimizer

    # -- reads and writes ------------------------------------------------------------------
    def values(self) -> list[torch.Tensor]:
        """The values of the shards served whole (a worker reads table rows by lookups)."""
        return flat_by_dtype(self._whole) if self._whole else []

    def lookup(self, meta: dict, ids: torch.Tensor) -> list[torch.Tensor]:
        """The rows ``ids`` (shard-local) of each requested shard, in request order."""
        requested = self._requested(meta, ids)
        if len({table.dtype for table, _ in requested}) != 1:  # none, or mixed dtypes
            return flat_by_dtype([t.detach().index_select(0, w) for t, w in requested])
        # gathered straight into the reply message (a worker asks one dtype at a time)
        return [Gathered(requested)]

    def assign(self, meta: dict, ids: torch.Tensor, flats: list[torch.Tensor]) -> None:
        """Write rows of tables (a worker's ``load_state_dict``)."""
        requested = self._requested(meta, ids)
        shapes = [_rows_like(t, len(w)) for t, w in requested]
        with self._lock, torch.no_grad():
            for (table, wanted), rows in zip(requested, views_like(shapes, flats)):
                table.index_copy_(0, wanted, rows)

    def _requested(self, meta: dict, ids: torch.Tensor) -> list[tuple]:
        """(table shard, shard-local row ids) per request, each checked."""
        requested, offset = [], 0
        for shard, count in meta["shards"]:
            table = self._vars.get(shard)
            if table is None or not self._specs[shard]["rows"]:
                raise Refused(f"ps:{self.task_id} serves no table rows as shard {shard}")
            wanted = ids[offset:offset + count]
            offset += count
            self._checked_rows(shard, table, wanted)
            requested.append((table, wanted))
        return requested

    def _checked_rows(self, shard: int, table: torch.Tensor, ids: torch.Tensor) -> None:
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= table.shape[0]):
            raise Refused(f"a request for shard {shard} names rows outside "
                          f"0..{table.shape[0] - 1}")

    # -- updates ---------------------------------------------------------------------------
    def apply(self, meta: dict, ids: torch.Tensor, flats: list[torch.Tensor],
              worker: str) -> None:
        """Apply one worker's push: dense gradients of whole shards, and (row ids, rows)
        of others (the lock covers the optimizer's step and nothing else)."""
        key = int(meta.get("optimizer", 0))
        if key not in self._optimizers:
            raise Refused(f"a gradient arrived before its optimizer ({key}) was registered")
        dense = [self._vars[i] for i in meta["dense"]]
        rows = meta.get("rows", [])
        shapes = dense + [_rows_like(self._vars[s], n) for s, n, _ in rows]
        grads = views_like(shapes, flats)  # the received buffers themselves, no copy
        row_grads, offset = [], 0
        for (shard, count, mode), values in zip(rows, grads[len(dense):]):
            wanted = ids[offset:offset + count]
            offset += count
            self._checked_rows(shard, self._vars[shard], wanted)
            row_grads.append((shard, wanted, values, mode))
        with self._lock:
            if self._optimizers[key] is not None:
                self._step(self._optimizers[key], dense, grads, row_grads, meta)
            self.version += 1
            self.log.append((worker, self.version))
            self.updates[worker] = self.updates.get(worker, 0) + 1

    def _step(self, optimizer: torch.optim.Optimizer, dense: list, grads: list,
              row_grads: list, meta: dict) -> None:
        for tensor in self._vars.values():
            tensor.grad = None
        for tensor, grad in zip(dense, grads):
            tensor.grad = grad
        key = int(meta.get("optimizer", 0))
        apply_settings(optimizer, self._group_index[key], meta.get("settings") or [])
        written, by_rows = [], []
        for shard, wanted, values, mode in row_grads:
            table = self._vars[shard]
            group = self._group_of[id(table)]
            if mode == "sparse" or self._sparse_exact[id(group)]:
                update = row_updater(optimizer, group, table) \
                    if self._rows_exact.get(id(group)) else None
                if update is not None:  # torch's sparse update, on the rows alone
                    by_rows.append((update, wanted, values))
                    continue
                table.grad = _sparse(wanted, values, table.shape)
            else:  # the dense gradient those rows stand for, zero elsewhere
                buffer = self._buffers.get(shard)
                if buffer is None:
                    buffer = self._buffers[shard] = torch.zeros_like(table)
                table.grad = buffer.index_copy_(0, wanted, values)
                written.append((buffer, wanted))
        try:
            # torch warns that its sparse invariant checks are off, once per process, when
            # an optimizer rebuilds a sparse tensor from ours: every id was checked here
            # (_checked_rows), so the check is off knowingly for this step alone
            with torch.sparse.check_sparse_tensor_invariants(enable=False):
                optimizer.step()
            for update, wanted, values in by_rows:
                update(wanted, values)
        except (RuntimeError, ValueError) as exc:  # e.g. no sparse update for a setting
            raise RuntimeError(f"cannot apply the update with "
                               f"{type(optimizer).__name__}: {exc}") from None
        finally:
            for buffer, wanted in written:
                buffer.index_fill_(0, wanted, 0)

    # -- what it holds ---------------------------------------------------------------------
    def held_bytes(self) -> int:
        """Bytes of the shards and their optimizer state this ps holds."""
        total = sum(t.numel() * t.element_size() for t in self._vars.values())
        for slots in (v for o in self._optimizers.values() if o
                      for v in o.state.values()):
            total += sum(v.numel() * v.element_size() for v in slots.values()
                         if isinstance(v, torch.Tensor))
        return total

    def report(self) -> dict:
        """What the chief reports of this ps at the end."""
        with self._lock:
            return {"updates": dict(self.updates), "recent": list(self.log),
                    "held_bytes": self.held_bytes(), "shards": len(self._vars)}

    def state_dict(self) -> dict:
        """Values by shard id, the optimizer's state, and which shard each of its
        parameter indexes is (``order``), for :mod:`.sharded_state`."""
        with self._lock:
            if len(self._optimizers) > 1:
                raise Refused("a job with more than one optimizer keeps its optimizer "
                              "state in checkpoints by shard (save_shards), not whole")
            optimizer = self._optimizers.get(0)
            shard_of = {id(t): i for i, t in self._vars.items()}
            order = [shard_of[id(p)] for g in optimizer.param_groups
                     for p in g["params"]] if optimizer else []
            return {"values": {i: t.detach().clone() for i, t in self._vars.items()},
                    "optimizer": optimizer.state_dict() if optimizer else None,
                    "order": order, "groups": list(self._group_index.get(0, [])),
                    "version": self.version}

    # -- checkpoints by shard --------------------------------------------------------------
    def save(self, folder: pathlib.Path, name: str) -> dict:
        """Write this ps's shards and their optimizer slots to ``folder/name`` (the apply
        lock held: values and slots of one version); returns the file's record and what
        it holds (``shards``: key, variable, first row, rows, shape, dtype, slots)."""
        with self._lock:
            tensors, entries = {}, []
            for shard, table in sorted(self._vars.items()):
                spec, key = self._specs[shard], f"s{shard}"
                tensors[key] = table.detach()
                slots = {}
                for slot, value in self._slots_of(table).items():
                    if isinstance(value, torch.Tensor):
                        tensors[f"{key}/{slot}"], slots[slot] = value.detach(), "tensor"
                    elif isinstance(value, (bool, int, float)):
                        kind = "int" if isinstance(value, int) else "float"
                        tensors[f"{key}/{slot}"] = torch.tensor(
                            value, dtype=torch.int64 if kind == "int" else torch.float64)
                        slots[slot] = kind
                entries.append({"key": key, "var": spec["var"], "start": spec["start"],
                                "rows": spec["shape"][0] if spec["shape"] else 1,
                                "shape": list(spec["shape"]), "dtype": spec["dtype"],
                                "slots": slots})
            meta = {"ps": self.task_id, "version": self.version, "shards": entries}
            record = write_file(folder, name, tensors, meta)
        return {**record, "ps": self.task_id, "version": self.version, "shards": entries}

    def _slots_of(self, table: torch.Tensor) -> dict:
        owner = self._owner.get(id(table))
        return owner.state.get(table, {}) if owner is not None else {}

    def restore(self, folder: pathlib.Path, sources: list[dict], version: int) -> None:
        """Take every shard's rows and slots from the checkpoint files ``sources`` (each
        ``{"file", "sha256", "shards": [...]}``, as :meth:`save` described them, whatever
        ps or sharding wrote them): only the rows this ps holds are read."""
        with self._lock, torch.no_grad():
            opened: dict[str, ShardFile] = {}
            for shard, table in self._vars.items():
                spec = self._specs[shard]
                start, stop = spec["start"], spec["start"] + (spec["shape"][0]
                                                             if spec["shape"] else 1)
                slots: dict = {}
                for source, entry in _overlapping(sources, spec["var"], start, stop):
                    if source["file"] not in opened:
                        opened[source["file"]] = ShardFile(folder / source["file"],
                                                           source["sha256"])
                    self._restore_rows(opened[source["file"]], entry, table, start, stop,
                                       slots)
                if slots and id(table) in self._owner:
                    self._owner[id(table)].state[table] = slots
            self.version = version

    def _restore_rows(self, file: ShardFile, entry: dict, table: torch.Tensor, start: int,
                      stop: int, slots: dict) -> None:
        """The rows of ``entry`` (a saved shard) that fall in ``start:stop`` into
        ``table`` (this ps's shard from ``start``), and into ``slots`` its optimizer's."""
        a, b = max(start, entry["start"]), min(stop, entry["start"] + entry["rows"])
        key, local = entry["key"], (a - entry["start"], b - entry["start"])
        if key not in file.keys:
            raise ShardFileError(f"checkpoint file {str(file.path)!r} holds no {key}, which "
                                 "its index lists")
        if file.shape(key) != entry["shape"]:  # e.g. a table with 999 of its 1000 rows
            raise ShardFileError(f"checkpoint file {str(file.path)!r}: {key} has shape "
                                 f"{file.shape(key)}, its index says {entry['shape']}")
        if table.dim():
            table[a - start:b - start] = file.rows(key, *local)
        else:
            table.copy_(file.rows(key, 0, 1))
        for slot, kind in entry["slots"].items():
            saved = f"{key}/{slot}"
            if saved not in file.keys:
                raise ShardFileError(f"checkpoint file {str(file.path)!r} lacks {saved}, "
                                     "which its index lists")
            if kind != "tensor":
                value = file.rows(saved, 0, 0)
                slots.setdefault(slot, int(value) if kind == "int" else float(value))
            elif file.shape(saved) == entry["shape"] and table.dim():
                into = slots.setdefault(slot, torch.zeros_like(table))
                into[a - start:b - start] = file.rows(saved, *local)
            else:  # a per-variable scalar (a step count): the same in every shard
                slots.setdefault(slot, file.rows(saved, 0, 0).clone())

    def load_state_dict(self, state: dict) -> None:
        with self._lock, torch.no_grad():
            for i, value in state["values"].items():
                self._vars[int(i)].copy_(value)
            if state.get("optimizer") is not None and 0 in self._optimizers:
                self._optimizers[0].load_state_dict(state["optimizer"])
            self.version = int(state.get("version", 0))


def _initialized(specs: list[dict], initializers: dict) -> dict[int, torch.Tensor]:
    """The shards a worker sent no values for, made here (shard id -> rows): by their
    variable's initializer (:mod:`.initializers`), each table's steps run once over all
    of its shards on this ps; or left for a restore to write (``init: restored``)."""
    made, by_var = {}, {}
    for spec in specs:
        if spec.get("init"):
            made[spec["id"]] = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]))
            if spec["init"] == "steps":
                by_var.setdefault(spec["var"], []).append((spec["start"], made[spec["id"]]))
    with torch.no_grad():
        for var, pieces in by_var.items():
            initializer = TableInitializer.from_json(initializers[str(var)])
            for step in initializer.steps:  # this ps's torch must draw as the worker's
                if step["op"] in RANDOM_STEPS and not chunking_holds(step["op"],
                                                                      initializer.dtype):
                    raise RuntimeError(f"this ps's torch {torch.__version__} draws "
                                       f"{step['op']}_ in chunks otherwise than whole; run "
                                       "the job with serve_embedding_rows false")
            initializer.fill(pieces)
    return made


def _overlapping(sources: list[dict], var: int, start: int, stop: int):
    """(source, entry) of every saved shard of variable ``var`` with rows in
    ``start:stop``, in row order."""
    found = [(entry["start"], source, entry) for source in sources
             for entry in source["shards"] if entry["var"] == var
             and entry["start"] < stop and entry["start"] + entry["rows"] > start
             or entry["var"] == var and entry["rows"] == 0 == stop - start]
    return [(source, entry) for _, source, entry in sorted(found, key=lambda f: f[0])]
