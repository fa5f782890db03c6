"""The job's books, kept in its store: who plays each task, which workers joined, finished,
were lost or rejoined, how many steps each had applied, and when the job ends (TF's
``ClusterCoordinator`` does this part of a TF job).

A worker (the chief included) keeps them through its :class:`JobCoordinator`; a ps task
through its :class:`ServerBooks`. Both write only the keys of :mod:`.store_keys`.
"""

from __future__ import annotations

import json
import re
import threading
import time
from typing import Callable

import torch.distributed as dist

from . import store_keys as keys
from .heartbeat import ChiefWatch, Heartbeat
from .resolvers import ClusterResolver
from .transport import (BoundedStore, DuplicateTask, JobAborted, JobFinished,
                        ParameterServerError, Stopped, StoppedAnswering, agree,
                        connect_store, poll_until, transport_error)

__all__ = ["JobCoordinator", "ServerBooks", "CLAIM_GRACE_S", "ENDED_BY_CHIEF",
           "FAILED_REQUEST", "echoes", "stopped_answering"]

ENDED_BY_CHIEF = "the chief ended the job"  # how every other task then ends (launch reads it)
FAILED_REQUEST = " failed on a request of "  # "ps:K failed on a request of worker:N: ..."
CLAIM_GRACE_S = 5.0  # how long a restarted task waits for the ps to see its old process die


def stopped_answering(ps: str, task: str, exc: BaseException) -> StoppedAnswering:
    """``ps`` ("ps:0 (host:port)") broke the connection ``task`` had to it."""
    return StoppedAnswering(ps, task, transport_error(exc))


def echoes(task: str, line: str) -> bool:
    """Whether ``line``, the one line ``task`` ended with, repeats another task's failure
    (the job's first, recorded once): the chief's end of the job, or a ps's failed
    request. Such a task may exit before the one that failed (it heard first)."""
    if line.startswith(ENDED_BY_CHIEF):
        return True
    ps, found, _ = line.partition(FAILED_REQUEST)
    return bool(found) and ps != task and re.fullmatch(r"ps:\d+", ps) is not None


def _workers_steps(coordinator: "JobCoordinator") -> int:
    """Every worker's applied steps together (a function, not a method: the coordinator
    keeps within 25 methods)."""
    return sum(coordinator.steps_done(task) or 0 for task in coordinator.workers)


def record_abort(store: BoundedStore, sentence: str) -> None:
    """Why the job ends after a failure, the one line every task ends with: the first
    one recorded stays (a later failure is most often the first one's consequence)."""
    store.compare_set(keys.ABORTED, "", sentence[:500])


def read_abort(store: BoundedStore, heard: list) -> str | None:
    """Why the job was ended after a failure, or None; the first read is counted
    (``heard``: this task's flag), so that ps:0 keeps the store until every task knows."""
    if not store.check([keys.ABORTED]):
        return None
    if not heard:
        heard.append(True)
        store.add(keys.HEARD, 1)
    return store.get(keys.ABORTED).decode()


def _job_store(raw: dist.TCPStore, address: str, task: str, timeout: float) -> BoundedStore:
    """The job's TCPStore as a worker uses it for bookkeeping (steps, joins, who is lost).

    ps:0 hosts it, so when ps:0 dies every call fails with a transport error wherever the
    worker happens to be (counting a step, say); each becomes the same clear
    ParameterServerError as a dead ps's channel gives, and a call that gets no answer
    gives up after ``timeout``. Channels use ``raw``: their errors name the ps they
    talk to."""
    where = f"ps:0 ({address}), which holds the job's store,"
    return BoundedStore(raw, timeout, f"parameter server {where}",
                        lambda exc: stopped_answering(f"ps:0 ({address})", task, exc))


class JobCoordinator:
    """A worker's view of the job's books (the chief also ends the job)."""

    def __init__(self, resolver: ClusterResolver, timeout: float = 120.0,
                 stop: threading.Event | None = None, chief: str | None = None):
        """``stop``: set (by a signal), it ends the waits for the ps tasks and the chief
        (:class:`~.transport.Stopped`). ``chief``: the chief task, whose heartbeat this
        worker watches (the chief itself beats)."""
        self.task = f"{resolver.task_type}:{resolver.task_id}"
        spec = resolver.cluster_spec()
        self.num_ps = spec.num_tasks("ps")
        self.workers = [f"{job}:{i}" for job in ("chief", "worker")
                        for i in range(spec.num_tasks(job))]
        self.timeout, self.stop = timeout, stop
        self.store = _job_store(connect_store(resolver, False, timeout, stop),
                                spec.task_address("ps", 0), self.task, timeout)
        self._heard: list = []  # this task read why the job was ended (read_abort)
        self.incarnation = self.store.add(keys.incarnation(self.task), 1)
        self._claim()
        is_chief = chief == self.task
        # the chief's beat (it names the chief's checkpoints too), and the others' watch
        self.heartbeat = Heartbeat(self.store.raw) if is_chief else None
        self.watch = ChiefWatch(self.store, chief, timeout) if chief and not is_chief \
            else None

    @property
    def name(self) -> str:
        """This process's channel name: ``TASK#INCARNATION``."""
        return f"{self.task}#{self.incarnation}"

    def _claim(self) -> None:
        """Become the one process that plays this task (``owner/TASK``: its incarnation),
        or raise :class:`DuplicateTask`: two processes started as the same task both
        trained, and the chief counted their updates as one worker's. A restarted task
        takes over from one the ps tasks saw die, or that is not yet seen dead within
        :data:`CLAIM_GRACE_S` (its connection breaks as it dies)."""
        key, mine = keys.owner(self.task), str(self.incarnation)
        deadline = time.monotonic() + min(CLAIM_GRACE_S, self.timeout)
        while True:
            owner = self.store.compare_set(key, "", mine).decode()
            if owner == mine:
                return
            if self._set(keys.finished(self.task)):
                raise DuplicateTask(f"{self.task} already did its part of this job (another "
                                    f"process started as {self.task} finished); start each "
                                    "task once")
            died = keys.lost_incarnation(self.task)  # the ps tasks saw it (or later) die
            if self._set(died) and int(self.store.get(died)) >= int(owner):
                self.store.compare_set(key, owner, mine)
                continue
            if time.monotonic() > deadline:
                raise DuplicateTask(f"{self.task} is already running in this job: another "
                                    f"process was started as {self.task} and trains; start "
                                    "each task once (stop that one first to replace it)")
            if self.stop is not None and self.stop.is_set():
                raise Stopped(f"the other {self.task} to go")
            time.sleep(0.1)

    def _set(self, key: str) -> bool:
        return bool(self.store.check([key]))

    def join_servers(self) -> None:
        """Wait until every ps serves, then ask each for a channel (named :attr:`name`)."""
        deadline = time.monotonic() + self.timeout

        def ready(k: int) -> bool:  # a task that starts after the chief (or a ps) ended
            self.check_open()  # the job ends with its reason, instead of asking for
            return self._set(keys.ps_ready(k))  # channels the ps no longer make
        for k in range(self.num_ps):
            if not poll_until(lambda k=k: ready(k), deadline, stop=self.stop,
                              waiting_for=f"ps:{k}"):
                raise ParameterServerError(f"ps:{k} did not come up within "
                                           f"{self.timeout:g} s (strategy.timeout_s)")
        for k in range(self.num_ps):
            slot = self.store.add(keys.ps_joins(k), 1)
            self.store.set(keys.ps_join(k, slot), self.name)

    def check_open(self) -> None:
        """Whether the job still takes workers, asked while this one joins: raises
        :class:`JobAborted` (the job was ended after a failure: its reason) or
        :class:`JobFinished` (the chief ended it normally). Every store
        call hears this task's ``stop`` (a first signal, on a frozen store, is not held
        up to ``strategy.timeout_s``: :class:`Stopped`)."""
        store = self.store.hearing(self.stop)
        ended = read_abort(store, self._heard)
        if ended is None and store.check([keys.DONE]):
            # an abort records its reason before DONE: one that came in between shows now
            ended = read_abort(store, self._heard)
            if ended is None:
                raise JobFinished(f"the job already finished: the chief ended it "
                                  f"normally before {self.task} joined, so there is "
                                  f"nothing left for {self.task} to take part in; start "
                                  "a new job to train again")
        if ended is not None:
            raise JobAborted(ended)

    def agree(self, name: str, value: dict) -> tuple[str, dict]:
        """Publish what every task must agree on (:func:`~.transport.agree`)."""
        return agree(self.store, name, self.task, value)

    # -- counts ----------------------------------------------------------------------------
    def stepped(self) -> None:
        """A step was pushed (the ps that applied it counted it): a dead chief ends this
        worker too."""
        if self.watch is not None:
            self.watch.check()

    def steps_done(self, task: str | None = None) -> int | None:
        """Steps the ps tasks applied for ``task`` (default: this one) in this job, as
        counted where they were applied; None before its first."""
        key = keys.steps(task or self.task)
        return self.store.add(key, 0) if self._set(key) else None

    def set_steps(self, steps: dict[str, int]) -> None:
        """A restored job: each worker's applied steps (it goes on from there); the
        global step is their sum."""
        for task, step in steps.items():
            self.store.set(keys.steps(task), str(int(step)))
        self.store.set(keys.GLOBAL_STEP, "0")

    def set_global_step(self, step: int) -> None:
        """A restored job whose checkpoint has no worker's steps (an earlier csrun's, by
        ps task): the global step it held."""
        self.store.set(keys.GLOBAL_STEP, str(int(step) - _workers_steps(self)))

    @property
    def global_step(self) -> int:
        """Pushes applied, every worker's together: the sum of their counts (one store
        add per push, where it is applied), plus what an old checkpoint held."""
        return self.store.add(keys.GLOBAL_STEP, 0) + _workers_steps(self)

    def publish_transfers(self, stats: dict) -> None:
        """Leave this worker's bytes moved where the chief reads them."""
        self.store.set(keys.transfers(self.task), json.dumps(stats))

    def transfers(self) -> dict[str, dict]:
        """Every worker's published transfer stats."""
        return {task: json.loads(self.store.get(keys.transfers(task)))
                for task in self.workers if self._set(keys.transfers(task))}

    # -- workers ---------------------------------------------------------------------------
    def lost_workers(self) -> dict[str, str]:
        """Workers a ps saw die, with what it saw: not those that finished since, nor
        those restarted since (a later incarnation joined)."""
        lost = {}
        for task in self.workers:
            if not self._set(keys.lost(task)) or self._set(keys.finished(task)):
                continue
            died = int(self.store.get(keys.lost_incarnation(task)))
            if died >= self._owner(task):
                lost[task] = self.store.get(keys.lost(task)).decode()
        return lost

    def rejoined_workers(self) -> list[str]:
        """Workers that were restarted and joined again (a second incarnation or later)."""
        return [task for task in self.workers if self._owner(task) > 1]

    def _owner(self, task: str) -> int:
        """The incarnation that plays ``task`` now (0: none yet); a refused duplicate
        counts one more incarnation, but never owns the task."""
        key = keys.owner(task)
        return int(self.store.get(key)) if self._set(key) else 0

    def unfinished(self, tasks: list[str], lost: dict[str, str] | None = None) -> list[str]:
        """Of ``tasks``, those that neither finished nor were lost (``lost``: as seen)."""
        lost = self.lost_workers() if lost is None else lost
        return [t for t in tasks if t not in lost and not self._set(keys.finished(t))]

    def wait_for_workers(self, tasks: list[str], silence: float | None = None,
                         report: Callable[[str, str], None] | None = None) -> list[str]:
        """Chief: wait until every other worker finished or was lost; return the lost ones.

        A stopped or hung worker keeps its connection, so no ps sees it die: once no
        update at all was pushed for ``silence`` seconds, the unfinished workers count as
        lost too (a slow worker that still pushes is waited for). A signal (this task's
        ``stop``) during the wait ends it with :class:`Stopped`; after one that came
        before, the others are stopping too, and are waited for."""
        silence = silence or self.timeout  # strategy.timeout_s by default
        lost: dict[str, str] = {}  # as last seen: a restarted worker may finish after all
        reported: set = set()
        pushed = [self.global_step, time.monotonic()]  # the last push seen, and when

        def settled() -> bool:
            lost.clear()
            lost.update(self.lost_workers())
            unfinished = self.unfinished(tasks, lost)
            step, now = self.global_step, time.monotonic()
            if step != pushed[0]:
                pushed[:] = [step, now]
            silent = bool(unfinished) and now - pushed[1] > silence  # a push resets it
            if silent:
                lost.update({t: f"it neither pushed an update nor finished for "
                                f"{silence:g} s (strategy.timeout_s): stopped or hung"
                             for t in unfinished})
            for task, why in lost.items():
                if task not in reported and report is not None:
                    report(task, why)
                reported.add(task)
            return not unfinished or silent

        stop = self.stop if self.stop is not None and not self.stop.is_set() else None
        poll_until(settled, stop=stop, waiting_for="the other workers to finish")
        return sorted(lost)

    # -- the job ---------------------------------------------------------------------------
    def mark_initialized(self, info: dict | None = None) -> None:
        """Chief: the variables hold their starting values (fresh, or restored);
        ``info`` (JSON data, e.g. where training starts) goes to the other workers."""
        self.store.set(keys.INITIALIZED, json.dumps(info or {}))

    def wait_initialized(self, timeout: float,
                         waiting: Callable[[float], None] | None = None) -> dict:
        """Other workers: wait until the chief has initialized (or restored) the
        variables, as TF's non-chief workers wait for the chief's session; returns the
        chief's ``info``. ``waiting(seconds_left)`` hears at once, then every 10 s."""
        deadline = time.monotonic() + timeout
        told = [float("-inf")]

        def initialized() -> bool:
            ended = read_abort(self.store, self._heard)
            if ended is not None:  # the chief (or a ps) failed before initializing
                raise JobAborted(ended)
            if self.watch is not None:
                self.watch.check()
            done = self._set(keys.INITIALIZED)
            now = time.monotonic()
            if not done and waiting is not None and now - told[0] >= 10.0:
                told[0] = now
                waiting(deadline - now)
            return done

        if not poll_until(initialized, deadline, stop=self.stop, waiting_for="the chief"):
            raise ParameterServerError(f"the chief did not initialize the variables "
                                       f"within {timeout:g} s; is it running?")
        return json.loads(self.store.get(keys.INITIALIZED))

    def ended_why(self) -> str | None:
        """Why the job was ended after a failure (``the chief ended the job: ...``, or a
        ps's own failure), if it was and the store still answers (a channel that broke
        then is the job's end, not a failing ps)."""
        try:
            return read_abort(self.store, self._heard)
        except RuntimeError:  # ParameterServerError too: the store is gone as well
            return None

    def abort(self, reason: str) -> None:
        """Chief: end the job after a failure; each ps answers the workers' next
        message with ``the chief ended the job: {reason}`` (they fail with it) and
        stops. A job a ps ended first keeps the ps's reason: the first failure's."""
        self.close()
        try:
            record_abort(self.store, f"{ENDED_BY_CHIEF}: {reason}")
            read_abort(self.store, self._heard)  # the chief knows: ps:0 need not wait
            self.store.set(keys.DONE, "1")
        except (RuntimeError, ParameterServerError):  # ps:0, and the store, is gone
            pass

    def close(self) -> None:
        """This worker is done: the chief stops beating."""
        if self.heartbeat is not None:
            self.heartbeat.close()

    def end_job(self, timeout: float = 60.0) -> list[dict]:
        """Chief: stop the ps tasks; return each one's log of applied pushes:
        ``{"updates": {worker: count}, "recent": [[worker, version], ...]}``, the newest
        pushes (at most ``server.LOG_LIMIT``) in the order they were applied."""
        self.store.set(keys.DONE, "1")
        deadline = time.monotonic() + timeout
        for k in range(self.num_ps):
            if not poll_until(lambda k=k: self._set(keys.ps_stopped(k)), deadline, 0.02):
                raise ParameterServerError(f"ps:{k} did not stop within {timeout:.0f} s")
        logs = [json.loads(self.store.get(keys.ps_log(k))) for k in range(self.num_ps)]
        self.store.set(keys.CLOSED, "1")  # ps:0 may now stop, and the store with it
        return logs


class ServerBooks:
    """A ps task's view of the job's books."""

    def __init__(self, store: BoundedStore, task_id: int):
        self.store, self.task_id = store, task_id
        self._joined = 0  # channels accepted so far (the store counts those asked for)
        self._heard: list = [True] if task_id == 0 else []  # ps:0 waits for the others

    def ready(self) -> None:
        self.store.set(keys.ps_ready(self.task_id), "1")

    def new_joins(self) -> list[str]:
        """The names of the channels asked of this ps since the last call."""
        asked, names = self.store.add(keys.ps_joins(self.task_id), 0), []
        while self._joined < asked:
            self._joined += 1
            names.append(self.store.get(keys.ps_join(self.task_id, self._joined)).decode())
        return names

    def done(self) -> bool:
        return bool(self.store.check([keys.DONE]))

    def aborted(self) -> str | None:
        """Why the job was ended after a failure, or None."""
        return read_abort(self.store, self._heard)

    def abort(self, reason: str, end: bool = True) -> None:
        """Say why the job ends (the chief is gone, or this ps failed a request): every
        task ends with ``reason``, unless the job was ended first. ``end``: the ps tasks
        stop now (nobody else would end it); else the chief ends the job when it hears."""
        record_abort(self.store, reason)
        if end:
            self.store.set(keys.DONE, "1")

    def finished(self, worker: str) -> None:
        self.store.set(keys.finished(worker), "1")

    def lost(self, name: str, why: str) -> None:
        """Channel ``name`` (``TASK#INCARNATION``) broke: that incarnation is lost (a
        later one, restarted, is not)."""
        worker, incarnation = name.rsplit("#", 1)
        self.store.set(keys.lost_incarnation(worker), incarnation)
        self.store.set(keys.lost(worker), why[:500])

    def count(self, worker: str) -> None:
        """A push of ``worker`` was applied here, the ps that counts its steps (one store
        call: the global step is the workers' sum)."""
        self.store.add(keys.steps(worker), 1)

    def stopped(self, log: dict) -> None:
        self.store.set(keys.ps_log(self.task_id), json.dumps(log))
        self.store.set(keys.ps_stopped(self.task_id), "1")

    def wait_heard(self, others: int, timeout: float, poll: float,
                   stop: threading.Event | None = None) -> None:
        """ps:0 holds the store: after a failure, stay until the ``others`` (every other
        task) read why the job ended, or ``timeout`` (a dead task never will), or a
        signal; a task that finds the store gone could only say ps:0 stopped answering."""
        poll_until(lambda: self.store.add(keys.HEARD, 0) >= others or
                   (stop is not None and stop.is_set()), time.monotonic() + timeout, poll)

    def wait_closed(self, timeout: float, poll: float) -> None:
        """ps:0 holds the store: stay until the chief has read the logs."""
        poll_until(lambda: bool(self.store.check([keys.CLOSED])),
                   time.monotonic() + timeout, poll)
