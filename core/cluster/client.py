"""A worker's channels to the ps tasks, and the requests it sends on them.

Every exchange goes to all the ps tasks it concerns at once and waits for all
(:meth:`ParameterServerClient.exchange`): a step costs the slowest ps's round trip, not
the sum. A step's push is one request per ps carrying all of that step's tables and
variables (:meth:`ParameterServerClient.push_pull`), and a lookup one request per ps
carrying every table it reads (:meth:`ParameterServerClient.lookup`).
"""

from __future__ import annotations

import dataclasses
import datetime
import threading

import torch

from . import store_keys as keys
from .coordinator import FAILED_REQUEST, JobCoordinator, stopped_answering
from .plan import Shard
from .resolvers import ClusterResolver
from .transport import (ABORTED, ASSIGN, BYE, LOAD, LOOKUP, MAX_PAYLOAD, OPTIMIZER, PULL,
                        PUSH_PULL, REFUSED, REGISTER, RESTORE, SAVE, STATE, Caller, Channel,
                        ClusterMismatch, JobAborted, ParameterServerError, by_dtype,
                        connect_store, decode, encode, flat_by_dtype, gloo_device,
                        pack_state, store_host, unflatten_into, unpack_state)

__all__ = ["ParameterServerClient", "Push", "HandlerError"]

_TRAINING = (PUSH_PULL, LOOKUP)  # what a step moves (not registration, pulls, checkpoints)


class HandlerError(ParameterServerError):
    """A ps could not serve a request (an exception in its handler): the job cannot go
    on with it. The message names the ps, the exception's type and its message."""


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
    """A worker's connection to every ps task (its books are its :class:`JobCoordinator`'s)."""

    def __init__(self, resolver: ClusterResolver, coordinator: JobCoordinator,
                 timeout: float = 120.0, stop: threading.Event | None = None):
        self.task, self.num_ps = coordinator.task, coordinator.num_ps
        self._coordinator = coordinator
        self._timeout, self._stop = timeout, stop
        # per ps: bytes sent, received; gloo messages (sends and receives)
        self._moved = [[0, 0, 0] for _ in range(self.num_ps)]
        self.steps = 0  # optimizer steps this process pushed
        spec = resolver.cluster_spec()
        self._ps_names = [f"ps:{k} ({spec.task_address('ps', k)})" for k in range(self.num_ps)]
        # the channels meet through a connection of their own, made before the join is
        # announced (a join whose worker then cannot make its end leaves each ps waiting):
        # a TCPStore client answers one call at a time, and a channel's making waits in a
        # call until its ps makes its end (a ps that ended the job never does), while the
        # books must still answer
        self._rendezvous = raw = connect_store(resolver, False, timeout, stop)
        coordinator.join_servers()
        # gloo's bound of each tensor's send or receive is a backstop: exchange() bounds
        # the whole exchange by the timeout
        bound = datetime.timedelta(seconds=2 * timeout + 5)
        device = gloo_device(store_host(resolver))
        name = coordinator.name
        # one thread per ps for every exchange with it, its channel's making included
        self._callers = [Caller(f"csrun-ps{k}-call") for k in range(self.num_ps)]
        tickets = [self._callers[k].submit(
            lambda k=k: Channel.connect(raw, keys.channel(k, name), 1, bound, device))
            for k in range(self.num_ps)]
        self._channels = []
        for k, ticket in enumerate(tickets):
            try:
                # a ps that stopped (the job ended) no longer makes channels: hear it
                # from the store, and a signal while the store does not answer
                self._channels.append(self._callers[k].wait(
                    ticket, timeout + 5, f"ps:{k}'s channel", stop, coordinator.check_open))
            except ParameterServerError:
                raise
            except RuntimeError as exc:  # gloo's, as the job ends: never raw
                raise self._failed(k, exc) from None

    # -- the exchange ----------------------------------------------------------------------
    def exchange(self, messages: dict[int, tuple[int, list[torch.Tensor]]],
                 counted: bool | None = None) -> dict[int, list[torch.Tensor]]:
        """Send each ps ``k`` its ``messages[k]`` (op, payload), all at once, and take
        every answer, within ``strategy.timeout_s`` for the whole exchange (gloo bounds
        each tensor's send and receive alone: a silent ps held a worker many times as
        long); each on its channel's caller thread, so a second Ctrl-C or SIGTERM is
        heard while it waits. ``counted``: a training step's bytes (default: by op)."""
        tickets = {k: self._callers[k].submit(self._exchanger(k, op, payload, counted))
                   for k, (op, payload) in messages.items()}
        answers = {}
        for k, ticket in tickets.items():  # all posted: now the slowest one's time
            try:
                answers[k] = self._callers[k].wait(ticket, self._timeout,
                                                   f"parameter server {self._ps_names[k]}")
            except ParameterServerError:
                raise
            except RuntimeError as exc:
                raise self._failed(k, exc) from None
        return {k: self._answer(k, *answer) for k, answer in answers.items()}

    def _failed(self, k: int, exc: RuntimeError) -> ParameterServerError:
        """What a broken channel to ps ``k`` means: the chief ended the job (its reason),
        or that ps stopped answering."""
        ended = self._coordinator.ended_why()
        if ended is not None:
            return JobAborted(ended)
        return stopped_answering(self._ps_names[k], self.task, exc)

    def _exchanger(self, k: int, op: int, payload: list[torch.Tensor], counted: bool | None):
        channel, moved = self._channels[k], self._moved[k]
        count = counted if counted is not None else op in _TRAINING

        def exchange() -> tuple[int, list[torch.Tensor]]:
            sent, received = channel.sent_bytes, channel.received_bytes
            messages = channel.sent_messages + channel.received_messages
            channel.send(op, payload)
            answer = channel.recv()
            if count:  # one exchange at a time per ps: its caller's thread
                moved[0] += channel.sent_bytes - sent
                moved[1] += channel.received_bytes - received
                moved[2] += channel.sent_messages + channel.received_messages - messages
            return answer
        return exchange

    def _answer(self, k: int, answer: int, reply: list[torch.Tensor]) -> list[torch.Tensor]:
        if answer == ABORTED:  # the ps says why the job ended, or why it could not serve
            message = decode(reply[0])
            if isinstance(message, dict):  # the ps's own failure, which ended the job
                self._coordinator.ended_why()  # read (ps:0 waits for every task to)
                raise HandlerError(f"ps:{k}{FAILED_REQUEST}"
                                   f"{message.get('worker', self.task)}: "
                                   f"{message['type']}: {message['message']}")
            # the job's one line (the first failure's), read from the store: counted there
            raise JobAborted(self._coordinator.ended_why() or message)
        if answer == REFUSED:  # this worker's model is not the job's
            raise ClusterMismatch(decode(reply[0]))
        return reply

    def _call(self, k: int, op: int, payload: list[torch.Tensor],
              counted: bool | None = None) -> list[torch.Tensor]:
        return self.exchange({k: (op, payload)}, counted)[k]

    # -- variables -------------------------------------------------------------------------
    def register(self, held: list[list[tuple[Shard, torch.Tensor, dict]]],
                 whole: list[list[torch.Tensor]], initializers: dict | None = None) -> None:
        """Offer each ps its shards (``(shard, values, flags)``) and take the values it
        holds for those served whole (``whole[k]``: where they go). Values travel only
        when the ps asks for them: the first worker's initialize a shard, later workers
        take the ps's. A shard flagged ``init`` has none: the ps makes it from its
        variable's ``initializers[var]`` (:mod:`.initializers`), or leaves it to a
        restore (``init: restored``)."""
        metas = {k: {"shards": [{"id": s.id, "var": s.var, "start": s.start,
                                 "shape": list(t.shape), **flags,
                                 "dtype": str(t.dtype).replace("torch.", "")}
                                for s, t, flags in shards]}
                 for k, shards in enumerate(held) if shards}
        replies = self.exchange({k: (REGISTER, [encode(meta)]) for k, meta in metas.items()})
        initializers = initializers or {}
        wanted = {k: (REGISTER, _with_values(
            {**metas[k], "initializers": {str(s.var): initializers[s.var]
                                          for s, _, f in held[k] if f.get("init") == "steps"}},
            [t for _, t, f in held[k] if not f.get("init")]))
            for k, reply in replies.items() if decode(reply[0])["need_values"]}
        replies.update(self.exchange(wanted))
        with torch.no_grad():
            for k, reply in replies.items():
                if whole[k]:
                    unflatten_into(whole[k], reply[1:])

    def register_optimizer(self, spec: dict) -> None:
        """Build the same optimizer on every ps (``spec``: :mod:`.optimizer_spec`)."""
        self.exchange({k: (OPTIMIZER, [encode(spec)]) for k in range(self.num_ps)})

    def lookup(self, requests: list[list[tuple[int, torch.Tensor, int]]],
               dtype: torch.dtype, counted: bool = True) -> list[list[torch.Tensor]]:
        """Table rows: ``requests[k]`` lists (shard id, shard-local row ids, row width)
        for ps k; the rows come back flat, one per request, in the same order; every ps
        at once. ``counted``: a training step's (not an evaluation's or a whole table's
        read).

        Raises:
          ParameterServerError: a ps answered other than the rows asked (their count,
            width or dtype): a short reply must not leave rows unread or shift the rest.
        """
        messages = {k: (LOOKUP, [encode({"shards": [[shard, len(ids)] for shard, ids, _ in
                                                    wanted]}),
                                 [ids for _, ids, _ in wanted]])
                    for k, wanted in enumerate(requests) if wanted}
        replies = self.exchange(messages, counted)
        answers: list[list[torch.Tensor]] = []
        for k, wanted in enumerate(requests):
            if not wanted:
                answers.append([])
                continue
            sizes = [len(ids) * width for _, ids, width in wanted]
            reply = replies[k] or [torch.empty(0, dtype=dtype)]
            if len(reply) != 1 or reply[0].numel() != sum(sizes) or reply[0].dtype != dtype:
                got = " + ".join(f"{p.numel()} {p.dtype}" for p in reply)
                raise ParameterServerError(
                    f"{self._ps_names[k]} answered a lookup of "
                    f"{sum(len(ids) for _, ids, _ in wanted)} table rows ({sum(sizes)} "
                    f"{dtype} values) with {got} values; is every task of the job "
                    "running the same csrun?")
            answers.append(list(reply[0].split(sizes)))
        return answers

    def assign(self, writes: list[list[tuple[int, torch.Tensor, torch.Tensor]]]) -> None:
        """Write table rows: ``writes[k]`` lists (shard id, shard-local ids, rows)."""
        self.exchange({k: (ASSIGN, [encode({"shards": [[shard, len(ids)]
                                                      for shard, ids, _ in rows]}),
                                    [i for _, i, _ in rows]] +
                           by_dtype([r for _, _, r in rows]))
                       for k, rows in enumerate(writes) if rows})

    def push_pull(self, pushes: list[Push | None], settings: list[dict],
                  values: list[list[torch.Tensor]], count_on: int, optimizer: int = 0) -> None:
        """Send each ps its gradients (``pushes[k]``, one request carrying all of this
        step's tables and variables), every ps at once, and take the new values of the
        shards it serves whole (into ``values[k]``). ``settings``: each param group's
        hyperparameters now (a schedule's changes reach the ps); ``count_on``: the ps
        that counts the step in the job's books (one per push, where it is applied), or
        -1: none; ``optimizer``: which of the worker's optimizers steps (its key)."""
        messages = {}
        for k, push in enumerate(pushes):
            if push is None:
                continue
            meta = {"dense": [i for i, _ in push.dense], "settings": settings,
                    "count": k == count_on, "optimizer": optimizer,
                    "rows": [[i, len(ids), mode] for i, ids, _, mode in push.rows]}
            ids = [ids for _, ids, _, _ in push.rows] or [torch.empty(0, dtype=torch.int64)]
            # the parts as they are: the channel copies each once, into the message
            messages[k] = (PUSH_PULL, [encode(meta), ids] + by_dtype(
                [g for _, g in push.dense] + [v for _, _, v, _ in push.rows]))
        replies = self.exchange(messages)
        with torch.no_grad():
            for k, reply in replies.items():
                if values[k]:
                    unflatten_into(values[k], reply)
        self.steps += optimizer == 0  # a training step: its first optimizer's push

    def pull(self, values: list[list[torch.Tensor]]) -> None:
        replies = self.exchange({k: (PULL, []) for k in range(self.num_ps) if values[k]})
        with torch.no_grad():
            for k, reply in replies.items():
                unflatten_into(values[k], reply)

    def state(self) -> list[dict]:
        replies = self.exchange({k: (STATE, []) for k in range(self.num_ps)})
        return [unpack_state(replies[k][0]) for k in range(self.num_ps)]

    def load(self, states: list[dict]) -> None:
        self.exchange({k: (LOAD, [pack_state(state)]) for k, state in enumerate(states)})

    def save(self, folder: str, stem: str, holding: list[bool]) -> list[dict]:
        """Each ps that holds shards writes them to ``folder/STEM.ps-K.safetensors``, all
        at once; their records (:meth:`.shards.HeldShards.save`), by ps."""
        replies = self.exchange({k: (SAVE, [encode({"folder": folder,
                                                    "name": f"{stem}.ps-{k}.safetensors"})])
                                 for k in range(self.num_ps) if holding[k]})
        return [decode(replies[k][0]) for k in sorted(replies)]

    def restore(self, folder: str, sources: list[list[dict]], version: int) -> None:
        """Each ps reads its shards' rows from the files ``sources[k]``, all at once."""
        self.exchange({k: (RESTORE, [encode({"folder": folder, "sources": sources[k],
                                             "version": version})])
                       for k in range(self.num_ps)})

    # -- what moved ------------------------------------------------------------------------
    def transfer_stats(self) -> dict:
        """What this process moved to and from the ps tasks for its steps (lookups and
        pushes; headers included), in all and per step; ``messages_per_step``: the
        transport's sends and receives a step costs, every ps's together."""
        pushed = sum(m[0] for m in self._moved)
        pulled = sum(m[1] for m in self._moved)
        per = max(1, self.steps)
        return {"steps": self.steps, "pushed_bytes": pushed, "pulled_bytes": pulled,
                "pushed_bytes_per_step": pushed / per, "pulled_bytes_per_step": pulled / per,
                "messages_per_step": sum(m[2] for m in self._moved) / per}

    def finish(self) -> None:
        """Say goodbye to every ps (this worker is done)."""
        for channel in self._channels:
            try:
                channel.send(BYE, [])
            except RuntimeError:
                pass
