"""A ``ps`` task's server: it answers every worker incarnation on a thread of its own,
over a :class:`.transport.Channel`, until the chief ends the job.

What it holds and how a request changes it is :class:`.shards.HeldShards`'s; the job's
books (joins, steps, lost workers) are :class:`.coordinator.ServerBooks`'. Workers are
asynchronous to each other: a ps applies pushes in the order they arrive, and serves
lookups while it applies. A request it cannot serve fails that worker with the reason
(its exception's type and message), never silently.
"""

from __future__ import annotations

import pathlib
import threading
import time
import uuid

import torch

from . import store_keys as keys
from .coordinator import FAILED_REQUEST, ServerBooks, stopped_answering
from .heartbeat import ChiefGone, ChiefWatch
from .resolvers import ClusterResolver
from .shards import HeldShards, Refused
from .transport import (ABORTED, ASSIGN, BYE, FOREVER, LOAD, LOOKUP, OPTIMIZER, PULL,
                        PUSH_PULL, REFUSED, REGISTER, RESTORE, SAVE, STATE, BoundedStore,
                        Channel, DuplicateTask, JobAborted, StoppedAnswering, agree,
                        connect_store, decode, encode, gloo_device, in_native, open_store,
                        pack_state, poll_until, store_host, transport_error, unpack_state)

__all__ = ["ParameterServer", "ABORT_HEARD_S"]

# after a failure, how long a ps waits for the workers to hear why (the launcher gives
# the others 30 s once the chief has exited)
ABORT_HEARD_S = 15.0
# how often, at most, a ps serving asks the store for joins and the job's end: its
# polls and ps:0's store answering them are CPU the training steps share
IDLE_POLL_S = 0.2


class ParameterServer:
    """A ``ps`` task: holds its shards of the variables and applies pushed gradients."""

    def __init__(self, resolver: ClusterResolver, timeout: float = 60.0,
                 stop: threading.Event | None = None, chief: str | None = None):
        """``stop``: set (by a signal), it ends the wait for the store; ``chief``: the
        task whose heartbeat ends the job when it stops (see :mod:`.heartbeat`)."""
        if resolver.task_type != "ps":
            raise ValueError(f"task {resolver.task_type}:{resolver.task_id} is not a ps task")
        self.task_id = resolver.task_id
        spec = resolver.cluster_spec()
        self._tasks = sum(spec.num_tasks(job) for job in ("chief", "worker", "ps"))
        task = f"ps:{self.task_id}"
        address = resolver.cluster_spec().task_address("ps", 0)
        self._store = BoundedStore(connect_store(resolver, resolver.task_id == 0, timeout,
                                                 stop),
                                   timeout, f"the cluster's store at ps:0 ({address})",
                                   lambda exc: stopped_answering(f"ps:0 ({address})", task,
                                                                 exc))
        self.books = ServerBooks(self._store, self.task_id)
        self._claim()
        self._watch = ChiefWatch(self._store, chief, timeout) if chief else None
        self._device = gloo_device(store_host(resolver))
        # each channel meets its worker through a store connection of its own: a TCPStore
        # client answers one call at a time, and a worker that died between its join and
        # its end of the channel left the ps's books stuck behind that rendezvous
        # (made on the channel's thread itself, which waits in native code anyway: no
        # thread of connect_store's own is left behind per worker incarnation)
        self._rendezvous = lambda: open_store(resolver, False, timeout)
        self.shards = HeldShards(self.task_id)
        self._aborted: str | None = None  # why the chief ended the job after a failure
        self._failure: dict | None = None  # a request it failed: type, message, worker
        self._threads: list[threading.Thread] = []

    def _claim(self) -> None:
        """Be the one process of this ps task, or raise :class:`DuplicateTask`: a second
        ps:1 took the workers' joins too and served until the job ended, then failed."""
        mine = f"ps#{uuid.uuid4().hex}"
        task = f"ps:{self.task_id}"
        if self._store.compare_set(keys.owner(task), "", mine).decode() != mine:
            raise DuplicateTask(f"{task} is already running in this job: another process "
                                f"was started as {task}; start each task once")

    def agree(self, name: str, value: dict) -> tuple[str, dict]:
        """Publish what every task must agree on (:func:`~.transport.agree`)."""
        return agree(self._store, name, f"ps:{self.task_id}", value)

    # -- serving ---------------------------------------------------------------------------
    def serve(self, poll: float = 0.02, close_timeout: float = 60.0,
              stop: threading.Event | None = None, grace: float = 60.0) -> bool:
        """Accept workers and answer them until the chief marks the job done.

        Once ``stop`` is set (a first Ctrl-C or SIGTERM), the ps serves on for at most
        ``grace`` seconds, so that the workers can stop cleanly and the chief can write
        its last checkpoint. Returns True when the chief ended the job, False when the
        grace ran out first. Raises :class:`~.transport.JobAborted` (with the job's one
        line) when the chief, or this ps (a request it failed), ended it after a failure,
        and :class:`~.transport.StoppedAnswering` when ps:0 (the store) stopped answering
        (its ``left``: the chief's newest checkpoint this ps heard of).
        """
        self.books.ready()

        def done() -> bool:
            for name in self.books.new_joins():
                self._accept(name)
            if self._watch is not None:
                self._watch.check()
            return self.books.done()

        stopping = stop.is_set if stop is not None else lambda: False
        try:
            poll_until(lambda: done() or stopping(), poll=poll, most=IDLE_POLL_S)
            if not poll_until(done, time.monotonic() + grace, poll, most=IDLE_POLL_S):
                return False
        except ChiefGone as exc:  # nobody will end the job: end it, and tell the workers
            self.books.abort(str(exc))
            self._aborted = str(exc)
            self._close(poll, close_timeout, stop)
            raise
        except StoppedAnswering as exc:  # ps:0, and the job's store, stopped answering
            exc.left = self._watch.note() if self._watch is not None else None
            raise
        self._close(poll, close_timeout, stop)
        if self._aborted is not None:  # the chief failed and ended the job: so does this ps
            raise JobAborted(self._aborted)
        return True

    def _accept(self, name: str) -> None:
        thread = threading.Thread(target=self._connection, args=(name,), daemon=True,
                                  name=f"csrun-ps{self.task_id}-{name}")
        thread.start()
        self._threads.append(thread)

    def _close(self, poll: float, close_timeout: float,
               stop: threading.Event | None = None) -> None:
        reason = self.books.aborted() or self._aborted  # the job's first failure
        if reason is not None:  # the chief failed (or is gone): tell the workers why
            self._aborted = reason
            deadline = time.monotonic() + ABORT_HEARD_S
            for thread in self._threads:  # each ends when its worker hears and exits
                thread.join(timeout=max(0.0, deadline - time.monotonic()))
            if self.task_id == 0:  # and a task still starting hears it from the store
                self.books.wait_heard(self._tasks - 1, deadline - time.monotonic(), poll,
                                      stop)
            return
        for thread in self._threads:  # workers said goodbye or died; let the threads end
            thread.join(timeout=5)
        self.books.stopped(self.shards.report())
        if self.task_id == 0:  # the store lives here: stay until the chief is done with it
            self.books.wait_closed(close_timeout, poll)

    def _connection(self, name: str) -> None:
        """Serve one worker incarnation until it says goodbye or its connection breaks;
        nothing escapes this thread (a broken store at the end is the job's end)."""
        worker = name.rsplit("#", 1)[0]
        try:
            with in_native():  # a process that ends meanwhile must not wait for it
                channel = Channel.connect(self._rendezvous(),
                                          keys.channel(self.task_id, name), 0, FOREVER,
                                          self._device)
                while True:
                    op, payload = channel.recv()
                    if op == BYE:
                        self.books.finished(worker)
                        return
                    channel.send(*self._reply(op, payload, worker))
        except RuntimeError as exc:  # the peer died or its connection broke
            try:  # which incarnation died: a restarted worker (a later one) is not lost
                self.books.lost(name, f"ps:{self.task_id} lost {name}: "
                                      f"{transport_error(exc)}")
            except RuntimeError:  # the store is gone too (ParameterServerError is one)
                pass

    def _reply(self, op: int, payload: list[torch.Tensor], worker: str) -> tuple[int, list]:
        """The answer to one request: its op and payload, or ABORTED (the job ended, or
        the request failed: the worker raises with the type and message) or REFUSED."""
        if self._aborted is not None:  # a failure of this ps's own: as the exception
            return ABORTED, [encode(self._failure or self._aborted)]
        try:
            return op, self._answer(op, payload, worker)
        except Refused as refused:
            return REFUSED, [encode(str(refused))]
        except Exception as exc:  # noqa: BLE001 - any handler's failure goes to the worker
            return ABORTED, [encode(self._failed(exc, worker))]

    def _failed(self, exc: Exception, worker: str) -> dict:
        """A request failed (its state may be half applied): this ps ends the job, and
        every task ends saying why; the worker that asked gets the exception itself."""
        message = str(exc).splitlines()[0][:400] if str(exc) else ""
        failed = {"type": type(exc).__name__, "message": message, "worker": worker}
        self._aborted = f"ps:{self.task_id}{FAILED_REQUEST}{worker}: " \
                        f"{failed['type']}: {message}"
        self._failure = failed
        try:  # the chief ends the job when it hears (the other ps serve on until then)
            self.books.abort(self._aborted, end=False)
        except RuntimeError:  # the store is gone: the workers hear it from this ps
            pass
        return failed

    def _answer(self, op: int, payload: list[torch.Tensor], worker: str) -> list[torch.Tensor]:
        shards = self.shards
        if op == LOOKUP:
            return shards.lookup(decode(payload[0]), payload[1])
        if op == PUSH_PULL:
            meta = decode(payload[0])
            shards.apply(meta, payload[1], payload[2:], worker)
            if meta.get("count"):  # counted where it was applied: the books agree exactly
                self.books.count(worker)
            return shards.values()
        if op == REGISTER:
            return [encode(shards.register(decode(payload[0]), payload[1:]))] + \
                shards.values()
        if op == ASSIGN:
            shards.assign(decode(payload[0]), payload[1], payload[2:])
            return []
        if op == SAVE:
            meta = decode(payload[0])
            return [encode(shards.save(pathlib.Path(meta["folder"]), meta["name"]))]
        if op == RESTORE:
            meta = decode(payload[0])
            shards.restore(pathlib.Path(meta["folder"]), meta["sources"], meta["version"])
            return []
        if op == OPTIMIZER:
            shards.make_optimizer(decode(payload[0]))
        elif op == STATE:
            return [pack_state(shards.state_dict())]
        elif op == LOAD:
            shards.load_state_dict(unpack_state(payload[0]))
        elif op != PULL:
            raise ValueError(f"unknown message {op}")
        return shards.values()
