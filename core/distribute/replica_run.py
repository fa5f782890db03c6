"""Calling a function once per replica, and the rendezvous that replicas meet at.

Two execution modes:

* **ordered** (TF's own order): replicas run one at a time, 0, 1, ..., so Python side
  effects happen in replica order. While no replica needs to meet the others, each runs
  inline on the calling thread (no thread switch at all). When replica 0 reaches a
  rendezvous (``all_reduce``, ``merge_call``, a synchronized BatchNorm, ...), the other
  replicas move to worker threads and the replicas take turns: each runs until its next
  rendezvous, the last one to arrive computes the merged result, and replica 0 resumes.
* **concurrent**: every replica runs at once on its own thread; a rendezvous is a barrier.
  Replicas that share the host CPU split its intra-op threads between them (with 4
  replicas of 64 examples each, one thread per replica keeps the matrix products as
  efficient as one device's 256; in order they would run at ~0.6x). When that share is
  one thread, the replicas run as the members of the caller's OpenMP team
  (:mod:`.openmp_team`) rather than on threads of their own.

:class:`ExecutionPolicy` chooses between them run by run (see its docstring).

A replica that raises aborts the others at their next rendezvous (or skips them if they
have not started); ``execute`` re-raises the first error once every replica has stopped,
so no thread is left running user code.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
import weakref
from typing import Any, Callable, Sequence

import torch

from . import torch_internals
from .openmp_team import OpenMPTeam, find_team
from .replica_random import Fingerprint, ReplicaRandom, RunSeed, global_state

__all__ = ["ReplicaRun", "ReplicaExecutor", "ReplicaAborted", "ExecutionPolicy"]

_FINAL = frozenset({"done", "failed", "aborted", "skipped"})
# torch's own objects, bound once: every run asks them (see torch_internals for why)
_any_autocast_enabled = torch_internals.any_autocast_enabled
_InferenceMode = torch_internals.InferenceMode
_set_grad_enabled = torch_internals.set_grad_enabled
_get_num_threads = torch.get_num_threads
_set_num_threads = torch.set_num_threads
_is_grad_enabled = torch.is_grad_enabled
_is_inference = torch.is_inference_mode_enabled
# what a replica's body is timed by, for ExecutionPolicy (tests give replicas exact work)
_clock = time.perf_counter


class ReplicaAborted(BaseException):
    """Unwinds a replica because another replica failed (never reaches user code's
    ``except Exception``)."""


class _ThreadState:
    """Per-thread torch settings of the caller, re-applied on worker threads.

    Immutable: :meth:`capture` hands out one shared instance per grad/inference setting
    when no autocast is on (the usual case; building one costs ~2 µs a run)."""

    __slots__ = ("grad_enabled", "inference", "autocast")

    def __init__(self, grad_enabled: bool, inference: bool, autocast: tuple = ()):
        self.grad_enabled = grad_enabled
        self.inference = inference
        self.autocast = autocast

    @staticmethod
    def capture() -> "_ThreadState":
        grad, inference = _is_grad_enabled(), _is_inference()
        if not _any_autocast_enabled():  # the common case, in one cheap call
            return _PLAIN_STATES[grad, inference]
        autocast = []
        for device_type in ("cpu", "cuda"):
            try:
                if torch.is_autocast_enabled(device_type):
                    autocast.append((device_type, torch.get_autocast_dtype(device_type)))
            except (TypeError, RuntimeError):  # pragma: no cover - older torch
                pass
        return _ThreadState(grad, inference, tuple(autocast))

    def apply(self, fn: Callable[[], Any]) -> Any:
        # Always entered, even when the worker's modes already match: leaving
        # inference_mode restores the thread's whole autograd and dispatch state (grad
        # mode included), so autocast or forward-mode AD that a replica function
        # switched on and never off does not reach the next run (tested). torch's own
        # guard, not its Python wrappers: ~1 µs, not ~4, on every replica's thread.
        try:
            with _InferenceMode(self.inference):
                _set_grad_enabled(self.grad_enabled)
                if not self.autocast:
                    return fn()
                return self._with_autocast(list(self.autocast), fn)
        finally:
            _drop_leaked_autocast()

    def _with_autocast(self, pending: list, fn: Callable[[], Any]) -> Any:
        if not pending:
            return fn()
        device_type, dtype = pending.pop()
        with torch.autocast(device_type, dtype=dtype):
            return self._with_autocast(pending, fn)


def _drop_leaked_autocast() -> None:
    """An autocast a replica entered and never left keeps its thread's nesting count up
    (leaving inference_mode switches autocast off, not the count), and then no later
    autocast there clears its cast cache: the next runs would compute with casts of
    parameters the optimizer has since changed. Worker threads (and the OpenMP team's)
    outlive runs, so each replica leaves the count at zero and the cache empty."""
    left = torch.autocast_decrement_nesting()
    if left < 0:  # the usual case: nothing leaked (-1 is 0 less one)
        torch.autocast_increment_nesting()
        return
    while left > 0:
        left = torch.autocast_decrement_nesting()
    torch.clear_autocast_cache()


_PLAIN_STATES = {(g, i): _ThreadState(g, i) for g in (False, True) for i in (False, True)}


def _with_mode(mode, body: Callable) -> Callable:
    def entered(run, replica_id):
        with mode:
            return body(run, replica_id)
    return entered


def _run_has_returned(run: "ReplicaRun"):
    raise RuntimeError(
        "this replica context belongs to a strategy.run that has returned; call "
        "get_replica_context() inside the replica function, during the run, to get the "
        "current one")


class ReplicaRun:
    """One call of ``body(replica_id)`` on every replica, with rendezvous between them.

    Args:
      num_replicas: how many replicas.
      concurrent: run all replicas at once (True) or in replica order (False).
      body: ``body(run, replica_id) -> output``; sets up the replica's context itself.
      executor: where worker threads come from.
      threads: intra-op threads per replica (None: leave each thread's as is).
      servings: each replica's parameter view (collectives refresh them after a merge).
      make_collectives: ``make_collectives(run)``, the run's Collectives, called on first
        use; None for a run without collectives.
      random: each replica's :class:`ReplicaRandom` (None: the global generator), entered
        around its body.
      team: the OpenMP team that concurrent replicas run as (None, or an ordered run:
        worker threads).
      call: what ``body`` calls (it reads ``run.call``), dropped with the body.
    """

    # Rendezvous state starts as these class-level defaults and becomes the run's own only
    # when it changes: most runs never leave the calling thread, and an empty step's cost
    # is mostly this bookkeeping.
    error: tuple[int | None, BaseException] | None = None
    threaded = False
    turn = 0          # ordered mode: the replica allowed to run
    round = 0         # ordered mode: completed rendezvous rounds
    generation = 0    # concurrent mode: completed barriers
    arrivals: dict[int, tuple] | None = None  # made by the first rendezvous
    sync_results: dict[int, Any] | None = None
    merging: int | None = None  # the thread running a merge, if any
    thread_state: "_ThreadState | None" = None  # the caller's modes, for workers (2+)
    _cond: threading.Condition | None = None
    _collectives = None

    def __init__(self, num_replicas: int, concurrent: bool,
                 body: Callable[["ReplicaRun", int], Any], executor: "ReplicaExecutor",
                 threads: list | None = None, servings: Sequence = (),
                 make_collectives: Callable[["ReplicaRun"], Any] | None = None,
                 random: list | None = None, team: OpenMPTeam | None = None,
                 call: tuple | None = None):
        self.num_replicas = num_replicas
        self.call = call
        self.concurrent = concurrent and num_replicas > 1
        self.threads = threads
        self.body = body
        self.executor = executor
        self.servings = servings  # not mutated
        self.make_collectives = make_collectives
        self.random = random
        self.team = team if self.concurrent else None
        self.results: list = [None] * num_replicas
        self.durations: list = [0.0] * num_replicas  # seconds each replica's body took
        self.status = ["new"] * num_replicas
        # Captured now: a replica may reach a rendezvous inside no_grad, and the workers
        # started then must still see the caller's settings of when run began. One
        # replica never leaves the caller's thread.
        if num_replicas > 1:  # (capture's usual case inline: every run of 2+ asks)
            self.thread_state = _PLAIN_STATES[_is_grad_enabled(), _is_inference()] \
                if not _any_autocast_enabled() else _ThreadState.capture()

    @property
    def cond(self) -> threading.Condition:
        """The run's lock and condition, made on first use: most runs never leave the
        calling thread, and building one costs more than the rest of an empty run.

        Only one thread may make it: :meth:`_start_workers` asks for it before any worker
        starts (two threads making one each would each lock and wait on their own, and the
        replicas would never meet)."""
        cond = self._cond
        if cond is None:
            cond = self._cond = threading.Condition(threading.Lock())
        return cond

    @property
    def collectives(self):
        """The run's Collectives (all_reduce, all_gather, merge_call), made on first use:
        by the calling thread, or by :meth:`_start_workers` before any worker starts."""
        collectives = self._collectives
        if collectives is None:
            collectives = self._collectives = self.make_collectives(self)
        return collectives

    def release(self) -> None:
        """Drop the body, call and collectives once the run is over: the collectives point
        back at the run (breaking that cycle now spares the garbage collector), and the
        call holds the step's arguments, which a replica context kept past its run must
        not keep alive. That context gets a clear error, not a finished rendezvous (which
        would wait forever)."""
        self.body = self.call = None
        self._collectives = None
        self.make_collectives = _run_has_returned

    @property
    def returned(self) -> bool:
        """Whether the run is over (:meth:`release` was called)."""
        return self.body is None

    # -- running -------------------------------------------------------------------------
    def execute(self) -> list:
        """Run every replica; return their outputs in replica order or raise the first
        error (with the replica id and device noted on it by the caller's body)."""
        # Replicas on this thread set its intra-op threads only where they differ, and the
        # caller's count comes back once at the end (not after each replica).
        caller_threads = _get_num_threads() if self.threads else None
        try:
            if self.team is not None:
                self._run_as_team(caller_threads)
            elif self.concurrent:
                self._start_workers(range(1, self.num_replicas))
                self._run_replica(0, caller_threads, False)
            else:
                run_replica = self._run_replica
                for replica_id in range(self.num_replicas):
                    if self.threaded or self.error is not None:
                        break
                    run_replica(replica_id, caller_threads, False)
        finally:
            # Inside the team's region replica 0 set this thread's own MKL count and torch's
            # process-wide one, though the region's end hides that from get_num_threads.
            if caller_threads is not None and (self.team is not None
                                               or _get_num_threads() != caller_threads):
                torch.set_num_threads(caller_threads)
        if self.threaded:
            self._wait_until_final()
        if self.error is not None:
            raise self.error[1]
        return self.results

    def _wait_until_final(self) -> None:
        """Wait for every replica to stop. A Ctrl-C here aborts the others at their next
        rendezvous and is raised (by :meth:`execute`) once all have stopped, never while
        one still runs user code (found in review: with 4 replicas on 2 threads it
        escaped while the 2 beside the team still ran)."""
        while True:
            try:
                with self.cond:
                    self.cond.wait_for(lambda: all(s in _FINAL for s in self.status))
                return
            except BaseException as exc:  # noqa: BLE001 - re-raised by execute
                self._fail(None, exc)

    def _start_workers(self, replica_ids: Sequence[int]) -> None:
        # made here, on one thread, before any other thread can reach them
        self.cond  # noqa: B018
        if self.make_collectives is not None:
            self.collectives  # noqa: B018
        self.threaded = True
        for replica_id in replica_ids:
            self.executor.submit(replica_id, lambda r=replica_id: self._run_replica(r))

    def _run_as_team(self, caller_threads: int | None) -> None:
        """Replica *i* as member *i* of one parallel region; returns once the region has.

        Replica 0 waits for the region's other members in the region's own end, a wait in
        C, where a Ctrl-C is not heard until they are done: in timelines of the MLP,
        waiting in Python instead (a lock the last replica released) cost ~0.15 ms of
        every step to wake the caller's thread and hand it the GIL. Nothing is lost by
        waiting in C: once replica 0 has returned, a replica still running cannot meet it
        at a rendezvous (that fails as stranded), so only its own code is waited for, as
        a Ctrl-C in Python would also have to. Replicas beyond the region (on threads of
        their own) are waited for in Python, by :meth:`_wait_until_final`."""
        self._start_workers(())
        members = [lambda: self._run_replica(0, caller_threads, False)]
        members += [lambda r=r: self._run_replica(r) for r in range(1, self.num_replicas)]
        # a member per intra-op thread; replicas beyond them get threads of their own
        missed, error = self.team.run(members, spare=self.executor.submit,
                                      size=torch.get_num_threads())
        if error is None:
            return
        # A signal landed outside replica 0's own guard: nothing runs replica 0 (nor
        # replicas never handed on) any more, so nobody may wait for them.
        self._fail(None, error)
        for replica_id in {0, *missed}:
            if self.status[replica_id] not in _FINAL:
                self._set_final(replica_id, "aborted")

    def _run_replica(self, replica_id: int, caller_threads: int | None = None,
                     on_worker: bool = True) -> None:
        """Run one replica, on a worker or (``on_worker=False``) on the caller's thread,
        whose intra-op thread count ``caller_threads`` is then given.

        A worker thread keeps the intra-op threads it was given: it serves one replica, so
        the next run asks it for the same count again."""
        if on_worker and not self.concurrent:
            with self.cond:
                self.cond.wait_for(lambda: self.error is not None or self.turn == replica_id)
        if self.error is not None:
            self._set_final(replica_id, "skipped")
            return
        self.status[replica_id] = "running"
        body, threads, random = self.body, self.threads, self.random
        if threads:
            threads = threads[replica_id] or caller_threads
            if threads and _get_num_threads() != threads:
                _set_num_threads(threads)
        if random is not None and random[replica_id] is not None:
            body = _with_mode(random[replica_id], body)
        begin = _clock()
        try:
            if on_worker:
                output = self.thread_state.apply(lambda: body(self, replica_id))
            else:
                output = body(self, replica_id)
            self.durations[replica_id] = _clock() - begin
        except ReplicaAborted:
            self._set_final(replica_id, "aborted")
        except BaseException as exc:  # noqa: BLE001 - every error must reach the caller
            self._fail(replica_id, exc)
        else:
            self.results[replica_id] = output
            if self.threaded:
                self._set_final(replica_id, "done")
            else:  # inline: nobody else to tell (what _set_final does then)
                self.status[replica_id] = "done"

    def _set_final(self, replica_id: int, status: str) -> None:
        if not self.threaded:  # inline: nobody else to tell
            self.status[replica_id] = status
            return
        with self.cond:
            self.status[replica_id] = status
            if self.threaded and self.error is None:
                if self.concurrent:
                    self._check_stranded()
                elif status == "done" and self.turn == replica_id:
                    self._advance(replica_id)
            self.cond.notify_all()

    def _fail(self, replica_id: int | None, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = (replica_id, exc)
            if replica_id is not None:
                self.status[replica_id] = "failed"
            self.cond.notify_all()

    # -- ordered mode --------------------------------------------------------------------
    def _advance(self, replica_id: int) -> None:
        """Hand the turn on after ``replica_id`` arrived or finished (lock held)."""
        if replica_id + 1 < self.num_replicas:
            self.turn = replica_id + 1
            return
        if all(s == "done" for s in self.status):
            self.turn = -1
            return
        if all(s == "waiting" for s in self.status):
            self._merge()
            self.round += 1
            self.turn = 0
            return
        self._mismatch()

    # -- concurrent mode -----------------------------------------------------------------
    def _check_stranded(self) -> None:
        """A finished replica strands any replica waiting at a rendezvous (lock held)."""
        waiting = [r for r, s in enumerate(self.status) if s == "waiting"]
        if waiting and all(s in ("waiting", "done") for s in self.status):
            self._mismatch()

    # -- rendezvous ----------------------------------------------------------------------
    def refuse_outside(self, replica_id: int, kind: str) -> None:
        """A replica's collective called outside that replica (not in its context on its
        thread): say why it cannot be. TF refuses it too; csrun used to wait forever."""
        if self.body is None:
            _run_has_returned(self)
        if self.merging == threading.get_ident():
            raise RuntimeError(f"{kind} cannot be called inside merge_call's merge_fn")
        raise RuntimeError(
            f"{kind} of replica {replica_id} was called outside that replica (on another "
            "thread, or in cross-replica context): a replica's collectives run in its own "
            "function, on its thread (TF: 'Need to be inside call_for_each_replica()')")

    def sync(self, replica_id: int, kind: str, payload: Any,
             merge: Callable[[list], list]) -> Any:
        """Meet the other replicas; return this replica's share of ``merge(payloads)``.

        ``merge`` takes the payloads in replica order and returns one result per replica;
        it runs once, on the thread of the last replica to arrive.
        """
        if self.merging == threading.get_ident():
            raise RuntimeError(f"{kind} cannot be called inside merge_call's merge_fn")
        with self.cond:
            if self.error is not None:
                raise ReplicaAborted()
            if self.arrivals is None:
                self.arrivals = {}
            self.arrivals[replica_id] = (kind, payload, merge)
            if self.num_replicas == 1:
                self._merge()
                return self.sync_results.pop(replica_id)
            if not self.threaded:
                self._enter_threaded(replica_id, kind)
            self.status[replica_id] = "waiting"
            if self.concurrent:
                return self._barrier(replica_id)
            return self._take_turn(replica_id)

    def _enter_threaded(self, replica_id: int, kind: str) -> None:
        if replica_id > 0:
            raise RuntimeError(
                f"replica {replica_id} called {kind}, but replicas 0..{replica_id - 1} "
                f"returned without calling it; every replica must make the same calls"
            )
        self._start_workers(range(1, self.num_replicas))

    def _take_turn(self, replica_id: int) -> Any:
        my_round = self.round
        self._advance(replica_id)
        self.cond.notify_all()
        self.cond.wait_for(lambda: self.error is not None
                           or (self.turn == replica_id and self.round > my_round))
        return self._resume(replica_id)

    def _barrier(self, replica_id: int) -> Any:
        my_generation = self.generation
        if all(s == "waiting" for s in self.status):
            self._merge()
            self.generation += 1
            self.cond.notify_all()
        else:
            self._check_stranded()
        self.cond.wait_for(lambda: self.error is not None or self.generation > my_generation)
        return self._resume(replica_id)

    def _resume(self, replica_id: int) -> Any:
        if self.error is not None:
            raise ReplicaAborted()
        return self.sync_results.pop(replica_id)

    def _merge(self) -> None:
        """Compute every replica's result of the current rendezvous (lock held)."""
        kinds = {r: a[0] for r, a in self.arrivals.items()}
        if len(set(kinds.values())) > 1:
            listed = ", ".join(f"replica {r} called {k}" for r, k in sorted(kinds.items()))
            self._abort(RuntimeError(f"replicas diverged: {listed}; every replica must make "
                                     "the same collective calls in the same order"))
            return
        payloads = [self.arrivals[r][1] for r in range(self.num_replicas)]
        merge = self.arrivals[0][2]
        self.arrivals.clear()
        self.merging = threading.get_ident()
        try:
            results = merge(payloads)
        except BaseException as exc:  # noqa: BLE001
            self._abort(exc)
            return
        finally:
            self.merging = None
        self.sync_results = dict(enumerate(results))
        # Released now, though they wake later: a replica that finishes first must not
        # see the others as still waiting.
        self.status = ["running"] * self.num_replicas

    def _mismatch(self) -> None:
        done = [r for r, s in enumerate(self.status) if s == "done"]
        arrivals = self.arrivals or {}
        waiting = {r: arrivals[r][0] for r, s in enumerate(self.status)
                   if s == "waiting" and r in arrivals}
        listed = ", ".join(f"replica {r} waits in {k}" for r, k in sorted(waiting.items()))
        self._abort(RuntimeError(
            f"replica(s) {done} returned while {listed}; every replica must make the same "
            "collective calls (all_reduce, all_gather, merge_call, variable updates, "
            "synchronized BatchNorm) in the same order"))

    def _abort(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = (None, exc)
        self.cond.notify_all()


# before_run's snapshot when the last run's end stands for this run's start
_SINCE_LAST = b"since the last run"
# ExecutionPolicy._steady: the state a steady policy runs replicas in (compared by identity)
_STEADY_ORDERED, _STEADY_CONCURRENT = "ordered", "concurrent"


class ExecutionPolicy:
    """Ordered or concurrent, run by run, for one strategy.

    ``"ordered"`` is TF's order with the caller's threads; ``"concurrent"`` always runs
    replicas at once. ``"auto"``:

    * Replicas on different physical devices (GPUs, CPU + GPU) run concurrently.
    * Replicas that share the host CPU always get an equal share of the caller's intra-op
      threads, in either mode. Their results then depend only on that share, never on
      whether they overlapped, so the policy may schedule by timing and results still
      repeat bit for bit. They run concurrently while each replica's work is long enough
      to pay for the thread handoffs (>= 250 µs a replica, back to ordered under 80 µs),
      else in order on the caller's thread. A run's work counts as the lesser of its
      own and the previous run's: one slow run (the first run's one-off costs, a thread
      preempted on a loaded machine, a garbage collection) decides nothing.
    * Random numbers: with more than one CPU replica (in every mode) each draws from its
      own generator (:mod:`.replica_random`), seeded from one draw of the global one per
      run, so dropout repeats bit for bit, ordered or not. Ops that still draw from the
      global generator are watched for: the probe runs name the op; replicas that draw
      there run in order for good, with a warning.
    * The streams are a torch function mode, which every torch call inside a replica
      passes through (a few µs each): the first run shows whether the replicas draw at
      all, and a model that does not stops paying for it. If one starts drawing later
      (``model.train()`` after an evaluation), the watch sees the global generator move;
      the streams come back and the probe decides again.
    """

    CONCURRENT_FROM = 250e-6  # seconds of work per replica
    ORDERED_BELOW = 80e-6
    QUIET_RUNS = 2  # runs with no draw between them before the watch reads once a run

    def __init__(self, devices: list, mode: str):
        self.mode = mode
        self._cpu = [i for i, d in enumerate(devices) if not d.is_gpu]
        self._num_replicas = len(devices)
        self._all_cpu = len(self._cpu) == self._num_replicas
        self._shared_cpu = mode == "auto" and len(self._cpu) > 1
        self._draws = False  # replicas were seen drawing from the global generator
        self._work = None    # moving average of seconds per replica body
        self._last = None    # the last run's seconds per replica body
        self._split = None   # (caller's threads, each replica's share)
        self._random = None  # each CPU replica's own random stream
        self._armed = True   # streams entered; off once a run shows the replicas never draw
        self._trial = True   # the next finished run decides whether they draw
        self._last_state = None  # the global generator's state as the last run ended
        self._quiet = 0  # watched runs in a row that nothing drew before (_since_last)
        self._steady = None  # set by after_run: see _steady_state
        if len(self._cpu) > 1:
            self._seed = RunSeed()
            self._random = [ReplicaRandom(i, self._seed) if i in self._cpu else None
                            for i in range(self._num_replicas)]
        if mode == "ordered" or len(devices) == 1:
            self.state = "ordered"
        elif self._shared_cpu:
            self.state = "probe"  # ordered while timings and random draws are watched
        else:
            self.state = "concurrent"
        # Nothing to decide, watch or split run by run (one replica, GPUs, a GPU and one
        # CPU): the run asks the policy nothing
        self.fixed = (self._random is None and not self._shared_cpu
                      and self.threads() is None)

    @property
    def concurrent(self) -> bool:
        return self.state == "concurrent"

    def threads(self) -> list | None:
        """Intra-op threads of each replica (None: leave the thread's own setting)."""
        if not self._cpu or not (self._shared_cpu or
                                 (self.mode == "concurrent" and self.concurrent)):
            return None
        total = torch.get_num_threads()
        if self._split is None or self._split[0] != total:  # cached: asked on every run
            per = max(1, total // len(self._cpu))
            self._split = (total, [per if i in self._cpu else None
                                   for i in range(self._num_replicas)])
        return self._split[1]

    def team(self) -> OpenMPTeam | None:
        """The OpenMP team that concurrent replicas run as, or None (worker threads).

        Only where every replica is a logical CPU whose share is one intra-op thread. The
        region has one member per intra-op thread, never more: more would add OpenMP
        threads to the process for good, and with them change how the user's own code
        waits. Replicas beyond them (4 on 2 threads) run on worker threads beside it."""
        if not self.concurrent or not self._all_cpu:
            return None
        return find_team() if self.threads()[0] == 1 else None

    def random(self) -> list | None:
        """Each replica's random stream for the next run, to be seeded from one draw of
        the global generator if a replica draws (before :meth:`before_run`)."""
        streams = self._random
        if streams is None:
            return None
        self._seed.reset()  # also when disarmed: the watch compares against its last draw
        if not self._armed:
            return None
        diagnose = self.state == "probe"  # ordered and watched: name any global draw
        for stream in streams:
            if stream is not None:
                stream.start(diagnose)
        return streams

    def start(self) -> tuple:
        """What the next run needs, in one call (every run asks): whether the replicas
        run at once, each one's intra-op threads, random streams and OpenMP team, and
        :meth:`before_run`'s snapshot for :meth:`after_run`."""
        steady = self._steady
        if steady:  # what the calls below give in that state, without them
            self._seed.reset()
            split = self._split  # threads()'s cache, without its call (made only where
            # threads() gives a split, which it then gives for good)
            threads = split[1] if split is not None and split[0] == _get_num_threads() \
                else self.threads()
            if steady is _STEADY_ORDERED:
                return False, threads, None, None, _SINCE_LAST
            team = None  # concurrent: team() without its checks, made when steady
            if self._all_cpu and threads[0] == 1:
                team = find_team()
            return True, threads, None, team, global_state()
        random = self.random()  # before before_run: it resets the run's seed
        team = self.team() if self.state == "concurrent" else None
        return self.concurrent, self.threads(), random, team, self.before_run()

    def before_run(self) -> Fingerprint | None:
        """A snapshot of the CPU generator when this run could change the decision: the
        probe, concurrent runs, and ordered runs whose work nears the threshold (so a
        switch to concurrent always follows a watched run that drew nothing). Quick
        replicas are not watched: the snapshot costs more than their whole run. Disarmed
        streams watch every run, in every mode: does the model start drawing? (Once a
        run while nothing draws between runs: :meth:`_since_last`.)"""
        if self._random is not None and not self._armed:
            if (self._quiet >= self.QUIET_RUNS and self.state == "ordered"
                    and self._last_state is not None):
                return _SINCE_LAST
            return global_state()
        if not self._shared_cpu or self._draws:
            return None
        half = self.CONCURRENT_FROM / 2
        if self.state == "ordered" and (self._work or 0.0) < half and \
                (self._last or 0.0) < half:
            return None
        self._seed.watch = True  # tell the run seed's draw from the replicas' own
        return global_state()

    def after_run(self, snapshot: Fingerprint | None, durations: list) -> None:
        # one read of the global state serves both checks (up to ~5 µs: torch_internals)
        now = global_state() if snapshot is not None else None
        steady = self._steady
        if steady and now == (self._last_state if snapshot is _SINCE_LAST else snapshot):
            # steady and unmoved: what _judge concludes, without its calls (the streams
            # stay off, the quiet runs go on, nothing drew); only the work may move
            if steady is _STEADY_CONCURRENT:  # both ends read: _since_last's count
                self._quiet = self._quiet + 1 if snapshot == self._last_state else 0
                self._last_state = now
            if self._shared_cpu and not self._draws and durations:
                self._weigh(durations, watched=True)
                if self.state != steady:  # (ordered needs its quiet runs again)
                    self._steady = self._steady_state()
            return
        self._judge(snapshot, now, durations)
        self._steady = self._steady_state()

    def _steady_state(self) -> str | None:
        """Streams off and nothing drew: start() and one read of the generator (in
        order, where nothing drew between the last runs either) or two (replicas at
        once, which read both ends of every run) are all a run asks of the policy (an
        empty step's largest part). The state it is steady in, or None."""
        if self._random is None or self._armed or self._trial or self._seed.around:
            return None
        if self.state == "concurrent":
            return _STEADY_CONCURRENT
        if self.state == "ordered" and self._last_state is not None \
                and self._quiet >= self.QUIET_RUNS:
            return _STEADY_ORDERED
        return None

    def _judge(self, snapshot: Fingerprint | None, now: Fingerprint | None,
               durations: list) -> None:
        snapshot = self._since_last(snapshot, now)
        self._last_state = now
        if self._random is not None and self._settle_streams(snapshot, now):
            return
        if not self._shared_cpu:
            return
        if snapshot is not None and self._seed.moved(snapshot, now):
            self._drew(self.state == "concurrent")
            return
        if self._draws or not durations:
            return
        self._weigh(durations, snapshot is not None)

    def _weigh(self, durations: list, watched: bool) -> None:
        """Ordered or concurrent from the replicas' work (``watched``: the global
        generator was read around this run, and nothing but the seed moved it)."""
        work = sum(durations) / len(durations)
        last, self._last = self._last, work
        if last is None:
            return  # the first run pays one-off costs; decide on later ones
        if last < work:  # noise only adds: work that grew shows in two runs
            work = last
        average = self._work
        self._work = average = work if average is None else 0.8 * average + 0.2 * work
        if average >= self.CONCURRENT_FROM:
            if watched:  # and the replicas drew nothing
                self.state = "concurrent"
        elif average < self.ORDERED_BELOW or self.state == "probe":
            self.state = "ordered"

    def _since_last(self, snapshot, now: Fingerprint | None):
        """The global state before this run. While replicas run in order and nothing
        drew between the last runs (``QUIET_RUNS`` in a row), a disarmed watch takes it
        to be the state the last run ended with, and reads the generator once a run, not
        twice (~0.2 µs each; ~5 where torch_internals must copy the whole state).
        Found moved, the move is not judged (the user's code between the runs may have
        drawn): the watch reads both ends again from the next run, which sees a replica
        that draws. In order, replicas drawing from the global generator one run longer
        still repeat bit for bit; concurrent runs read both ends every run."""
        if snapshot is not _SINCE_LAST:
            if snapshot is not None and self._random is not None and not self._armed:
                self._quiet = self._quiet + 1 if snapshot == self._last_state else 0
            return snapshot
        if now != self._last_state:
            self._quiet = 0
        return now  # unmoved (as good as the last state, and compared by identity) or not judged

    def _settle_streams(self, snapshot: Fingerprint | None,
                        now: Fingerprint | None) -> bool:
        """Streams off after a first run whose replicas drew nothing; back on when a
        disarmed run moved the global generator (True: this run is dealt with)."""
        if self._trial:
            self._trial = False
            self._armed = any(s.seeded for s in self._random if s is not None)
            return False
        if self._armed or snapshot is None or now == snapshot:
            return False
        self._rearm(self.state == "concurrent")
        return True

    def _rearm(self, interleaved: bool) -> None:
        self._armed = True
        if self._shared_cpu:
            self.state = "probe"  # ordered and diagnosing: is a covered op the one?
        if interleaved:
            warnings.warn("replicas started drawing random numbers while running "
                          "concurrently, so this step's draws interleaved in no fixed "
                          "order; from the next step on each replica draws from its own "
                          "generator", RuntimeWarning, stacklevel=5)

    def _drew(self, interleaved: bool) -> None:
        """Replicas drew from the global generator: in order from now on, with a warning
        that names the op where a diagnosing run saw it."""
        culprits = sorted({s.culprit for s in self._random if s is not None and s.culprit})
        what = f" ({', '.join(culprits)})" if culprits else ""
        when = ("while running concurrently, so this step's draws interleaved in no fixed "
                "order" if interleaved else "")
        warnings.warn(
            f"replicas drew random numbers from torch's global CPU generator{what} "
            f"{when}; each replica has its own generator for the random ops csrun sees "
            "(torch.rand*, Tensor.*_ draws, dropout, ...), but not for this one, so csrun "
            "runs this strategy's replicas in order from now on. Pass a generator of your "
            "own, or StrategyOptions(execution='ordered') to start that way (or "
            "'concurrent' to keep concurrency and accept it).".replace(" ;", ";"),
            RuntimeWarning, stacklevel=5)
        self._draws = True
        self.state = "ordered"


class _Worker:
    def __init__(self, name: str):
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            task = self.inbox.get()
            if task is None:
                return
            task()
            task = None  # drop references to the finished run before blocking again


class ReplicaExecutor:
    """Persistent worker threads, one per replica beyond replica 0 (created on demand)."""

    def __init__(self, name: str):
        self._name = name
        self._workers: dict[int, _Worker] = {}
        self._lock = threading.Lock()

    def submit(self, replica_id: int, task: Callable[[], None]) -> None:
        with self._lock:
            worker = self._workers.get(replica_id)
            if worker is None:
                worker = _Worker(f"{self._name}-replica-{replica_id}")
                self._workers[replica_id] = worker
        worker.inbox.put(task)

    def shutdown(self) -> None:
        """Stop every worker thread: each ends after its current task (idle between
        runs). Nothing waits for them (daemon threads): this runs in a finalizer, at any
        moment of the collecting thread's work, and a Ctrl-C that lands while a finalizer
        waits is lost (Python ignores exceptions raised in finalizers)."""
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
        for worker in workers:
            worker.inbox.put(None)

    @property
    def num_threads(self) -> int:
        return len(self._workers)

    def close_with(self, owner: object) -> None:
        """Shut the workers down when ``owner`` is garbage collected."""
        weakref.finalize(owner, ReplicaExecutor.shutdown, self)
