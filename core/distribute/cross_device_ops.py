"""Collectives between the replicas of one ``run``: all_reduce, all_gather, merge_call.

Each collective is a rendezvous of :class:`~csrun.core.distribute.replica_run.ReplicaRun`: every
replica hands in its value, the last one to arrive combines them on the parameter device,
and each replica receives its own copy on its own device. ``all_reduce`` and
``all_gather`` are differentiable: their backward pass is itself a collective, so every
replica that calls ``backward`` must do so (as with ``torch.distributed``), inside the
run, or in a later run of the same strategy that backpropagates the replicas' outputs
(``DataParallel``'s backward run), where they meet in that run.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from . import context
from .reduce import ReduceOp, gather_values, reduce_values
from .values import flatten, map_structure, regroup, select_replica

__all__ = ["Collectives"]


def _wait(stream, other) -> None:
    """``stream`` waits (on the device) for the work queued on ``other`` so far."""
    if stream != other:
        stream.wait_stream(other)


def _rebuild_like(value: Any, leaves: list) -> Any:
    it = iter(leaves)
    return map_structure(lambda _: next(it), value)


def _check_tensors(kind: str, leaves: list) -> None:
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor):
            raise ValueError(
                f"{kind} takes tensors (or nests of tensors), got {type(leaf).__name__} "
                f"{leaf!r}; wrap Python numbers with torch.tensor(...)"
            )


class Collectives:
    """The collectives of one run, bound to its rendezvous and the strategy's devices."""

    __slots__ = ("_run", "_strategy", "_devices", "_reduce_device", "_streams", "_timing")

    def __init__(self, run, strategy, devices: list, reduce_device: torch.device,
                 streams: list | None = None, timing=None):
        self._run = run
        self._strategy = strategy
        self._devices = devices  # each replica's torch device (the strategy's own list)
        self._reduce_device = reduce_device
        self._streams = streams  # the replicas' CUDA streams, None without GPU replicas
        self._timing = timing  # the run's RunTiming when its replicas' speed is measured

    def _meet(self, replica_id: int, kind: str, payload: Any,
              merge: Callable[[list], list]) -> Any:
        """The run's rendezvous; a measured run counts the wait as no work of this
        replica's (a fast replica waits here for the slow ones)."""
        timing = self._timing
        if timing is None:
            return self._run.sync(replica_id, kind, payload, merge)
        timing.arrive(replica_id)
        try:
            return self._run.sync(replica_id, kind, payload, merge)
        finally:
            timing.depart(replica_id)

    def _await_replicas(self) -> None:
        """Order the merge after every GPU replica's queued work without the host
        waiting (a host wait would stall every replica at every synchronized BatchNorm).
        On the merging thread, each replica device's current stream waits for that
        replica's stream, and the reduce device's for every replica's: torch's copies
        between devices wait for both devices' current streams, so whatever the merge
        reads or writes there comes after what the replicas queued."""
        streams = self._streams
        if streams is None:
            return
        reduce = self._reduce_device if self._reduce_device.type == "cuda" else None
        for device, stream in zip(self._devices, streams):
            if stream is None:
                continue
            _wait(torch.cuda.current_stream(device), stream)
            if reduce is not None and reduce != device:
                _wait(torch.cuda.current_stream(reduce), stream)

    def _hand_back(self, per_replica: list) -> None:
        """Each GPU replica's stream waits for the merge's work on its device and on the
        reduce device, and each of its results made on another stream is marked used by
        it (the caching allocator must not hand that memory out while the replica still
        reads it)."""
        streams = self._streams
        if streams is None:
            return
        reduce = self._reduce_device if self._reduce_device.type == "cuda" else None
        for device, stream, results in zip(self._devices, streams, per_replica):
            if stream is None:
                continue
            if reduce is not None and reduce != device:
                _wait(stream, torch.cuda.current_stream(reduce))
            current = torch.cuda.current_stream(device)
            if current == stream:
                continue
            stream.wait_stream(current)
            for leaf in flatten(results):
                if isinstance(leaf, torch.Tensor) and leaf.device == device:
                    leaf.record_stream(stream)

    # -- helpers -------------------------------------------------------------------------
    def _invalidate_copies(self, by_user: bool = True) -> None:
        """A merge may have updated central values: copies must refresh before next use
        (all of them after user code, see ReplicaServing.invalidate)."""
        for serving in self._run.servings:
            serving.invalidate(by_user)

    def _spread(self, result: torch.Tensor) -> list:
        """One copy of ``result`` per replica, each on its replica's device."""
        copies, seen = [], set()
        for device in self._devices:
            copy = result.to(device)
            if id(copy) in seen:  # same physical device: give each replica its own tensor
                copy = copy.clone()
            seen.add(id(copy))
            copies.append(copy)
        return copies

    def _combine(self, kind: str, payloads: list, combine: Callable[[list], torch.Tensor]):
        counts = {len(p) for p in payloads}
        if len(counts) > 1:
            raise ValueError(f"{kind}: replicas passed nests with different numbers of "
                             f"tensors ({[len(p) for p in payloads]})")
        self._await_replicas()
        per_replica = [[] for _ in payloads]
        for position in range(len(payloads[0])):
            combined = combine([p[position] for p in payloads])
            for replica_id, copy in enumerate(self._spread(combined)):
                per_replica[replica_id].append(copy)
        self._hand_back(per_replica)
        return per_replica

    # -- all_reduce ----------------------------------------------------------------------
    def reduce_tensors(self, replica_id: int, op: ReduceOp, tensors: list, kind: str) -> list:
        def merge(payloads):
            return self._combine(kind, payloads, lambda values: reduce_values(
                op, values, None, self._reduce_device))
        with torch.no_grad():
            return self._meet(replica_id, kind, tensors, merge)

    def all_reduce(self, replica_id: int, op: ReduceOp, value: Any) -> Any:
        leaves = flatten(value)
        _check_tensors("all_reduce", leaves)
        if torch.is_grad_enabled() and any(t.requires_grad for t in leaves):
            reduced = _AllReduce.apply(self, replica_id, op, *leaves)
        else:
            reduced = self.reduce_tensors(replica_id, op, leaves, "all_reduce")
        return _rebuild_like(value, list(reduced))

    # -- all_gather ----------------------------------------------------------------------
    def gather_tensors(self, replica_id: int, tensors: list, axis: int) -> tuple[list, list]:
        """Gathered tensors for this replica, and where its own block starts in each."""
        def merge(payloads):
            gathered = self._combine("all_gather", payloads, lambda values: gather_values(
                values, axis, self._reduce_device))
            offsets = [[sum(p[pos].shape[axis] for p in payloads[:r])
                        for pos in range(len(payloads[0]))] for r in range(len(payloads))]
            return list(zip(gathered, offsets))
        with torch.no_grad():
            return self._meet(replica_id, "all_gather", tensors, merge)

    def all_gather(self, replica_id: int, value: Any, axis: int) -> Any:
        leaves = flatten(value)
        _check_tensors("all_gather", leaves)
        if torch.is_grad_enabled() and any(t.requires_grad for t in leaves):
            gathered = _AllGather.apply(self, replica_id, axis, *leaves)
        else:
            gathered = self.gather_tensors(replica_id, leaves, axis)[0]
        return _rebuild_like(value, list(gathered))

    # -- merge_call ----------------------------------------------------------------------
    def merge_call(self, replica_id: int, merge_fn: Callable, args: tuple, kwargs: dict):
        strategy = self._strategy

        def merge(payloads):
            merged_args = regroup([p[0] for p in payloads])
            merged_kwargs = regroup([p[1] for p in payloads])
            entry = context.Entry(strategy)
            context.push(entry)
            self._await_replicas()
            # The replicas' gradients so far, summed into .grad: merge_fn may step the
            # optimizer (TF's apply_gradients in merge_call), and with one replica on the
            # parameter device they are there already
            strategy.extended.store.flush_pending()
            try:
                result = merge_fn(strategy, *merged_args, **merged_kwargs)
            finally:
                context.pop(entry)
            self._invalidate_copies()
            results = [select_replica(r, result) for r in range(len(payloads))]
            self._hand_back(results)
            return results

        return self._meet(replica_id, "merge_call", (tuple(args), dict(kwargs)), merge)

    def custom(self, replica_id: int, kind: str, payload: Any,
               merge: Callable[[list], list]) -> Any:
        """A rendezvous with a caller-defined merge (variable updates use it)."""
        def settled(payloads):
            self._await_replicas()
            results = merge(payloads)
            self._invalidate_copies(by_user=False)
            self._hand_back(results)
            return results
        return self._meet(replica_id, kind, payload, settled)


def _backward_collectives(ctx) -> Collectives:
    """Where a collective's backward meets the other replicas: the forward's run while it
    lasts (``backward`` inside ``run``), else the strategy's run in progress, which this
    backward is part of (``DataParallel`` runs the replicas' backward as a run of its
    own). Not by the thread's replica context: a GPU replica's backward runs on
    autograd's device thread, which has none."""
    collectives = ctx.collectives
    if not collectives._run.returned:
        return collectives
    current = collectives._strategy.extended.current_run
    if current is None:
        raise RuntimeError(
            "the backward of a collective (all_reduce, all_gather, synchronized BatchNorm) "
            "reached after its run returned, outside any run: its replicas cannot meet. "
            "Call backward inside the replica function, or wrap the model in "
            "csrun.core.DataParallel, whose backward runs the replicas")
    return current.collectives


class _AllReduce(torch.autograd.Function):
    """all_reduce whose gradient is the same all_reduce of the incoming gradients."""

    @staticmethod
    def forward(ctx, collectives, replica_id, op, *tensors):
        ctx.collectives, ctx.replica_id, ctx.op = collectives, replica_id, op
        return tuple(collectives.reduce_tensors(replica_id, op, list(tensors), "all_reduce"))

    @staticmethod
    def backward(ctx, *grads):
        reduced = _backward_collectives(ctx).reduce_tensors(
            ctx.replica_id, ctx.op, list(grads), "all_reduce (backward)")
        return (None, None, None, *reduced)


class _AllGather(torch.autograd.Function):
    """all_gather whose gradient is this replica's slice of the summed gradients."""

    @staticmethod
    def forward(ctx, collectives, replica_id, axis, *tensors):
        ctx.collectives, ctx.replica_id, ctx.axis = collectives, replica_id, axis
        ctx.sizes = [t.shape[axis] for t in tensors]
        gathered, ctx.offsets = collectives.gather_tensors(replica_id, list(tensors), axis)
        return tuple(gathered)

    @staticmethod
    def backward(ctx, *grads):
        summed = _backward_collectives(ctx).reduce_tensors(
            ctx.replica_id, ReduceOp.SUM, list(grads), "all_gather (backward)")
        pieces = [g.narrow(ctx.axis, off, size)
                  for g, off, size in zip(summed, ctx.offsets, ctx.sizes)]
        return (None, None, None, *pieces)
