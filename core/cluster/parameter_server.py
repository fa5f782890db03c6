"""Parameter servers: variables sharded over ``ps`` tasks, updated asynchronously by workers.

Transport is ``torch.distributed`` alone: a ``TCPStore`` hosted by ``ps:0`` for rendezvous
and bookkeeping, and one two-rank gloo process group per (worker incarnation, ps) pair for
tensors. Pair groups, not one global group, so that a worker that dies only breaks its own
channels and a restarted worker rejoins with fresh ones (a global group cannot change its
membership).

Each ps task holds its shard of the variables and an optimizer over them (optimizer state
lives with its variable). A worker sums its replicas' gradients locally (the central
storage engine), then, at ``optimizer.step()``, pushes them to the ps that owns each
variable and receives the updated values in the same round trip. The ps applies pushes
in the order they arrive, one at a time: workers are asynchronous to each other.

Messages are a fixed-size int64 header (operation and the dtype/size of each payload)
followed by flat payload tensors; structured data travels as UTF-8 JSON bytes, and
checkpoint state as ``torch.save`` bytes loaded back with ``weights_only=True``.
"""

from __future__ import annotations

import datetime
import io
import json
import re
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from .resolvers import ClusterResolver

__all__ = ["ParameterServer", "ParameterServerClient", "ParameterServerError", "placement"]

_REGISTER, _OPTIMIZER, _PUSH_PULL, _PULL, _STATE, _LOAD, _BYE, _ABORTED = range(1, 9)
_HEADER = 32
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.uint8, torch.bool]
_CODE = {dtype: i for i, dtype in enumerate(_DTYPES)}
_FOREVER = datetime.timedelta(days=7)


class ParameterServerError(RuntimeError):
    """A parameter server cannot be reached or stopped answering: the job cannot go on."""


def placement(sizes: list[int], num_ps: int, mode: str = "round_robin",
              colocate: dict[int, int] | None = None) -> list[int]:
    """The ps task of each variable, in creation order.

    ``round_robin`` is TF's rule (variable i on ps i mod n); ``balanced`` puts each variable
    on the ps holding the fewest bytes so far (TF users complained of skew). ``colocate``
    maps a variable index to an earlier one whose ps it must share.
    """
    if mode not in ("round_robin", "balanced"):
        raise ValueError(f"variable placement must be 'round_robin' or 'balanced', got {mode!r}")
    owners: list[int] = []
    load = [0] * num_ps
    for index, size in enumerate(sizes):
        if colocate and index in colocate:
            owner = owners[colocate[index]]
        elif mode == "round_robin":
            owner = index % num_ps
        else:
            owner = min(range(num_ps), key=lambda k: (load[k], k))
        owners.append(owner)
        load[owner] += size
    return owners


# -- framing ----------------------------------------------------------------------------
def _encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def _decode(tensor: torch.Tensor) -> Any:
    return json.loads(bytes(tensor.numpy()).decode())


def _pack_state(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _unpack_state(tensor: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(bytes(tensor.numpy())), weights_only=True)


class _Channel:
    """One worker incarnation <-> one ps: a two-rank gloo group (rank 0 is the ps)."""

    def __init__(self, store, prefix: str, rank: int, timeout: datetime.timedelta):
        self._pg = dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, 2, timeout)
        self._peer = 1 - rank
        self._lock = threading.Lock()

    def send(self, op: int, payload: list[torch.Tensor]) -> None:
        if len(payload) > (_HEADER - 2) // 2:
            raise ValueError("too many payload tensors for one message")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = op, len(payload)
        for i, tensor in enumerate(payload):
            header[2 + 2 * i] = _CODE[tensor.dtype]
            header[3 + 2 * i] = tensor.numel()
        flat = [tensor.contiguous().view(-1) for tensor in payload]
        with self._lock:  # all posted, then waited for: one wait, not one per tensor
            works = [self._pg.send([header], self._peer, 0)] + [
                self._pg.send([tensor], self._peer, 1 + i) for i, tensor in enumerate(flat)]
            for work in works:
                work.wait()

    def recv(self) -> tuple[int, list[torch.Tensor]]:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        with self._lock:
            self._pg.recv([header], self._peer, 0).wait()
            op, count = int(header[0]), int(header[1])
            payload = [torch.empty(int(header[3 + 2 * i]), dtype=_DTYPES[int(header[2 + 2 * i])])
                       for i in range(count)]
            works = [self._pg.recv([tensor], self._peer, 1 + i)
                     for i, tensor in enumerate(payload)]
            for work in works:
                work.wait()
        return op, payload


def _transport_error(exc: BaseException) -> str:
    """gloo's message without its source location and generic advice:
    ``Read error [127.0.0.1]:28317: Connection reset by peer``."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". This is typically")[0][:200]


def _flat_by_dtype(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    groups: dict = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor.detach().reshape(-1))
    return [torch.cat(group) for group in groups.values()]


def _views_like(targets: list[torch.Tensor], flats: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views into ``flats`` (one per dtype, as :func:`_flat_by_dtype` made them) shaped
    like ``targets``, in the same order."""
    flat_of = dict(zip(dict.fromkeys(t.dtype for t in targets), flats))
    offsets: dict = {}
    views = []
    for tensor in targets:
        offset = offsets.get(tensor.dtype, 0)
        views.append(flat_of[tensor.dtype][offset:offset + tensor.numel()].view_as(tensor))
        offsets[tensor.dtype] = offset + tensor.numel()
    return views


def _unflatten_into(targets: list[torch.Tensor], flats: list[torch.Tensor]) -> None:
    for tensor, view in zip(targets, _views_like(targets, flats)):
        tensor.copy_(view)


def _store(resolver: ClusterResolver, is_master: bool, timeout: float) -> dist.TCPStore:
    host, _, port = resolver.cluster_spec().task_address("ps", 0).rpartition(":")
    try:
        return dist.TCPStore(host, int(port), is_master=is_master, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout))
    except (RuntimeError, OSError) as exc:
        role = "host" if is_master else "reach"
        raise ParameterServerError(f"cannot {role} the cluster's store at ps:0 ({host}:{port}): "
                                   f"{exc}") from None


# -- the server -------------------------------------------------------------------------
class ParameterServer:
    """A ``ps`` task: holds a shard of the variables and applies pushed gradients."""

    def __init__(self, resolver: ClusterResolver, timeout: float = 60.0):
        if resolver.task_type != "ps":
            raise ValueError(f"task {resolver.task_type}:{resolver.task_id} is not a ps task")
        self.task_id = resolver.task_id
        self._store = _store(resolver, resolver.task_id == 0, timeout)
        self._vars: dict[int, torch.Tensor] = {}
        self._groups: dict[int, int] = {}
        self._optimizer = None
        self._lock = threading.Lock()
        self.version = 0
        self.log: list[tuple[str, int]] = []  # (worker, version) of every applied push
        self._aborted: str | None = None  # why the chief ended the job after a failure
        self._threads: list[threading.Thread] = []

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
        seen, stopped_at = 0, None
        while not self._store.check(["job/done"]):
            if stop is not None and stop.is_set():
                stopped_at = stopped_at or time.monotonic()
                if time.monotonic() - stopped_at > grace:
                    return False
            joined = self._store.add(f"ps/{self.task_id}/joins", 0)
            while seen < joined:
                seen += 1
                name = self._store.get(f"ps/{self.task_id}/join/{seen}").decode()
                self._accept(name)
            time.sleep(poll)
        self._close(poll, close_timeout)
        return True

    def _close(self, poll: float, close_timeout: float) -> None:
        if self._store.check(["job/aborted"]):  # the chief failed: tell the workers why
            self._aborted = self._store.get("job/aborted").decode()
            deadline = time.monotonic() + 10.0
            for thread in self._threads:  # each ends when its worker hears and exits
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            return
        for thread in self._threads:  # workers said goodbye or died; let the threads end
            thread.join(timeout=5)
        with self._lock:
            self._store.set(f"ps/{self.task_id}/log", json.dumps(self.log))
        self._store.set(f"ps/{self.task_id}/stopped", "1")
        if self.task_id == 0:  # the store lives here: stay until the chief is done with it
            deadline = time.monotonic() + close_timeout
            while not self._store.check(["job/closed"]) and time.monotonic() < deadline:
                time.sleep(poll)

    def _accept(self, name: str) -> None:
        thread = threading.Thread(target=self._connection, args=(name,), daemon=True,
                                  name=f"csrun-ps{self.task_id}-{name}")
        thread.start()
        self._threads.append(thread)

    def _connection(self, name: str) -> None:
        worker = name.rsplit("#", 1)[0]
        try:
            channel = _Channel(self._store, f"chan/{self.task_id}/{name}", 0, _FOREVER)
            while True:
                op, payload = channel.recv()
                if op == _BYE:
                    self._store.set(f"finished/{worker}", "1")
                    return
                if self._aborted is not None:
                    channel.send(_ABORTED, [_encode(self._aborted)])
                    continue
                channel.send(op, self._answer(op, payload, worker))
        except RuntimeError as exc:  # the peer died or its connection broke
            self._store.set(f"lost/{worker}", f"ps:{self.task_id} lost {name}: {exc}"[:500])

    def _answer(self, op: int, payload: list[torch.Tensor], worker: str) -> list[torch.Tensor]:
        with self._lock:
            if op == _REGISTER:
                self._register(_decode(payload[0]), payload[1:])
            elif op == _OPTIMIZER:
                self._make_optimizer(_decode(payload[0]))
            elif op == _PUSH_PULL:
                self._apply(_decode(payload[0]), payload[1:], worker)
            elif op == _STATE:
                return [_pack_state(self.state_dict())]
            elif op == _LOAD:
                self.load_state_dict(_unpack_state(payload[0]))
            elif op != _PULL:
                raise RuntimeError(f"unknown message {op}")
            return self._values()

    def _ordered(self) -> list[torch.Tensor]:
        return [self._vars[i] for i in sorted(self._vars)]

    def _values(self) -> list[torch.Tensor]:
        return _flat_by_dtype(self._ordered()) if self._vars else []

    def _register(self, meta: dict, flats: list[torch.Tensor]) -> None:
        if self._vars:  # the first worker's values initialize the shard; later ones pull
            return
        variables = [torch.empty(v["shape"], dtype=getattr(torch, v["dtype"]))
                     for v in sorted(meta["vars"], key=lambda v: v["id"])]
        _unflatten_into(variables, flats)
        for spec, tensor in zip(sorted(meta["vars"], key=lambda v: v["id"]), variables):
            self._vars[spec["id"]] = tensor.requires_grad_(tensor.is_floating_point())
            self._groups[spec["id"]] = spec.get("group", 0)

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
                groups.append({**_from_json(settings), "params": params})
                self._group_index.append(index)
        self._optimizer = cls(groups, **_from_json(spec["defaults"]))

    def _apply(self, meta: dict, flats: list[torch.Tensor], worker: str) -> None:
        if self._optimizer is None:
            raise RuntimeError("a gradient arrived before the optimizer was registered")
        ids = meta["ids"]
        targets = [self._vars[i] for i in ids]
        grads = _views_like(targets, flats)  # the received buffers themselves, no copy
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


def _to_json(settings: dict) -> dict:
    out = {}
    for key, value in settings.items():
        if key == "params":
            continue
        if isinstance(value, torch.Tensor):
            value = value.item()
        if isinstance(value, tuple):
            value = {"__tuple__": list(value)}
        if isinstance(value, (int, float, bool, str, type(None), list, dict)):
            out[key] = value
    return out


def _from_json(settings: dict) -> dict:
    return {k: tuple(v["__tuple__"]) if isinstance(v, dict) and "__tuple__" in v else v
            for k, v in settings.items()}


# -- the worker's side ------------------------------------------------------------------
class _JobStore:
    """The job's TCPStore as a worker uses it for bookkeeping (steps, joins, who is lost).

    ps:0 hosts it, so when ps:0 dies every call fails with a transport error wherever the
    worker happens to be (counting a step, say); each becomes the same clear
    ParameterServerError as a dead ps's channel gives. Channels use ``raw``: their
    errors name the ps they talk to."""

    def __init__(self, raw: dist.TCPStore, address: str, task: str):
        self.raw, self._address, self._task = raw, address, task

    def __getattr__(self, name: str):
        method = getattr(self.raw, name)

        def call(*args, **kwargs):
            try:
                return method(*args, **kwargs)
            except RuntimeError as exc:
                raise _stopped_answering(f"ps:0 ({self._address}), which holds the job's "
                                         "store,", self._task, exc) from None
        return call


def _stopped_answering(ps: str, task: str, exc: BaseException) -> ParameterServerError:
    return ParameterServerError(f"parameter server {ps} stopped answering {task}: "
                                f"{_transport_error(exc)}; the job cannot go on without it")


class ParameterServerClient:
    """A worker's connection to every ps task."""

    def __init__(self, resolver: ClusterResolver, timeout: float = 120.0):
        self._resolver = resolver
        self.task = f"{resolver.task_type}:{resolver.task_id}"
        self.num_ps = resolver.cluster_spec().num_tasks("ps")
        self._store = _JobStore(_store(resolver, False, timeout),
                                resolver.cluster_spec().task_address("ps", 0), self.task)
        self._timeout = timeout
        self._channels: list[_Channel] = []
        self.incarnation = self._store.add(f"incarnation/{self.task}", 1)
        self._connect()

    def _connect(self) -> None:
        deadline = time.monotonic() + self._timeout
        for k in range(self.num_ps):
            while not self._store.check([f"ps/{k}/ready"]):
                if time.monotonic() > deadline:
                    raise ParameterServerError(f"ps:{k} did not come up within "
                                               f"{self._timeout:.0f} s")
                time.sleep(0.05)
        name = f"{self.task}#{self.incarnation}"
        for k in range(self.num_ps):
            slot = self._store.add(f"ps/{k}/joins", 1)
            self._store.set(f"ps/{k}/join/{slot}", name)
        timeout = datetime.timedelta(seconds=self._timeout)
        self._channels = [_Channel(self._store.raw, f"chan/{k}/{name}", 1, timeout)
                          for k in range(self.num_ps)]

    def _call(self, k: int, op: int, payload: list[torch.Tensor]) -> list[torch.Tensor]:
        try:
            self._channels[k].send(op, payload)
            answer, reply = self._channels[k].recv()
        except RuntimeError as exc:
            address = self._resolver.cluster_spec().task_address("ps", k)
            raise _stopped_answering(f"ps:{k} ({address})", self.task, exc) from None
        if answer == _ABORTED:
            raise ParameterServerError(f"the chief ended the job: {_decode(reply[0])}")
        return reply

    # -- variables -------------------------------------------------------------------------
    def register(self, shards: list[list[tuple[int, torch.Tensor, int]]]) -> None:
        """Offer initial values (``(var_id, tensor, group)`` per ps) and take the ps's."""
        for k, shard in enumerate(shards):
            if not shard:
                continue
            meta = {"vars": [{"id": i, "shape": list(t.shape), "group": g,
                              "dtype": str(t.dtype).replace("torch.", "")} for i, t, g in shard]}
            ordered = [t for _, t, _ in sorted(shard, key=lambda s: s[0])]
            reply = self._call(k, _REGISTER, [_encode(meta)] + _flat_by_dtype(ordered))
            with torch.no_grad():
                _unflatten_into(ordered, reply)

    def register_optimizer(self, optimizer: torch.optim.Optimizer,
                           var_groups: dict[int, int]) -> None:
        """Build the same optimizer on every ps (``var_groups``: var id -> param group)."""
        spec = {"class": type(optimizer).__name__, "defaults": _to_json(optimizer.defaults),
                "groups": [_to_json(g) for g in optimizer.param_groups],
                "var_groups": {str(k): v for k, v in var_groups.items()}}
        for k in range(self.num_ps):
            self._call(k, _OPTIMIZER, [_encode(spec)])

    def push_pull(self, shards: list[list[tuple[int, torch.Tensor]]], lrs: list[float],
                  values: list[list[torch.Tensor]]) -> None:
        """Send gradients (``(var_id, grad)`` per ps), receive every variable's new value."""
        for k, shard in enumerate(shards):
            if not values[k]:
                continue
            meta = {"ids": [i for i, _ in shard], "lrs": lrs}
            reply = self._call(k, _PUSH_PULL, [_encode(meta)] + _flat_by_dtype(
                [g for _, g in shard]))
            with torch.no_grad():
                _unflatten_into(values[k], reply)

    def pull(self, values: list[list[torch.Tensor]]) -> None:
        for k in range(self.num_ps):
            if values[k]:
                with torch.no_grad():
                    _unflatten_into(values[k], self._call(k, _PULL, []))

    def state(self) -> list[dict]:
        return [_unpack_state(self._call(k, _STATE, [])[0]) for k in range(self.num_ps)]

    def load(self, states: list[dict]) -> None:
        for k, state in enumerate(states):
            self._call(k, _LOAD, [_pack_state(state)])

    # -- job bookkeeping -------------------------------------------------------------------
    def count_step(self) -> int:
        return self._store.add("global_step", 1)

    def set_global_step(self, step: int) -> None:
        self._store.set("global_step", str(int(step)))

    @property
    def global_step(self) -> int:
        return self._store.add("global_step", 0)

    def lost_workers(self) -> dict[str, str]:
        """Workers a ps saw die (and that have not finished since), with what it saw."""
        lost = {}
        spec = self._resolver.cluster_spec()
        for job in ("chief", "worker"):
            for i in range(spec.num_tasks(job)):
                key = f"{job}:{i}"
                if self._store.check([f"lost/{key}"]) and not self._store.check(
                        [f"finished/{key}"]):
                    lost[key] = self._store.get(f"lost/{key}").decode()
        return lost

    def mark_initialized(self, info: dict | None = None) -> None:
        """Chief: the variables hold their starting values (fresh, or restored);
        ``info`` (JSON data, e.g. where training starts) goes to the other workers."""
        self._store.set("job/initialized", json.dumps(info or {}))

    def wait_initialized(self, timeout: float) -> dict:
        """Other workers: wait until the chief has initialized (or restored) the
        variables, as TF's non-chief workers wait for the chief's session; returns the
        chief's ``info``."""
        deadline = time.monotonic() + timeout
        while not self._store.check(["job/initialized"]):
            if self._store.check(["job/aborted"]):  # the chief failed before initializing
                raise ParameterServerError(f"the job was aborted: "
                                           f"{self._store.get('job/aborted').decode()}")
            if time.monotonic() > deadline:
                raise ParameterServerError(f"the chief did not initialize the variables "
                                           f"within {timeout:.0f} s; is it running?")
            time.sleep(0.05)
        return json.loads(self._store.get("job/initialized"))

    def abort(self, reason: str) -> None:
        """Chief: end the job after a failure; each ps answers the workers' next
        message with ``reason`` (they fail with it) and stops."""
        try:
            self._store.set("job/aborted", reason[:500])
            self._store.set("job/done", "1")
        except RuntimeError:  # ps:0, and the store with it, is gone already
            pass

    def finish(self) -> None:
        """Say goodbye to every ps (this worker is done)."""
        for channel in self._channels:
            try:
                channel.send(_BYE, [])
            except RuntimeError:
                pass

    def wait_for_workers(self, tasks: list[str], timeout: float,
                         report: Callable[[str, str], None] | None = None) -> list[str]:
        """Chief: wait until every other worker finished or was lost; return the lost ones."""
        deadline = time.monotonic() + timeout
        reported: set = set()
        while True:
            lost = self.lost_workers()
            for task, why in lost.items():
                if task not in reported and report is not None:
                    report(task, why)
                reported.add(task)
            pending = [t for t in tasks if not self._store.check([f"finished/{t}"])
                       and t not in lost]
            if not pending or time.monotonic() > deadline:
                return sorted(lost)
            time.sleep(0.05)

    def end_job(self, timeout: float = 60.0) -> list[list]:
        """Chief: stop the ps tasks; return each one's log of applied pushes
        (``[worker, version]`` in the order they were applied)."""
        self._store.set("job/done", "1")
        logs = []
        deadline = time.monotonic() + timeout
        for k in range(self.num_ps):
            while not self._store.check([f"ps/{k}/stopped"]):
                if time.monotonic() > deadline:
                    raise ParameterServerError(f"ps:{k} did not stop within {timeout:.0f} s")
                time.sleep(0.02)
            logs.append(json.loads(self._store.get(f"ps/{k}/log")))
        self._store.set("job/closed", "1")
        return logs
