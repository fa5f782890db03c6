"""A worker's side of the parameter servers: where each variable lives, and the client
that pushes gradients to the ps tasks and keeps the job's books in the store.

A worker sums its replicas' gradients locally (the central storage engine), then, at
``optimizer.step()``, pushes them to the ps that owns each variable and receives the
updated values in the same round trip (:meth:`ParameterServerClient.push_pull`).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from .resolvers import ClusterResolver
from .heartbeat import ChiefWatch, Heartbeat
from .sharded_variable import Shard
from .transport import (ABORTED, ASSIGN, BYE, LOAD, LOOKUP, MAX_PAYLOAD, OPTIMIZER, PULL,
                        PUSH_PULL, REFUSED, REGISTER, STATE, BoundedStore, Caller, Channel,
                        ClusterMismatch, DuplicateTask, ParameterServerError, Stopped, agree,
                        connect_store, decode, encode, flat_by_dtype, gloo_device, pack_state,
                        poll_until, settings_to_json, store_host, transport_error,
                        unflatten_into, unpack_state)

__all__ = ["ParameterServerClient", "Push", "CLAIM_GRACE_S"]


def _job_store(raw: dist.TCPStore, address: str, task: str, timeout: float) -> BoundedStore:
    """The job's TCPStore as a worker uses it for bookkeeping (steps, joins, who is lost).

    ps:0 hosts it, so when ps:0 dies every call fails with a transport error wherever the
    worker happens to be (counting a step, say); each becomes the same clear
    ParameterServerError as a dead ps's channel gives, and a call that gets no answer
    gives up after ``timeout``. Channels use ``raw``: their errors name the ps they
    talk to."""
    where = f"ps:0 ({address}), which holds the job's store,"
    return BoundedStore(raw, timeout, f"parameter server {where}",
                        lambda exc: _stopped_answering(where, task, exc))


def _stopped_answering(ps: str, task: str, exc: BaseException) -> ParameterServerError:
    return ParameterServerError(f"parameter server {ps} stopped answering {task}: "
                                f"{transport_error(exc)}; the job cannot go on without it")


_TRAINING = (PUSH_PULL, LOOKUP)  # what a step moves (not registration, pulls, checkpoints)
CLAIM_GRACE_S = 5.0  # how long a restarted task waits for the ps to see its old process die


def _with_values(meta: dict, values: list[torch.Tensor]) -> list[torch.Tensor]:
    """A registration with its values: each shard's own flat view when few enough (no
    copy: a GiB table must not be doubled on the worker), else one flat per dtype."""
    if len(values) < MAX_PAYLOAD:
        return [encode({**meta, "with_values": "per_shard"})] + \
            [v.contiguous().view(-1) for v in values]
    return [encode({**meta, "with_values": "by_dtype"})] + flat_by_dtype(values)


@dataclasses.dataclass
class Push:
    """One ps's part of a step: dense gradients ``(shard id, grad)``, and rows
    ``(shard id, shard-local row ids, rows, mode)`` (mode ``sparse``: the optimizer's
    sparse update; ``dense``: the dense gradient they stand for)."""

    dense: list = dataclasses.field(default_factory=list)
    rows: list = dataclasses.field(default_factory=list)


class ParameterServerClient:
    """A worker's connection to every ps task."""

    def __init__(self, resolver: ClusterResolver, timeout: float = 120.0,
                 stop: threading.Event | None = None, chief: str | None = None):
        """``stop``: set (by a signal), it ends the waits for the ps tasks and the chief
        (:class:`~.transport.Stopped`). ``chief``: the chief task, whose heartbeat this
        worker watches (the chief itself beats)."""
        self._resolver = resolver
        self.task = f"{resolver.task_type}:{resolver.task_id}"
        self.num_ps = resolver.cluster_spec().num_tasks("ps")
        self._timeout, self._stop = timeout, stop
        self._store = _job_store(connect_store(resolver, False, timeout, stop),
                                 resolver.cluster_spec().task_address("ps", 0), self.task,
                                 timeout)
        self._channels: list[Channel] = []
        self._callers: list[Caller] = []
        self._moved = [[0, 0] for _ in range(self.num_ps)]  # bytes sent, received per ps
        self.steps = 0  # optimizer steps this process pushed
        self.incarnation = self._store.add(f"incarnation/{self.task}", 1)
        self._claim()
        self._connect()
        is_chief = chief == self.task
        self._heartbeat = Heartbeat(self._store.raw) if is_chief else None
        self._watch = ChiefWatch(self._store, chief, timeout) if chief and not is_chief \
            else None

    def _claim(self) -> None:
        """Become the one process that plays this task (``owner/TASK``: its incarnation),
        or raise :class:`DuplicateTask`: two processes started as the same task both
        trained, and the chief counted their updates as one worker's. A restarted task
        takes over from one the ps tasks saw die, or that is not yet seen dead within
        :data:`CLAIM_GRACE_S` (its connection breaks as it dies)."""
        key, mine = f"owner/{self.task}", str(self.incarnation)
        deadline = time.monotonic() + min(CLAIM_GRACE_S, self._timeout)
        while True:
            owner = self._store.compare_set(key, "", mine).decode()
            if owner == mine:
                return
            if self._store.check([f"finished/{self.task}"]):
                raise DuplicateTask(f"{self.task} already did its part of this job (another "
                                    f"process started as {self.task} finished); start each "
                                    "task once")
            if self._died(int(owner)):
                self._store.compare_set(key, owner, mine)
                continue
            if time.monotonic() > deadline:
                raise DuplicateTask(f"{self.task} is already running in this job: another "
                                    f"process was started as {self.task} and trains; start "
                                    "each task once (stop that one first to replace it)")
            if self._stop is not None and self._stop.is_set():
                raise Stopped(f"the other {self.task} to go")
            time.sleep(0.1)

    def _died(self, incarnation: int) -> bool:
        """Whether the ps tasks saw ``incarnation`` of this task (or a later one) die."""
        key = f"lost_incarnation/{self.task}"
        return bool(self._store.check([key])) and int(self._store.get(key)) >= incarnation

    def _connect(self) -> None:
        deadline = time.monotonic() + self._timeout
        for k in range(self.num_ps):
            if not poll_until(self._is_set(f"ps/{k}/ready"), deadline, stop=self._stop,
                              waiting_for=f"ps:{k}"):
                raise ParameterServerError(f"ps:{k} did not come up within "
                                           f"{self._timeout:g} s (strategy.timeout_s)")
        name = f"{self.task}#{self.incarnation}"
        for k in range(self.num_ps):
            slot = self._store.add(f"ps/{k}/joins", 1)
            self._store.set(f"ps/{k}/join/{slot}", name)
        # gloo's bound of each tensor's send or receive is a backstop: _call bounds the
        # whole exchange by the timeout
        timeout = datetime.timedelta(seconds=2 * self._timeout + 5)
        device = gloo_device(store_host(self._resolver))
        spec = self._resolver.cluster_spec()
        self._ps_names = [f"ps:{k} ({spec.task_address('ps', k)})" for k in range(self.num_ps)]
        # one thread per ps for every exchange with it, its channel's making included
        self._callers = [Caller(f"csrun-ps{k}-call") for k in range(self.num_ps)]
        self._channels = [self._callers[k].call(
            lambda k=k: Channel(self._store.raw, f"chan/{k}/{name}", 1, timeout, device),
            self._timeout + 5, f"ps:{k}'s channel", self._stop) for k in range(self.num_ps)]

    def agree(self, name: str, value: dict) -> tuple[str, dict]:
        """Publish what every task must agree on (:func:`~.transport.agree`)."""
        return agree(self._store, name, self.task, value)

    def _is_set(self, key: str) -> Callable[[], bool]:
        return lambda: self._store.check([key])

    def _call(self, k: int, op: int, payload: list[torch.Tensor],
              counted: bool | None = None) -> list[torch.Tensor]:
        """Send ``payload`` to ps ``k`` and take its answer, within ``strategy.timeout_s``
        for the whole exchange (gloo bounds each tensor's send and receive alone: a silent
        ps held a worker many times as long), on the channel's caller thread: a second
        Ctrl-C or SIGTERM is heard while it waits."""
        channel = self._channels[k]

        def exchange() -> tuple[int, list[torch.Tensor]]:
            sent, received = channel.sent_bytes, channel.received_bytes
            channel.send(op, payload)
            answer = channel.recv()
            if counted if counted is not None else op in _TRAINING:  # one at a time
                self._moved[k][0] += channel.sent_bytes - sent
                self._moved[k][1] += channel.received_bytes - received
            return answer

        try:
            answer, reply = self._callers[k].call(exchange, self._timeout,
                                                  f"parameter server {self._ps_names[k]}")
        except ParameterServerError:
            raise
        except RuntimeError as exc:
            raise _stopped_answering(self._ps_names[k], self.task, exc) from None
        if answer == ABORTED:  # the ps says why the job ended
            raise ParameterServerError(decode(reply[0]))
        if answer == REFUSED:  # this worker's model is not the job's
            raise ClusterMismatch(decode(reply[0]))
        return reply

    # -- variables -------------------------------------------------------------------------
    def register(self, held: list[list[tuple[Shard, torch.Tensor, dict]]],
                 whole: list[list[torch.Tensor]]) -> None:
        """Offer each ps its shards (``(shard, values, flags)``) and take the values it
        holds for those served whole (``whole[k]``: where they go). Values travel only
        when the ps asks for them: the first worker's initialize a shard, later workers
        take the ps's."""
        for k, shards in enumerate(held):
            if not shards:
                continue
            meta = {"shards": [{"id": s.id, "var": s.var, "start": s.start,
                                "shape": list(t.shape), **flags,
                                "dtype": str(t.dtype).replace("torch.", "")}
                               for s, t, flags in shards]}
            reply = self._call(k, REGISTER, [encode(meta)])
            if decode(reply[0])["need_values"]:
                reply = self._call(k, REGISTER, _with_values(meta, [t for _, t, _ in shards]))
            if whole[k]:
                with torch.no_grad():
                    unflatten_into(whole[k], reply[1:])

    def register_optimizer(self, optimizer: torch.optim.Optimizer,
                           var_groups: dict[int, int]) -> None:
        """Build the same optimizer on every ps (``var_groups``: var id -> param group)."""
        spec = {"class": type(optimizer).__name__,
                "defaults": settings_to_json(optimizer.defaults),
                "groups": [settings_to_json(g) for g in optimizer.param_groups],
                "var_groups": {str(k): v for k, v in var_groups.items()}}
        for k in range(self.num_ps):
            self._call(k, OPTIMIZER, [encode(spec)])

    def lookup(self, requests: list[list[tuple[int, torch.Tensor]]],
               dtype: torch.dtype, counted: bool = True) -> list[list[torch.Tensor]]:
        """Table rows: ``requests[k]`` lists (shard id, shard-local row ids) for ps k; the
        rows come back flat, one per request, in the same order. ``counted``: a
        training step's (not an evaluation's or a whole table's read)."""
        answers: list[list[torch.Tensor]] = []
        for k, wanted in enumerate(requests):
            if not wanted:
                answers.append([])
                continue
            meta = {"shards": [[shard, len(ids)] for shard, ids in wanted]}
            ids = torch.cat([ids for _, ids in wanted])
            flat = self._call(k, LOOKUP, [encode(meta), ids], counted)
            flat = flat[0] if flat else torch.empty(0, dtype=dtype)
            sizes = [len(i) for _, i in wanted]
            answers.append(list(flat.split([n * (flat.numel() // max(1, sum(sizes)))
                                            for n in sizes])))
        return answers

    def assign(self, writes: list[list[tuple[int, torch.Tensor, torch.Tensor]]]) -> None:
        """Write table rows: ``writes[k]`` lists (shard id, shard-local ids, rows)."""
        for k, rows in enumerate(writes):
            if rows:
                meta = {"shards": [[shard, len(ids)] for shard, ids, _ in rows]}
                self._call(k, ASSIGN, [encode(meta), torch.cat([i for _, i, _ in rows])] +
                           flat_by_dtype([r for _, _, r in rows]))

    def push_pull(self, pushes: list["Push"], lrs: list[float],
                  values: list[list[torch.Tensor]], count_on: int) -> None:
        """Send each ps its gradients (``pushes[k]``) and take the new values of the
        shards it serves whole (into ``values[k]``); ``count_on``: the ps that counts the
        step in the job's books (one per push, where it is applied)."""
        for k, push in enumerate(pushes):
            if push is None:
                continue
            meta = {"dense": [i for i, _ in push.dense], "lrs": lrs, "count": k == count_on,
                    "rows": [[i, len(ids), mode] for i, ids, _, mode in push.rows]}
            ids = torch.cat([ids for _, ids, _, _ in push.rows]) if push.rows else \
                torch.empty(0, dtype=torch.int64)
            reply = self._call(k, PUSH_PULL, [encode(meta), ids] + flat_by_dtype(
                [g for _, g in push.dense] + [v for _, _, v, _ in push.rows]))
            if values[k]:
                with torch.no_grad():
                    unflatten_into(values[k], reply)

    def pull(self, values: list[list[torch.Tensor]]) -> None:
        for k in range(self.num_ps):
            if values[k]:
                with torch.no_grad():
                    unflatten_into(values[k], self._call(k, PULL, []))

    def state(self) -> list[dict]:
        return [unpack_state(self._call(k, STATE, [])[0]) for k in range(self.num_ps)]

    def load(self, states: list[dict]) -> None:
        for k, state in enumerate(states):
            self._call(k, LOAD, [pack_state(state)])

    # -- job bookkeeping -------------------------------------------------------------------
    def count_step(self) -> None:
        """A step was pushed (the ps that applied it counted it in the job's books)."""
        self.steps += 1
        if self._watch is not None:
            self._watch.check()  # a dead chief ends this worker too

    def transfer_stats(self) -> dict:
        """What this process moved to and from the ps tasks for its steps (lookups and
        pushes; headers included), in all and per step."""
        pushed = sum(m[0] for m in self._moved)
        pulled = sum(m[1] for m in self._moved)
        per = max(1, self.steps)
        return {"steps": self.steps, "pushed_bytes": pushed, "pulled_bytes": pulled,
                "pushed_bytes_per_step": pushed / per, "pulled_bytes_per_step": pulled / per}

    def publish_transfers(self) -> None:
        """Leave this worker's :meth:`transfer_stats` where the chief reads them."""
        self._store.set(f"transfers/{self.task}", json.dumps(self.transfer_stats()))

    def transfers(self) -> dict[str, dict]:
        """Every worker's published :meth:`transfer_stats`."""
        return {task: json.loads(self._store.get(f"transfers/{task}"))
                for task in self._worker_tasks() if self._store.check([f"transfers/{task}"])}

    def steps_done(self, task: str | None = None) -> int | None:
        """Steps the ps tasks applied for ``task`` (default: this one) in this job, as
        counted where they were applied; None before its first."""
        key = f"steps/{task or self.task}"
        return self._store.add(key, 0) if self._store.check([key]) else None

    def set_steps(self, steps: dict[str, int]) -> None:
        """A restored job: each worker's applied steps (it goes on from there); the
        global step is their sum."""
        for task, step in steps.items():
            self._store.set(f"steps/{task}", str(int(step)))
        self.set_global_step(sum(steps.values()))

    def set_global_step(self, step: int) -> None:
        self._store.set("global_step", str(int(step)))

    @property
    def global_step(self) -> int:
        return self._store.add("global_step", 0)

    def _worker_tasks(self) -> list[str]:
        spec = self._resolver.cluster_spec()
        return [f"{job}:{i}" for job in ("chief", "worker") for i in range(spec.num_tasks(job))]

    def lost_workers(self) -> dict[str, str]:
        """Workers a ps saw die, with what it saw: not those that finished since, nor
        those restarted since (a later incarnation joined)."""
        lost = {}
        for key in self._worker_tasks():
            if not self._store.check([f"lost/{key}"]) or self._store.check([f"finished/{key}"]):
                continue
            died = int(self._store.get(f"lost_incarnation/{key}"))
            if died >= self._owner(key):
                lost[key] = self._store.get(f"lost/{key}").decode()
        return lost

    def rejoined_workers(self) -> list[str]:
        """Workers that were restarted and joined again (a second incarnation or later)."""
        return [key for key in self._worker_tasks()
                if self._owner(key) > 1]

    def _owner(self, task: str) -> int:
        """The incarnation that plays ``task`` now (0: none yet); a refused duplicate
        counts one more incarnation, but never owns the task."""
        key = f"owner/{task}"
        return int(self._store.get(key)) if self._store.check([key]) else 0

    def mark_initialized(self, info: dict | None = None) -> None:
        """Chief: the variables hold their starting values (fresh, or restored);
        ``info`` (JSON data, e.g. where training starts) goes to the other workers."""
        self._store.set("job/initialized", json.dumps(info or {}))

    def wait_initialized(self, timeout: float,
                         waiting: Callable[[float], None] | None = None) -> dict:
        """Other workers: wait until the chief has initialized (or restored) the
        variables, as TF's non-chief workers wait for the chief's session; returns the
        chief's ``info``. ``waiting(seconds_left)`` hears at once, then every 10 s."""
        deadline = time.monotonic() + timeout
        told = [float("-inf")]

        def initialized() -> bool:
            if self._store.check(["job/aborted"]):  # the chief failed before initializing
                raise ParameterServerError(f"the job was aborted: "
                                           f"{self._store.get('job/aborted').decode()}")
            if self._watch is not None:
                self._watch.check()
            done = self._store.check(["job/initialized"])
            now = time.monotonic()
            if not done and waiting is not None and now - told[0] >= 10.0:
                told[0] = now
                waiting(deadline - now)
            return done

        if not poll_until(initialized, deadline, stop=self._stop, waiting_for="the chief"):
            raise ParameterServerError(f"the chief did not initialize the variables "
                                       f"within {timeout:g} s; is it running?")
        return json.loads(self._store.get("job/initialized"))

    def abort(self, reason: str) -> None:
        """Chief: end the job after a failure; each ps answers the workers' next
        message with ``reason`` (they fail with it) and stops."""
        if self._heartbeat is not None:
            self._heartbeat.close()
        try:
            self._store.set("job/aborted", reason[:500])
            self._store.set("job/done", "1")
        except RuntimeError:  # ps:0, and the store with it, is gone already
            pass

    def finish(self) -> None:
        """Say goodbye to every ps (this worker is done)."""
        if self._heartbeat is not None:
            self._heartbeat.close()
        for channel in self._channels:
            try:
                channel.send(BYE, [])
            except RuntimeError:
                pass

    def unfinished(self, tasks: list[str], lost: dict[str, str] | None = None) -> list[str]:
        """Of ``tasks``, those that neither finished nor were lost (``lost``: as seen)."""
        lost = self.lost_workers() if lost is None else lost
        return [t for t in tasks if t not in lost and not self._store.check([f"finished/{t}"])]

    def wait_for_workers(self, tasks: list[str], silence: float | None = None,
                         report: Callable[[str, str], None] | None = None) -> list[str]:
        """Chief: wait until every other worker finished or was lost; return the lost ones.

        A stopped or hung worker keeps its connection, so no ps sees it die: once no
        update at all was pushed for ``silence`` seconds, the unfinished workers count as
        lost too (a slow worker that still pushes is waited for). A signal (this task's
        ``stop``) during the wait ends it with :class:`Stopped`; after one that came
        before, the others are stopping too, and are waited for."""
        silence = silence or self._timeout  # strategy.timeout_s by default
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

        stop = self._stop if self._stop is not None and not self._stop.is_set() else None
        poll_until(settled, stop=stop, waiting_for="the other workers to finish")
        return sorted(lost)

    def end_job(self, timeout: float = 60.0) -> list[dict]:
        """Chief: stop the ps tasks; return each one's log of applied pushes:
        ``{"updates": {worker: count}, "recent": [[worker, version], ...]}``, the newest
        pushes (at most ``server.LOG_LIMIT``) in the order they were applied."""
        self._store.set("job/done", "1")
        deadline = time.monotonic() + timeout
        for k in range(self.num_ps):
            if not poll_until(self._is_set(f"ps/{k}/stopped"), deadline, 0.02):
                raise ParameterServerError(f"ps:{k} did not stop within {timeout:.0f} s")
        logs = [json.loads(self._store.get(f"ps/{k}/log")) for k in range(self.num_ps)]
        self._store.set("job/closed", "1")  # ps:0 may now stop, and the store with it
        return logs
