"""The parameter servers' transport: the job's store, channels, and what travels on them.

Transport is ``torch.distributed`` alone: a ``TCPStore`` hosted by ``ps:0`` for rendezvous
and bookkeeping, and one two-rank gloo process group per (worker incarnation, ps) pair for
tensors. Pair groups, not one global group, so that a worker that dies only breaks its own
channels and a restarted worker rejoins with fresh ones (a global group cannot change its
membership).

Messages are a fixed-size int64 header (operation and the dtype/size of each payload)
followed by flat payload tensors; structured data travels as UTF-8 JSON bytes, and
checkpoint state as ``torch.save`` bytes loaded back with ``weights_only=True``.

The store's keys are :mod:`.store_keys`'s.

Every store call is bounded (:class:`BoundedStore`): a ps that accepts connections but
never answers (frozen, stopped) must not hang a task forever, deaf to its signals.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import json
import math
import os
import queue
import re
import socket
import sys
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..distribute.device_lib import memory_bytes
from ..distribute.devices import LogicalDevice
from ..distribute.torch_internals import gloo_group
from .resolvers import ClusterResolver
from . import store_keys

__all__ = ["ParameterServerError", "ClusterMismatch", "DuplicateTask", "JobAborted",
           "JobFinished", "StoppedAnswering", "Stopped"]

(REGISTER, OPTIMIZER, PUSH_PULL, PULL, STATE, LOAD, BYE, ABORTED, REFUSED, LOOKUP,
 ASSIGN, SAVE, RESTORE) = range(1, 14)
_HEADER = 32
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
           torch.int32, torch.uint8, torch.bool]
_CODE = {dtype: i for i, dtype in enumerate(_DTYPES)}
MAX_PAYLOAD = (_HEADER - 2) // 2  # tensors one message carries
FOREVER = datetime.timedelta(days=7)


class ParameterServerError(RuntimeError):
    """A parameter server cannot be reached or stopped answering: the job cannot go on."""


# -- the store ---------------------------------------------------------------------------
def store_host(resolver: ClusterResolver) -> str:
    return resolver.cluster_spec().task_address("ps", 0).rpartition(":")[0]


class ClusterMismatch(ParameterServerError):
    """This task's model or settings differ from the job's: it cannot take part."""


class DuplicateTask(ParameterServerError):
    """Another process already plays this task of the job (started twice)."""


class StoppedAnswering(ParameterServerError):
    """A ps broke its connection (it died, or was stopped): ``ps`` names it and its
    address, ``task`` the task that saw it, ``detail`` the transport's words. The job
    cannot go on; :meth:`line` says so with what it leaves (the last checkpoint)."""

    def __init__(self, ps: str, task: str, detail: str):
        super().__init__(f"parameter server {ps} stopped answering {task}: {detail}; the "
                         "job cannot go on without it")
        self.ps, self.task, self.detail = ps, task, detail
        self.left: str | None = None  # what the job leaves, as this task knows it

    def line(self, left: str | None = None) -> str:
        """The one line every task ends with: ``ps:0 (host:port) stopped answering:
        the last checkpoint, step 10, is intact (...)``; ``left``: what the job leaves."""
        left = left or self.left or "no checkpoint that this task heard of"
        return f"{self.ps} stopped answering: {left}; the job cannot go on without it " \
               f"({self.task}: {self.detail})"


class JobAborted(ParameterServerError):
    """The chief ended the job after a failure (its reason is the message): the tasks
    that took part end with it."""


class JobFinished(ParameterServerError):
    """The chief ended the job normally before this task joined: there is nothing left
    to take part in (the ps tasks no longer make channels)."""


class Stopped(Exception):
    """A wait was given up because this task was asked to stop (a signal)."""

    def __init__(self, waited_for: str):
        super().__init__(f"stopped while waiting for {waited_for}")
        self.waited_for = waited_for


_SLICE = 0.1  # how long the caller waits at a time: a signal is heard within it
_ENDED_EVERY = 0.5  # how often a long wait asks the store whether the job was ended
_running = [0]  # calls in torch's C++ now, on every Caller's thread
_running_lock = threading.Lock()


def calls_running() -> int:
    """How many store or channel calls are in torch's C++ code now: one given up on (a
    timeout, a signal) may return while the interpreter finalizes, and a daemon thread
    that returns then is ended inside C++ frames: the process aborts with "terminate
    called without an active exception" (exit 134). The CLI then ends with
    ``os._exit``, its outcome decided and its output flushed."""
    return _running[0]


@contextlib.contextmanager
def in_native():
    """Count this thread, for the block, as one that may sit in torch's C++ (a ps's
    channel thread waits there for its worker's next message): see :func:`calls_running`."""
    with _running_lock:
        _running[0] += 1
    try:
        yield
    finally:
        with _running_lock:
            _running[0] -= 1


class Caller:
    """Runs blocking calls on one daemon thread of its own; :meth:`call` waits for each
    in short slices, for at most ``timeout`` seconds or until ``stop`` is set.

    torch's store calls sit in C++ on a socket that a frozen peer never answers, ignoring
    their own timeout and the signals of the thread that made them; waiting on another
    thread keeps the caller in Python, where signal handlers run. One long-lived thread,
    not one per call: a store call is on every training step (a thread per call cost
    0.6 ms, a hand-over 0.05 ms). A call given up on leaves the thread blocked for good,
    so every later call fails at once with the same error: the task is ending anyway.
    """

    def __init__(self, name: str = "csrun-store-call"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._stuck: ParameterServerError | None = None
        threading.Thread(target=self._serve, daemon=True, name=name).start()

    def _serve(self) -> None:
        while True:
            call, box, done = self._queue.get()
            with _running_lock:
                _running[0] += 1
            try:
                box["value"] = call()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                box["error"] = exc
            finally:
                with _running_lock:
                    _running[0] -= 1
            done.set()
            del call, box, done  # what it made (a store, a channel) is the caller's alone

    def call(self, call: Callable[[], Any], timeout: float, what: str,
             stop: threading.Event | None = None) -> Any:
        return self.wait(self.submit(call), timeout, what, stop)

    def submit(self, call: Callable[[], Any]) -> tuple[dict, threading.Event]:
        """Queue ``call`` on this caller's thread; :meth:`wait` for its result (several
        callers' calls then run at once)."""
        if self._stuck is not None:
            raise self._stuck
        box: dict = {}
        done = threading.Event()
        self._queue.put((call, box, done))
        return box, done

    def _give_up(self, what: str) -> None:
        """The call still running is left behind: every later one fails at once."""
        self._stuck = ParameterServerError(f"{what} is still busy with a call given up on")

    def wait(self, ticket: tuple[dict, threading.Event], timeout: float, what: str,
             stop: threading.Event | None = None,
             ended: Callable[[], str | None] | None = None) -> Any:
        """The result of a :meth:`submit` ted call (its exception raised here), within
        ``timeout`` seconds or until ``stop`` is set. ``ended``: asked every
        :data:`_ENDED_EVERY` seconds whether the job was ended meanwhile (its reason
        raised as :class:`JobAborted`; or it raises): a peer that stopped after the
        failure never answers, and the task must not outwait the store that holds the
        reason."""
        box, done = ticket
        deadline = time.monotonic() + timeout
        asked = time.monotonic()
        while not done.wait(_SLICE):
            if stop is not None and stop.is_set():
                self._give_up(what)
                raise Stopped(what)
            if ended is not None and time.monotonic() - asked >= _ENDED_EVERY:
                try:
                    asked, reason = time.monotonic(), ended()
                except BaseException:  # the job finished, a signal (Stopped), ...
                    self._give_up(what)
                    raise
                if reason is not None:
                    self._give_up(what)
                    raise JobAborted(reason)
            if time.monotonic() > deadline:
                self._stuck = ParameterServerError(
                    f"{what} did not answer within {timeout:g} s (strategy.timeout_s); is "
                    "it frozen or overloaded?")
                raise self._stuck
        if "error" in box:
            raise box["error"]
        return box["value"]


def bounded(call: Callable[[], Any], timeout: float, what: str,
            stop: threading.Event | None = None) -> Any:
    """``call()`` (a blocking torch.distributed call) for at most ``timeout`` seconds
    (:class:`ParameterServerError` naming ``what``), or until ``stop`` is set
    (:class:`Stopped`), on a thread of its own (see :class:`Caller`)."""
    return Caller().call(call, timeout, what, stop)


class BoundedStore:
    """The job's TCPStore with every call bounded by ``timeout`` (see :class:`Caller`);
    ``raw`` is the store itself (for process groups, whose own timeout bounds them).

    ``fail(exc)`` turns a call's RuntimeError (a dead store) into the error to raise.
    ``stop``: once set (a signal), a call that has not answered within a slice gives up
    with :class:`Stopped` (:meth:`hearing` makes such a view of a store that has none:
    a first signal must not wait ``timeout`` on a frozen store, nor must the calls of a
    task that stops cleanly give up)."""

    def __init__(self, raw: dist.TCPStore, timeout: float, what: str,
                 fail: Callable[[BaseException], BaseException] | None = None,
                 stop: threading.Event | None = None, caller: Caller | None = None):
        self.raw, self._timeout, self._what = raw, timeout, what
        self._fail, self._stop = fail, stop
        self._caller = caller or Caller()

    def hearing(self, stop: threading.Event | None) -> "BoundedStore":
        """This store, its calls given up once ``stop`` is set (same connection, same
        thread: one call at a time)."""
        return BoundedStore(self.raw, self._timeout, self._what, self._fail, stop,
                            self._caller)

    def __getattr__(self, name: str) -> Callable:
        method = getattr(self.raw, name)

        def call(*args, **kwargs):
            try:
                return self._caller.call(lambda: method(*args, **kwargs), self._timeout,
                                         self._what, self._stop)
            except ParameterServerError:
                raise
            except RuntimeError as exc:
                if self._fail is None:
                    raise
                raise self._fail(exc) from None
        return call


def open_store(resolver: ClusterResolver, is_master: bool, timeout: float) -> dist.TCPStore:
    """A connection to the job's store at ``ps:0``'s address (hosting it: ``is_master``),
    made on the calling thread; :func:`connect_store` bounds it and names its errors."""
    host, _, port = resolver.cluster_spec().task_address("ps", 0).rpartition(":")
    return dist.TCPStore(host, int(port), is_master=is_master, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


def connect_store(resolver: ClusterResolver, is_master: bool, timeout: float,
                  stop: threading.Event | None = None) -> dist.TCPStore:
    """The job's store at ``ps:0``'s address: hosted there, joined by every other task."""
    host, _, port = resolver.cluster_spec().task_address("ps", 0).rpartition(":")
    where = f"the cluster's store at ps:0 ({host}:{port})"
    try:
        return bounded(lambda: open_store(resolver, is_master, timeout), timeout, where,
                       stop)
    except (RuntimeError, OSError) as exc:
        why = None if is_master else unreachable(host, int(port))
        if why is not None:  # not a frozen store: nothing, or something else, is there
            raise ParameterServerError(f"cannot reach {where} within {timeout:g} s "
                                       f"(strategy.timeout_s): {why}") from None
        if isinstance(exc, ParameterServerError):
            raise
        role = "host" if is_master else "reach"
        raise ParameterServerError(f"cannot {role} {where}: {transport_error(exc)}"
                                   ) from None


PROBE_S = 1.0  # how long unreachable() waits to connect, then for an answer or a reset


def unreachable(host: str, port: int) -> str | None:
    """Why a store at ``host:port`` cannot be reached, seen through a plain connection
    that says one byte (at most 2 x :data:`PROBE_S`); None when the peer takes it and
    waits for more, as a store does: a store that does not answer is frozen or
    overloaded, not unreachable."""
    closes = "the program there accepts connections and closes them: another program " \
             "on that port, or a ps that is shutting down?"
    try:
        with socket.create_connection((host, port), timeout=PROBE_S) as probe:
            probe.sendall(b"\0")  # a store waits for the rest of the request
            return closes if probe.recv(1) == b"" else \
                "the program there answered what a store would not: another program " \
                "on that port?"
    except (socket.timeout, BlockingIOError):
        return None
    except ConnectionRefusedError:
        return "nothing accepts connections there (connection refused): is ps:0 " \
               "running, at that address?"
    except (ConnectionResetError, BrokenPipeError):
        return closes
    except OSError as exc:  # no route to the host, an unknown host
        return f"{exc.strerror or exc}: is the address right?"


def agree(store, name: str, task: str, value: dict) -> tuple[str, dict]:
    """Publish ``value`` as what every task must agree on under ``name`` (the first task
    to do so sets it); return who set it and what it is."""
    mine = json.dumps({"task": task, "value": value}, sort_keys=True)
    held = json.loads(store.compare_set(store_keys.agreed(name), "", mine))
    return held["task"], held["value"]


def poll_until(done: Callable[[], bool], deadline: float = float("inf"),
               poll: float = 0.05, stop: threading.Event | None = None,
               waiting_for: str = "", most: float | None = None) -> bool:
    """Call ``done`` every ``poll`` seconds until it is true (True) or the monotonic
    ``deadline`` passes (False); once ``stop`` is set, raise :class:`Stopped`. ``most``:
    the interval grows by half at each check, up to ``most`` seconds (a wait of hours
    that asks the store each time: an idle ps's polls cost 2.6% of a core at 20 ms).

    Polling, not ``TCPStore.wait``: a wait cannot also watch for an abort or do work
    between checks, logs C++ warnings when it times out, and its timeout is a
    RuntimeError like a dead store's, which callers must tell apart.
    """
    while not done():
        if stop is not None and stop.is_set():
            raise Stopped(waiting_for)
        if time.monotonic() > deadline:
            return False
        time.sleep(poll)
        if most is not None:
            poll = min(most, poll * 1.5)
    return True


# -- framing -----------------------------------------------------------------------------
def encode(obj: Any) -> torch.Tensor:
    return torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8)


def decode(tensor: torch.Tensor) -> Any:
    return json.loads(bytes(tensor.numpy()).decode())


def pack_state(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def unpack_state(tensor: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(bytes(tensor.numpy())), weights_only=True)


def settings_to_json(settings: dict) -> dict:
    """An optimizer's (or param group's) settings as JSON data: tensors as numbers,
    tuples (Adam's betas) tagged so that :func:`settings_from_json` restores them."""
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


def settings_from_json(settings: dict) -> dict:
    return {k: tuple(v["__tuple__"]) if isinstance(v, dict) and "__tuple__" in v else v
            for k, v in settings.items()}


def gloo_device(store_host: str):
    """The gloo device to listen on: the interface this host reaches ``ps:0`` (the
    store's host) through, so the peer can connect to it; None (gloo's own choice) when
    ``GLOO_SOCKET_IFNAME`` names one.

    gloo's own choice is the address the host name resolves to, which is often loopback
    (``127.0.1.1`` on Debian) and then unreachable from other hosts.
    """
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((store_host, 9))  # UDP: picks a route, sends nothing
            address = probe.getsockname()[0]
    except OSError:  # no IPv4 route (an IPv6-only host): gloo's own choice
        return None
    return dist.ProcessGroupGloo.create_device(hostname=address)


PACK_BYTES = 8 << 20  # a message this small or smaller travels as one gloo send
_PACKED = 1 << 32      # the header's count flag: the parts follow it in the same buffer
_ALIGN = 8             # each packed part starts on a multiple of it (a dtype's view)
_HEADER_BYTES = _HEADER * 8


def _host_bytes() -> int:
    """The most bytes a message may claim by default: this host's memory (unknown, not
    POSIX: no bound). Not a bound from the plan: a ps reads a header before it knows its
    shards (a registration, the largest message, tells it), and no plan figure bounds
    every message (a ps's state for a checkpoint is its shards and their optimizer state,
    pickled). But no message larger than the host's memory can be received whole: this
    refuses only a claim that could never be honoured, before anything is allocated."""
    return memory_bytes(LogicalDevice("CPU", 0)) or sys.maxsize


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class Gathered:
    """A message part made of table rows, gathered (``index_select``) straight into the
    message: ``pieces`` are (table, row ids) of one dtype, the rows flat in order."""

    def __init__(self, pieces: list[tuple[torch.Tensor, torch.Tensor]]):
        self.pieces = [(table.detach(), ids) for table, ids in pieces]
        self.sizes = [len(ids) * math.prod(table.shape[1:]) for table, ids in pieces]
        self.dtype = self.pieces[0][0].dtype

    def into(self, flat: torch.Tensor) -> torch.Tensor:
        for (table, ids), into in zip(self.pieces, flat.split(self.sizes)):
            torch.index_select(table, 0, ids, out=into.view(len(ids), *table.shape[1:]))
        return flat

    def tensor(self) -> torch.Tensor:
        return self.into(torch.empty(sum(self.sizes), dtype=self.dtype))


class Channel:
    """One worker incarnation <-> one ps: a two-rank gloo group (rank 0 is the ps).

    A message is a header (op, and each part's dtype and size) and its parts, flat. A
    part is a tensor or a list of tensors of one dtype (received as one flat tensor, as
    ``torch.cat`` would make it), or :class:`Gathered` rows. A message up to :data:`PACK_BYTES` travels as one
    buffer, its header first, which the receiver takes into a buffer of that size: one
    gloo send and receive, where a header and a tensor per part each waited for a round
    of the transport's threads on both sides (a training step's messages are a few MiB
    at most, of 2 to 4 parts). A larger message (a table's registration) is its header,
    then one send per part, none of them copied. Either way every byte is copied at most
    once on the way, and the receiver's parts are views into what it received. Every
    size a header claims is checked before anything is allocated for it.
    """

    def __init__(self, group, rank: int, limit: int | None = None):
        """``group``: a two-rank process group whose ``send`` and ``recv`` work as
        torch.distributed's (:meth:`connect` makes the gloo one); ``rank``: this end's
        (0: the ps). ``limit``: the most bytes a message may claim (default: this host's
        memory, see :func:`_host_bytes`)."""
        self._pg = group
        self._peer = 1 - rank
        self.limit = limit if limit is not None else _host_bytes()
        self._lock = threading.Lock()
        self.sent_bytes = self.received_bytes = 0  # payloads, headers included
        self.sent_messages = self.received_messages = 0  # gloo sends, receives

    @classmethod
    def connect(cls, store, prefix: str, rank: int, timeout: datetime.timedelta,
                device=None) -> "Channel":
        """The channel of the gloo pair that meets under ``prefix`` in ``store``, on
        ``device`` (:func:`gloo_device`) when given; it waits for the peer's end."""
        return cls(gloo_group(dist.PrefixStore(prefix, store), rank, 2, timeout, device),
                   rank)

    def send(self, op: int, payload: list) -> None:
        if len(payload) > MAX_PAYLOAD:
            raise ValueError("too many payload tensors for one message")
        parts = [[p] if isinstance(p, (torch.Tensor, Gathered)) else p for p in payload]
        dtypes = [part[0].dtype if part else torch.uint8 for part in parts]
        sizes = [sum(_numel(t) for t in part) for part in parts]
        nbytes = [n * d.itemsize for n, d in zip(sizes, dtypes)]
        packed = sum(map(_aligned, nbytes)) <= PACK_BYTES
        header = [op, len(parts) | (_PACKED if packed else 0)]
        for dtype, size in zip(dtypes, sizes):
            header += [_CODE[dtype], size]
        header += [0] * (_HEADER - len(header))
        flat = [_packed(header, parts, nbytes)] if packed else \
            [torch.tensor(header, dtype=torch.int64)] + [_joined(part) for part in parts]
        self.sent_bytes += sum(t.numel() * t.element_size() for t in flat)
        self.sent_messages += len(flat)
        with self._lock:  # all posted, then waited for: one wait, not one per tensor
            works = [self._pg.send([tensor], self._peer, i) for i, tensor in enumerate(flat)]
            for work in works:
                work.wait()

    def recv(self) -> tuple[int, list[torch.Tensor]]:
        """The next message: its op and parts. RuntimeError: a header that is malformed
        or claims more than :attr:`limit` bytes (refused before its parts are allocated),
        or the transport's own (the peer died)."""
        buffer = torch.empty(_HEADER_BYTES + PACK_BYTES, dtype=torch.uint8)
        with self._lock:
            self._pg.recv([buffer], self._peer, 0).wait()
            fields = buffer[:_HEADER_BYTES].view(torch.int64).tolist()
            op, count, packed = fields[0], fields[1] & (_PACKED - 1), fields[1] & _PACKED
            kinds = _kinds(fields, count)
            nbytes = [size * dtype.itemsize for dtype, size in kinds]
            if packed and sum(map(_aligned, nbytes)) > PACK_BYTES:
                raise RuntimeError(f"a malformed message: its header claims "
                                   f"{sum(nbytes)} bytes packed in at most {PACK_BYTES}")
            if not packed and sum(nbytes) > self.limit:
                raise RuntimeError(f"a message of {sum(nbytes)} bytes, as its header says, "
                                   f"is more than this host's memory ({self.limit} bytes)"
                                   ": refused unread; is the peer a csrun task of this "
                                   "version?")
            if packed:
                payload = _unpacked(buffer, kinds, nbytes)
            else:
                payload = [torch.empty(size, dtype=dtype) for dtype, size in kinds]
                works = [self._pg.recv([tensor], self._peer, 1 + i)
                         for i, tensor in enumerate(payload)]
                for work in works:
                    work.wait()
        self.received_bytes += _HEADER_BYTES + (sum(map(_aligned, nbytes)) if packed
                                                else sum(nbytes))
        self.received_messages += 1 if packed else 1 + count
        return op, payload


def _kinds(fields: list[int], count: int) -> list[tuple[torch.dtype, int]]:
    """Each part's (dtype, size), as a header says, checked (RuntimeError: the peer is
    not a csrun channel of this version, or the connection garbled it)."""
    if not 0 <= count <= MAX_PAYLOAD or any(
            not 0 <= fields[2 + 2 * i] < len(_DTYPES) or fields[3 + 2 * i] < 0
            for i in range(count)):
        raise RuntimeError(f"a malformed message header: {fields[:2 + 2 * count]}")
    return [(_DTYPES[fields[2 + 2 * i]], fields[3 + 2 * i]) for i in range(count)]


def _numel(tensor: torch.Tensor | Gathered) -> int:
    return sum(tensor.sizes) if isinstance(tensor, Gathered) else tensor.numel()


def _joined(part: list) -> torch.Tensor:
    """A part as one flat tensor: a lone tensor as it is (no copy)."""
    if len(part) == 1 and isinstance(part[0], Gathered):
        return part[0].tensor()
    if len(part) == 1:
        return part[0].detach().contiguous().view(-1)
    return torch.cat([t.tensor() if isinstance(t, Gathered) else t.detach().reshape(-1)
                      for t in part])


def _packed(header: list[int], parts: list[list[torch.Tensor]],
            nbytes: list[int]) -> torch.Tensor:
    """The header and every part in one buffer, each part from an aligned offset (one
    copy of each tensor)."""
    buffer = torch.empty(_HEADER_BYTES + sum(map(_aligned, nbytes)), dtype=torch.uint8)
    buffer[:_HEADER_BYTES].view(torch.int64).copy_(torch.tensor(header, dtype=torch.int64))
    offset = _HEADER_BYTES
    for part, size in zip(parts, nbytes):
        at = offset
        for tensor in part:
            n = _numel(tensor) * tensor.dtype.itemsize
            if isinstance(tensor, Gathered):
                tensor.into(buffer[at:at + n].view(tensor.dtype))
            else:
                buffer[at:at + n].view(tensor.dtype).view(tensor.shape).copy_(tensor.detach())
            at += n
        offset += _aligned(size)
    return buffer


def _unpacked(buffer: torch.Tensor, kinds: list, nbytes: list[int]) -> list[torch.Tensor]:
    """The parts of a packed message, as views into the buffer it was received in."""
    parts, offset = [], _HEADER_BYTES
    for (dtype, _), size in zip(kinds, nbytes):
        parts.append(buffer[offset:offset + size].view(dtype))
        offset += _aligned(size)
    return parts


def transport_error(exc: BaseException) -> str:
    """gloo's message without its source location and generic advice:
    ``Read error [127.0.0.1]:28317: Connection reset by peer``."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    if text.startswith("Failed to recv, got 0 bytes"):  # and gloo's guesses why
        return "the connection was closed"
    return text.split(". This is typically")[0][:200]


# -- flat packing: one part per dtype on the wire ----------------------------------------
def by_dtype(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by dtype, in order: the parts of a message
    (:meth:`Channel.send` joins each group into one flat tensor on the wire)."""
    groups: dict = {}
    for tensor in tensors:
        groups.setdefault(tensor.dtype, []).append(tensor.detach())
    return list(groups.values())


def flat_by_dtype(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return [_joined(group) for group in by_dtype(tensors)]


def views_like(targets: list[torch.Tensor], flats: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views into ``flats`` (one per dtype, as :func:`flat_by_dtype` made them) shaped
    like ``targets``, in the same order."""
    flat_of = dict(zip(dict.fromkeys(t.dtype for t in targets), flats))
    offsets: dict = {}
    views = []
    for tensor in targets:
        offset = offsets.get(tensor.dtype, 0)
        views.append(flat_of[tensor.dtype][offset:offset + tensor.numel()].view_as(tensor))
        offsets[tensor.dtype] = offset + tensor.numel()
    return views


def unflatten_into(targets: list[torch.Tensor], flats: list[torch.Tensor]) -> None:
    for tensor, view in zip(targets, views_like(targets, flats)):
        tensor.copy_(view)
