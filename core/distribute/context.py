"""Which strategy is current, and whether code runs in cross-replica or replica context.

TF's model, kept as is:

* outside any scope: the *default strategy* (one replica, no distribution);
* inside ``strategy.scope()``: *cross-replica context* -- ``get_replica_context()`` is None;
* inside a function given to ``strategy.run``: *replica context* -- ``get_replica_context()``
  returns a :class:`ReplicaContext` for that replica;
* inside ``merge_call``'s ``merge_fn``: cross-replica context again.

The state is thread-local, as in TF: each replica thread sees its own replica context.

The stack knows no default strategy: ``get_strategy`` and ``get_replica_context``, which
answer with it outside any scope, live with it in ``strategy.py`` (this module stays below
the strategy, so the two never import each other).
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from .reduce import ReduceOp

__all__ = [
    "has_strategy",
    "in_cross_replica_context",
    "get_cross_replica_context",
    "ReplicaContext",
    "cross_replica_required",
    "require_cross_replica_or_default",
    "Entry",
    "DefaultMergeEntry",
    "call_as_replica",
    "in_default_replica_mode",
]


class Entry:
    """One level of the context stack: a strategy and, in replica context, its replica."""

    __slots__ = ("strategy", "replica", "serving")

    def __init__(self, strategy, replica=None, serving=None):
        self.strategy = strategy
        self.replica = replica
        self.serving = serving  # the replica's parameter view (see parameters.py)


_BOTTOM = Entry(None)


class DefaultMergeEntry(Entry):
    """The default strategy's cross-replica context: where the default replica context's
    ``merge_call`` runs ``merge_fn`` (TF: ``get_replica_context()`` is None there,
    ``in_cross_replica_context()`` True, ``has_strategy()`` False)."""

    __slots__ = ()

    def __init__(self):
        super().__init__(None)


def in_default_replica_mode(entry: Entry | None = None) -> bool:
    """Outside every strategy's scope and run and every ``merge_fn``: where the default
    replica context is the replica context."""
    entry = current_entry() if entry is None else entry
    return entry.strategy is None and type(entry) is not DefaultMergeEntry


class _ThreadContext(threading.local):
    """This thread's context stack; ``serving`` mirrors the top entry's, for the hot path
    (every parameter access in a forward pass asks for it)."""

    def __init__(self):
        self.stack = [_BOTTOM]
        self.serving = None


_tls = _ThreadContext()


def current_entry() -> Entry:
    """The innermost context entry of this thread."""
    return _tls.stack[-1]


def push(entry: Entry) -> None:
    tls = _tls
    tls.stack.append(entry)
    tls.serving = entry.serving


def pop(entry: Entry) -> None:
    tls = _tls
    stack = tls.stack
    if stack[-1] is not entry:  # pragma: no cover - guards misuse of the internals
        raise RuntimeError("csrun context stack corrupted: scopes exited out of order")
    stack.pop()
    tls.serving = stack[-1].serving


_new = object.__new__


def call_as_replica(strategy, replica_id: int, local_id: int, run, serving, fn: Callable,
                    args: tuple, kwargs: dict | None) -> Any:
    """``fn(*args, **kwargs)`` as replica ``local_id`` of ``run`` (``replica_id`` in the
    sync group): its :class:`ReplicaContext` and :class:`Entry` made, pushed, the call
    and the pop in one frame. Each replica of every run enters one: the two
    constructors' frames and a call for the push and pop were a tenth of an empty step,
    so their fields are set here (the constructors' own, as a test checks)."""
    replica = _new(ReplicaContext)  # ReplicaContext(strategy, replica_id, run, local_id)
    replica.strategy, replica._replica_id, replica._local_id, replica._run = \
        strategy, replica_id, local_id, run
    entry = _new(Entry)  # Entry(strategy, replica, serving)
    entry.strategy, entry.replica, entry.serving = strategy, replica, serving
    tls = _tls
    stack = tls.stack
    stack.append(entry)
    tls.serving = serving
    try:
        return fn(*args, **kwargs) if kwargs else fn(*args)
    finally:
        if stack[-1] is not entry:  # pragma: no cover - guards misuse of the internals
            raise RuntimeError("csrun context stack corrupted: scopes exited out of order")
        stack.pop()
        tls.serving = stack[-1].serving


def current_serving():
    """The parameter view of the replica running on this thread, or None (hot path)."""
    return _tls.serving


def has_strategy() -> bool:
    """True inside a (non-default) strategy's scope or run."""
    return current_entry().strategy is not None


def in_cross_replica_context() -> bool:
    """True inside a strategy's scope but not inside one of its replicas, and in a
    ``merge_fn`` of the default replica context."""
    entry = current_entry()
    return entry.replica is None and not in_default_replica_mode(entry)


def get_cross_replica_context():
    """The strategy when in cross-replica context, else None (TF's internal helper)."""
    entry = current_entry()
    return entry.strategy if entry.strategy is not None and entry.replica is None else None


def cross_replica_required(method: str, hint: str | None = None) -> None:
    """Raise TF's error when a cross-replica method is called inside a replica (``hint``:
    another way to get there than ``merge_call``)."""
    if current_entry().replica is not None:
        raise RuntimeError(
            f"{method} requires being in cross-replica context (it was called inside "
            "strategy.run); "
            + (hint or "use get_replica_context().merge_call() to get there"))


def require_cross_replica_or_default(strategy, method: str, hint: str | None = None) -> None:
    """TF's check before a cross-replica method of ``strategy``: it runs in that strategy's
    cross-replica context, or outside every strategy (the default one's); in another
    strategy's scope or run it is "mixing" them, in a replica of its own a RuntimeError
    that says how to get there (``hint``: another way)."""
    entry = _tls.stack[-1]  # current_entry(), inline: asked on every reduce
    if entry.strategy is None or (entry.strategy is strategy and entry.replica is None):
        return
    if entry.strategy is not strategy:
        raise RuntimeError(f"Mixing different strategies: {method} of {strategy!r} was called "
                           f"in the scope (or run) of {entry.strategy!r}")
    cross_replica_required(method, hint)  # in a replica of its own


class ReplicaContext:
    """What a function running under ``strategy.run`` knows and can do as one replica.

    Attributes:
      strategy: the strategy running this replica.
      replica_id_in_sync_group: this replica's index, ``0 .. num_replicas_in_sync - 1``.
      num_replicas_in_sync: how many replicas run in step.

    Example::

        def step(x):
            ctx = csrun.core.get_replica_context()
            total = ctx.all_reduce("SUM", x.sum())   # same value on every replica
            return total / ctx.num_replicas_in_sync
    """

    def __init__(self, strategy, replica_id: int, run=None, local_id: int | None = None):
        self.strategy = strategy
        self._replica_id = replica_id  # in the whole sync group (all workers)
        self._local_id = replica_id if local_id is None else local_id  # on this worker
        self._run = run  # the ReplicaRun that synchronizes replicas; None: default context

    @property
    def replica_id_in_sync_group(self) -> int:
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self.strategy.num_replicas_in_sync

    @property
    def devices(self) -> tuple[str, ...]:
        """The canonical name of this replica's device, as a 1-tuple (TF's form)."""
        return (self.strategy.extended.worker_devices[self._local_id],)

    @property
    def device(self):
        """The :class:`torch.device` that holds this replica's tensors."""
        return self.strategy.extended.compute_devices[self._local_id].torch_device

    # -- for the engine (variables, synchronized BatchNorm) ------------------------------
    @property
    def has_peers(self) -> bool:
        """True when other replicas of this run meet this one at rendezvous."""
        return self._run is not None and self._run.num_replicas > 1

    def rendezvous(self, kind: str, payload: Any, merge: Callable[[list], list]) -> Any:
        """Meet the other replicas (``has_peers`` must be true); ``merge`` gets every
        replica's ``payload`` in replica order, runs once, and returns one result per
        replica; this replica gets its own. ``kind`` names the call in errors."""
        return self._run.collectives.custom(self._local_id, kind, payload, merge)

    def all_reduce(self, reduce_op: Any, value: Any) -> Any:
        """Reduce ``value`` (a nest of tensors) over the replicas of this machine; each gets
        the result. Differentiable: the gradient flows back to every replica's input.
        """
        op = ReduceOp.resolve(reduce_op)
        if self._run is None:
            _default_replica_only(self, "all_reduce")
            return value
        if current_entry().replica is not self:
            self._run.refuse_outside(self._replica_id, "all_reduce")
        return self._run.collectives.all_reduce(self._local_id, op, value)

    def all_gather(self, value: Any, axis: int) -> Any:
        """Concatenate ``value`` (a nest of tensors) of every replica along ``axis``."""
        if self._run is None:
            _default_replica_only(self, "all_gather")
            return value
        if current_entry().replica is not self:
            self._run.refuse_outside(self._replica_id, "all_gather")
        return self._run.collectives.all_gather(self._local_id, value, axis)

    def merge_call(self, merge_fn: Callable, args: tuple = (), kwargs: dict | None = None):
        """Call ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context.

        Every replica must call ``merge_call``; ``merge_fn`` receives each argument as a
        PerReplica (or the plain value when every replica passed the same object). What it
        returns goes back to every replica (a PerReplica: each replica its component).

        Raises:
          RuntimeError: called anywhere but on the replica's own thread, in its context
            (another thread, merge_fn, after the run), as TF refuses it.
        """
        if self._run is None:  # the default replica context: merge_fn is cross-replica
            _default_replica_only(self, "merge_call")
            entry = DefaultMergeEntry()
            push(entry)
            try:
                return merge_fn(self.strategy, *args, **(kwargs or {}))
            finally:
                pop(entry)
        if current_entry().replica is not self:
            self._run.refuse_outside(self._replica_id, "merge_call")
        return self._run.collectives.merge_call(self._local_id, merge_fn, args, kwargs or {})

    def __repr__(self) -> str:
        return (f"ReplicaContext(replica_id_in_sync_group={self._replica_id}, "
                f"num_replicas_in_sync={self.num_replicas_in_sync})")


def _default_replica_only(replica: ReplicaContext, method: str) -> None:
    """TF's ``require_replica_context`` for the default replica context: it works only
    where it is the current one, not in a strategy's scope or run, nor in a merge_fn
    (the default one's included)."""
    if not in_default_replica_mode():
        raise RuntimeError(f"Need to be inside `call_for_each_replica()`: {method} of the "
                           "default replica context works only outside every strategy's "
                           "scope, run and merge_fn; use the replica context the code runs "
                           "in (get_replica_context())")
