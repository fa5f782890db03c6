"""The aten ops a training step issues, counted on every thread the step runs on.

A :class:`OpCount` is a ``TorchDispatchMode`` per thread around one shared tally: the
caller enters it around the step (:meth:`OpCount.counting`), and a replica function enters
it again on its own thread (:meth:`OpCount.replica`): replicas that meet at a rendezvous
run on worker threads, which a mode entered on the caller's thread does not see.

Besides the op names it keeps, for the ops that wait for a device (:data:`SYNCS`) and the
ops that copy (:data:`COPIES`), the tensors they read and made, so a test can ask whether a copy
read or wrote a model's parameters, buffers or gradients (by storage, with every touched
tensor kept alive until then, so no address is reused by a later tensor).
"""

from __future__ import annotations

import collections
import contextlib
import threading

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# What makes the host wait for a device (on a CPU they cost nothing, but they are the
# same calls): reading a value (item/float/bool of a tensor -> _local_scalar_dense),
# comparing (equal, allclose), data-dependent shapes (nonzero).
SYNCS = frozenset({"_local_scalar_dense", "item", "equal", "is_nonzero", "nonzero",
                   "allclose"})
COPIES = frozenset({"copy_", "_to_copy", "clone", "cat", "stack", "_copy_from",
                    "_copy_from_and_resize", "lift_fresh_copy"})


class _Mode(TorchDispatchMode):
    def __init__(self, count: "OpCount"):
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.count.record(func.overloadpacket.__name__, (args, kwargs, out))
        return out


class OpCount:
    """``ops``: op name -> count; ``touched``: (op name, tensors) of every sync or copy."""

    def __init__(self):
        self.ops: collections.Counter = collections.Counter()
        self.touched: list[tuple[str, list]] = []
        self._lock = threading.Lock()
        self._threads: set[int] = set()

    def record(self, name: str, inputs_and_outputs) -> None:
        with self._lock:
            self.ops[name] += 1
            if name in SYNCS or name in COPIES:
                tensors = [t for t in tree_leaves(inputs_and_outputs)
                           if isinstance(t, torch.Tensor)]
                self.touched.append((name, tensors))

    @contextlib.contextmanager
    def counting(self):
        """Count this thread's ops (the caller's, around a whole step)."""
        ident = threading.get_ident()
        if ident in self._threads:  # entered already: a mode twice would count twice
            yield self
            return
        self._threads.add(ident)
        try:
            with _Mode(self):
                yield self
        finally:
            self._threads.discard(ident)

    replica = counting  # the same, entered in a replica function on its own thread

    def syncs(self) -> list[tuple[str, list]]:
        return [(name, ts) for name, ts in self.touched if name in SYNCS]

    def copies_of(self, tensors) -> list[str]:
        """The copy ops that read or wrote the storage of any of ``tensors``."""
        storages = {_storage(t) for t in tensors if t is not None}
        return [name for name, ts in self.touched
                if name in COPIES and any(_storage(t) in storages for t in ts)]


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def model_tensors(model: torch.nn.Module) -> list[torch.Tensor]:
    """A model's parameters, buffers and the parameters' gradients."""
    params = list(model.parameters())
    return params + list(model.buffers()) + [p.grad for p in params if p.grad is not None]
