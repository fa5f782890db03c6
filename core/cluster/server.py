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
from .transport import (ABORTED, BYE, FOREVER, LOAD, OPTIMIZER, PULL, PUSH_PULL, REFUSED,
                        REGISTER, STATE, BoundedStore, Channel, DuplicateTask, agree,
                        connect_store, decode, encode, flat_by_dtype, gloo_device, pack_state,
                        poll_until, settings_from_json, store_host, transport_error,
                        unflatten_into, unpack_state, views_like)

__all__ = ["ParameterServer"]


LOG_LIMIT = 10_000  # applied pushes a ps remembers in order (the newest)


class _Refused(Exception):
    """A worker's request that cannot be served (its model is not the job's)."""


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
        self._vars: dict[int, torch.Tensor] = {}
        self._groups: dict[int, int] = {}
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
                {"updates": self.updates, "recent": list(self.log)}))
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
                channel.send(op, answer)
        except RuntimeError as exc:  # the peer died or its connection broke
            # which incarnation died: a restarted worker (a later one) is not lost
            self._store.set(f"lost_incarnation/{worker}", name.rsplit("#", 1)[1])
            self._store.set(f"lost/{worker}",
                            f"ps:{self.task_id} lost {name}: {transport_error(exc)}"[:500])

    def _answer(self, op: int, payload: list[torch.Tensor], worker: str) -> list[torch.Tensor]:
        with self._lock:
            if op == REGISTER:
                self._register(decode(payload[0]), payload[1:])
            elif op == OPTIMIZER:
                self._make_optimizer(decode(payload[0]))
            elif op == PUSH_PULL:
                self._apply(decode(payload[0]), payload[1:], worker)
            elif op == STATE:
                return [pack_state(self.state_dict())]
            elif op == LOAD:
                self.load_state_dict(unpack_state(payload[0]))
            elif op != PULL:
                raise RuntimeError(f"unknown message {op}")
            return self._values()

    # -- variables -------------------------------------------------------------------------
    def _values(self) -> list[torch.Tensor]:
        return flat_by_dtype([self._vars[i] for i in sorted(self._vars)]) if self._vars else []

    def _register(self, meta: dict, flats: list[torch.Tensor]) -> None:
        specs = sorted(meta["vars"], key=lambda v: v["id"])
        if self._vars:  # the first worker's values initialize the shard; later ones pull
            self._check_same_model(specs)
            return
        variables = [torch.empty(v["shape"], dtype=getattr(torch, v["dtype"])) for v in specs]
        unflatten_into(variables, flats)
        for spec, tensor in zip(specs, variables):
            self._vars[spec["id"]] = tensor.requires_grad_(tensor.is_floating_point())
            self._groups[spec["id"]] = spec.get("group", 0)

    def _check_same_model(self, specs: list[dict]) -> None:
        """A worker whose model differs from the first one's would push gradients that do
        not fit: refuse it, naming the first variable that differs."""
        theirs = {v["id"]: (v["dtype"], list(v["shape"])) for v in specs}
        ours = {i: (str(t.dtype).replace("torch.", ""), list(t.shape))
                for i, t in self._vars.items()}
        for var_id in sorted(set(ours) | set(theirs)):
            if ours.get(var_id) != theirs.get(var_id):
                def shown(spec):
                    return f"{spec[0]} {spec[1]}" if spec else "none"
                raise _Refused(
                    f"this worker's model differs from the job's: variable {var_id} (in "
                    f"creation order) on ps:{self.task_id} is {shown(ours.get(var_id))} in "
                    f"the job, {shown(theirs.get(var_id))} here; every worker must build "
                    "the same model")

    def _make_optimizer(self, spec: dict) -> None:
        if self._optimizer is not None or not self._vars:
            return
        cls = getattr(torch.optim, spec["class"], None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise RuntimeError(f"optimizer {spec['class']!r} is not a torch.optim optimizer")
        for var_id, group in spec.get("var_groups", {}).items():
            if int(var_id) in self._groups:
                self._groups[int(var_id)] = group
        groups, self._group_index = [], []
        for index, settings in enumerate(spec["groups"]):
            params = [self._vars[i] for i in sorted(self._vars) if self._groups[i] == index]
            if params:
                groups.append({**settings_from_json(settings), "params": params})
                self._group_index.append(index)
        self._optimizer = cls(groups, **settings_from_json(spec["defaults"]))

    def _apply(self, meta: dict, flats: list[torch.Tensor], worker: str) -> None:
        if self._optimizer is None:
            raise RuntimeError("a gradient arrived before the optimizer was registered")
        targets = [self._vars[i] for i in meta["ids"]]
        grads = views_like(targets, flats)  # the received buffers themselves, no copy
        for tensor in self._vars.values():
            tensor.grad = None
        for tensor, grad in zip(targets, grads):
            tensor.grad = grad
        lrs = meta.get("lrs", [])
        for group, index in zip(self._optimizer.param_groups, self._group_index):
            if index < len(lrs):  # the worker's LR schedule drives the ps's optimizer
                group["lr"] = lrs[index]
        self._optimizer.step()
        self.version += 1
        self.log.append((worker, self.version))
        self.updates[worker] = self.updates.get(worker, 0) + 1

    def state_dict(self) -> dict:
        return {"values": {i: t.detach().clone() for i, t in self._vars.items()},
                "optimizer": self._optimizer.state_dict() if self._optimizer else None,
                "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        with torch.no_grad():
            for i, value in state["values"].items():
                self._vars[int(i)].copy_(value)
        if state.get("optimizer") is not None and self._optimizer is not None:
            self._optimizer.load_state_dict(state["optimizer"])
        self.version = int(state.get("version", 0))
