"""A ``ps`` task's server: its shard of the variables, updated asynchronously by workers.

Each ps task holds its shard of the variables and an optimizer over them (optimizer state
lives with its variable). A worker pushes its summed gradients to the ps that owns each
variable and receives the updated values in the same round trip. The ps applies pushes
in the order they arrive, one at a time: workers are asynchronous to each other. It
serves each worker incarnation on a thread of its own, over a :class:`.transport.Channel`.
"""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid

import torch

from .heartbeat import ChiefGone, ChiefWatch
from .resolvers import ClusterResolver
from .transport import (ABORTED, ASSIGN, BYE, FOREVER, LOAD, LOOKUP, OPTIMIZER, PULL, PUSH_PULL,
                        REFUSED, REGISTER, STATE, BoundedStore, Channel, DuplicateTask, agree,
                        connect_store, decode, encode, flat_by_dtype, gloo_device, pack_state,
                        poll_until, settings_from_json, store_host, transport_error,
                        unflatten_into, unpack_state, views_like)

__all__ = ["ParameterServer"]


LOG_LIMIT = 10_000  # applied pushes a ps remembers in order (the newest)


class _Refused(Exception):
    """A worker's request that cannot be served (its model is not the job's)."""


class _Failed(Exception):
    """A worker's update that the ps could not apply (the job cannot go on with it)."""


def _rows_like(table: torch.Tensor, count: int) -> torch.Tensor:
    """What ``count`` rows of ``table`` look like (no memory): to cut received buffers."""
    return torch.empty((count, *table.shape[1:]), dtype=table.dtype, device="meta")


class ParameterServer:
    """A ``ps`` task: holds a shard of the variables and applies pushed gradients."""

    def __init__(self, resolver: ClusterResolver, timeout: float = 60.0,
                 stop: threading.Event | None = None, chief: str | None = None):
        """``stop``: set (by a signal), it ends the wait for the store; ``chief``: the
        task whose heartbeat ends the job when it stops (see :mod:`.heartbeat`)."""
        if resolver.task_type != "ps":
            raise ValueError(f"task {resolver.task_type}:{resolver.task_id} is not a ps task")
        self.task_id = resolver.task_id
        address = resolver.cluster_spec().task_address("ps", 0)
        self._store = BoundedStore(connect_store(resolver, resolver.task_id == 0, timeout,
                                                 stop),
                                   timeout, f"the cluster's store at ps:0 ({address})")
        self._claim()
        self._watch = ChiefWatch(self._store, chief, timeout) if chief else None
        self._device = gloo_device(store_host(resolver))
        self._vars: dict[int, torch.Tensor] = {}   # shard id -> its rows
        self._specs: dict[int, dict] = {}          # shard id -> var, start, rows?, group
        self._group_of: dict[int, dict] = {}       # id(shard) -> its optimizer group
        self._whole: list[torch.Tensor] = []       # shards served whole, by id (pulled)
        self._optimizer = None
        self._lock = threading.Lock()
        self.version = 0
        # (worker, version) of the newest applied pushes, and every worker's count: what the
        # chief reports, bounded however long the job runs
        self.log: collections.deque[tuple[str, int]] = collections.deque(maxlen=LOG_LIMIT)
        self.updates: dict[str, int] = {}
        self._aborted: str | None = None  # why the chief ended the job after a failure
        self._threads: list[threading.Thread] = []
        self._joined = 0  # workers accepted so far (the store counts those that asked)

    def _claim(self) -> None:
        """Be the one process of this ps task, or raise :class:`DuplicateTask`: a second
        ps:1 took the workers' joins too and served until the job ended, then failed."""
        mine = f"ps#{uuid.uuid4().hex}"
        if self._store.compare_set(f"owner/ps:{self.task_id}", "", mine).decode() != mine:
            raise DuplicateTask(f"ps:{self.task_id} is already running in this job: another "
                                f"process was started as ps:{self.task_id}; start each task "
                                "once")

    # -- serving ---------------------------------------------------------------------------
    def serve(self, poll: float = 0.02, close_timeout: float = 60.0,
              stop: threading.Event | None = None, grace: float = 60.0) -> bool:
        """Accept workers and answer them until the chief marks the job done.

        Once ``stop`` is set (a first Ctrl-C or SIGTERM), the ps serves on for at most
        ``grace`` seconds, so that the workers can stop cleanly and the chief can write
        its last checkpoint. Returns True when the chief ended the job, False when the
        grace ran out first.
        """
        self._store.set(f"ps/{self.task_id}/ready", "1")

        def done() -> bool:
            self._accept_joins()
            if self._watch is not None:
                self._watch.check()
            return self._store.check(["job/done"])

        stopping = stop.is_set if stop is not None else lambda: False
        try:
            poll_until(lambda: done() or stopping(), poll=poll)
            if not poll_until(done, time.monotonic() + grace, poll):
                return False
        except ChiefGone as exc:  # nobody will end the job: end it, and tell the workers
            self._store.set("job/aborted", str(exc)[:500])
            self._store.set("job/done", "1")
            self._aborted = str(exc)
            self._close(poll, close_timeout)
            raise
        self._close(poll, close_timeout)
        return True

    def agree(self, name: str, value: dict) -> tuple[str, dict]:
        """Publish what every task must agree on (:func:`~.transport.agree`)."""
        return agree(self._store, name, f"ps:{self.task_id}", value)

    def _accept_joins(self) -> None:
        joined = self._store.add(f"ps/{self.task_id}/joins", 0)
        while self._joined < joined:
            self._joined += 1
            name = self._store.get(f"ps/{self.task_id}/join/{self._joined}").decode()
            thread = threading.Thread(target=self._connection, args=(name,), daemon=True,
                                      name=f"csrun-ps{self.task_id}-{name}")
            thread.start()
            self._threads.append(thread)

    def _close(self, poll: float, close_timeout: float) -> None:
        if self._aborted is not None or self._store.check(["job/aborted"]):
            # the chief failed (or is gone): tell the workers why
            if self._aborted is None:
                self._aborted = f"the chief ended the job: " \
                    f"{self._store.get('job/aborted').decode()}"
            deadline = time.monotonic() + 10.0
            for thread in self._threads:  # each ends when its worker hears and exits
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            return
        for thread in self._threads:  # workers said goodbye or died; let the threads end
            thread.join(timeout=5)
        with self._lock:
            self._store.set(f"ps/{self.task_id}/log", json.dumps(
                {"updates": self.updates, "recent": list(self.log),
                 "held_bytes": self.held_bytes(), "shards": len(self._vars)}))
        self._store.set(f"ps/{self.task_id}/stopped", "1")
        if self.task_id == 0:  # the store lives here: stay until the chief is done with it
            poll_until(lambda: self._store.check(["job/closed"]),
                       time.monotonic() + close_timeout, poll)

    def _connection(self, name: str) -> None:
        worker = name.rsplit("#", 1)[0]
        try:
            channel = Channel(self._store.raw, f"chan/{self.task_id}/{name}", 0, FOREVER,
                              self._device)
            while True:
                op, payload = channel.recv()
                if op == BYE:
                    self._store.set(f"finished/{worker}", "1")
                    return
                if self._aborted is not None:
                    channel.send(ABORTED, [encode(self._aborted)])
                    continue
                try:
                    answer = self._answer(op, payload, worker)
                except _Refused as refused:
                    channel.send(REFUSED, [encode(str(refused))])
                    continue
                except _Failed as failed:  # the worker fails with it (exit 1)
                    channel.send(ABORTED, [encode(str(failed))])
                    continue
                channel.send(op, answer)
        except RuntimeError as exc:  # the peer died or its connection broke
            # which incarnation died: a restarted worker (a later one) is not lost
            self._store.set(f"lost_incarnation/{worker}", name.rsplit("#", 1)[1])
            self._store.set(f"lost/{worker}",
                            f"ps:{self.task_id} lost {name}: {transport_error(exc)}"[:500])

    def _answer(self, op: int, payload: list[torch.Tensor], worker: str) -> list[torch.Tensor]:
        with self._lock:
            if op == REGISTER:
                return self._register(decode(payload[0]), payload[1:])
            if op == LOOKUP:
                return self._lookup(decode(payload[0]), payload[1])
            if op == ASSIGN:
                self._assign(decode(payload[0]), payload[1], payload[2:])
                return []
            if op == OPTIMIZER:
                self._make_optimizer(decode(payload[0]))
            elif op == PUSH_PULL:
                self._apply(decode(payload[0]), payload[1], payload[2:], worker)
            elif op == STATE:
                return [pack_state(self.state_dict())]
            elif op == LOAD:
                self.load_state_dict(unpack_state(payload[0]))
            elif op != PULL:
                raise RuntimeError(f"unknown message {op}")
            return self._values()

    # -- variables -------------------------------------------------------------------------
    def _values(self) -> list[torch.Tensor]:
        """The values of the shards served whole (a worker reads table rows by lookups)."""
        return flat_by_dtype(self._whole) if self._whole else []

    def _register(self, meta: dict, flats: list[torch.Tensor]) -> list[torch.Tensor]:
        """The first worker's values initialize the shards; later ones take them. A
        worker offers its values only when asked (``need_values``): a table of a GiB is
        not sent by every worker."""
        specs = sorted(meta["shards"], key=lambda v: v["id"])
        if self._vars:
            self._check_same_model(specs)
            return [encode({"need_values": False})] + self._values()
        if not meta.get("with_values"):
            return [encode({"need_values": True})]
        if meta["with_values"] == "per_shard":  # the received buffers themselves
            variables = [f.view(v["shape"]) for v, f in zip(specs, flats)]  # id order
        else:
            variables = [torch.empty(v["shape"], dtype=getattr(torch, v["dtype"]))
                         for v in specs]
            unflatten_into(variables, flats)
        for spec, tensor in zip(specs, variables):
            self._vars[spec["id"]] = tensor.requires_grad_(tensor.is_floating_point())
            self._specs[spec["id"]] = spec
        self._whole = [self._vars[i] for i in sorted(self._vars) if not self._specs[i]["rows"]]
        return [encode({"need_values": False})] + self._values()

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
                raise _Refused(
                    f"this worker's model or partitioning differs from the job's: shard "
                    f"{shard} on ps:{self.task_id} is {shown(ours.get(shard))} in the job, "
                    f"{shown(theirs.get(shard))} here; every task must build the same "
                    "model with the same strategy.variable_partitioner")

    def _lookup(self, meta: dict, ids: torch.Tensor) -> list[torch.Tensor]:
        """The rows ``ids`` (shard-local) of each requested shard, in request order."""
        rows = [table.detach().index_select(0, wanted)
                for table, wanted in self._requested(meta, ids)]
        return flat_by_dtype(rows) if rows else []

    def _assign(self, meta: dict, ids: torch.Tensor, flats: list[torch.Tensor]) -> None:
        """Write rows of tables (a worker's ``load_state_dict``)."""
        requested = self._requested(meta, ids)
        shapes = [_rows_like(t, len(w)) for t, w in requested]
        with torch.no_grad():
            for (table, wanted), rows in zip(requested, views_like(shapes, flats)):
                table.index_copy_(0, wanted, rows)

    def _requested(self, meta: dict, ids: torch.Tensor) -> list[tuple]:
        """(table shard, shard-local row ids) per request, each checked."""
        requested, offset = [], 0
        for shard, count in meta["shards"]:
            table = self._vars.get(shard)
            if table is None or not self._specs[shard]["rows"]:
                raise _Refused(f"ps:{self.task_id} serves no table rows as shard {shard}")
            wanted = ids[offset:offset + count]
            offset += count
            if count and (int(wanted.min()) < 0 or int(wanted.max()) >= table.shape[0]):
                raise _Refused(f"a request for shard {shard} names rows outside "
                               f"0..{table.shape[0] - 1}")
            requested.append((table, wanted))
        return requested

    def _make_optimizer(self, spec: dict) -> None:
        if self._optimizer is not None or not self._vars:
            return
        cls = getattr(torch.optim, spec["class"], None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise _Refused(f"optimizer {spec['class']!r} is not a torch.optim optimizer")
        var_groups = {int(k): g for k, g in spec.get("var_groups", {}).items()}
        for shard_spec in self._specs.values():
            shard_spec["group"] = var_groups.get(shard_spec["var"], 0)
        groups, self._group_index = [], []
        for index, settings in enumerate(spec["groups"]):
            params = [self._vars[i] for i in sorted(self._vars)
                      if self._specs[i]["group"] == index]
            if params:
                groups.append({**settings_from_json(settings), "params": params})
                self._group_index.append(index)
        self._optimizer = cls(groups, **settings_from_json(spec["defaults"]))
        self._group_of = {id(p): g for g in self._optimizer.param_groups for p in g["params"]}

    def _apply(self, meta: dict, ids: torch.Tensor, flats: list[torch.Tensor],
               worker: str) -> None:
        """Apply one worker's push: dense gradients of whole shards, and (row ids, rows)
        of others, then count it (the counting ps also keeps the job's step books)."""
        if self._optimizer is None:
            raise _Refused("a gradient arrived before the optimizer was registered")
        dense = [self._vars[i] for i in meta["dense"]]
        rows = meta.get("rows", [])
        shapes = dense + [_rows_like(self._vars[s], n) for s, n, _ in rows]
        grads = views_like(shapes, flats)  # the received buffers themselves, no copy
        for tensor in self._vars.values():
            tensor.grad = None
        for tensor, grad in zip(dense, grads):
            tensor.grad = grad
        offset = 0
        for (shard, count, mode), values in zip(rows, grads[len(dense):]):
            table = self._vars[shard]
            table.grad = self._row_grad(table, ids[offset:offset + count], values, mode)
            offset += count
        lrs = meta.get("lrs", [])
        for group, index in zip(self._optimizer.param_groups, self._group_index):
            if index < len(lrs):  # the worker's LR schedule drives the ps's optimizer
                group["lr"] = lrs[index]
        try:
            self._optimizer.step()
        except (RuntimeError, ValueError) as exc:  # e.g. no sparse update for a setting
            raise _Failed(f"ps:{self.task_id} cannot apply the update with "
                           f"{type(self._optimizer).__name__}: {exc}") from None
        self.version += 1
        self.log.append((worker, self.version))
        self.updates[worker] = self.updates.get(worker, 0) + 1
        if meta.get("count"):  # counted where it was applied: the books agree exactly
            self._store.add(f"steps/{worker}", 1)
            self._store.add("global_step", 1)

    def _row_grad(self, table: torch.Tensor, ids: torch.Tensor, values: torch.Tensor,
                  mode: str) -> torch.Tensor:
        """The gradient of pushed rows: sparse (the optimizer's sparse update, as torch
        applies a ``sparse=True`` embedding's), or, for a table the model reads densely,
        the dense gradient those rows stand for -- zero elsewhere, so every row steps as
        in a plain loop (plain SGD moves only those rows either way: given sparse)."""
        group = self._group_of[id(table)]
        plain_sgd = isinstance(self._optimizer, torch.optim.SGD) and \
            not group.get("momentum") and not group.get("weight_decay")
        if mode == "sparse" or plain_sgd:
            return torch.sparse_coo_tensor(ids.unsqueeze(0), values, table.shape,
                                           is_coalesced=True, check_invariants=False)
        return torch.zeros_like(table).index_add_(0, ids, values)

    def held_bytes(self) -> int:
        """Bytes of the shards and their optimizer state this ps holds."""
        total = sum(t.numel() * t.element_size() for t in self._vars.values())
        state = self._optimizer.state.values() if self._optimizer is not None else ()
        for slots in state:
            total += sum(v.numel() * v.element_size() for v in slots.values()
                         if isinstance(v, torch.Tensor))
        return total

    def state_dict(self) -> dict:
        """Values by shard id, the optimizer's state, and which shard each of its
        parameter indexes is (``order``), for :mod:`.sharded_state`."""
        shard_of = {id(t): i for i, t in self._vars.items()}
        order = [shard_of[id(p)] for g in self._optimizer.param_groups
                 for p in g["params"]] if self._optimizer else []
        return {"values": {i: t.detach().clone() for i, t in self._vars.items()},
                "optimizer": self._optimizer.state_dict() if self._optimizer else None,
                "order": order, "groups": list(getattr(self, "_group_index", [])),
                "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for i, value in state["values"].items():
                self._vars[int(i)].copy_(value)
        if state.get("optimizer") is not None and self._optimizer is not None:
            self._optimizer.load_state_dict(state["optimizer"])
        self.version = int(state.get("version", 0))
