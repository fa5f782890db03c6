"""The copy path: central parameters mirrored on a replica device as flat buffers.

GPU replicas (and, on request, logical CPU replicas) cannot alias the central storage, so
each keeps a mirror: one flat buffer per dtype holding every tracked parameter, refreshed
with a single coalesced copy at each run's first read (a write through ``.data`` changes no
version to tell it by); in a run's middle only what changed version. The replica's leaves
are views into that buffer; their gradients go back with one copy per dtype.

From a CPU parameter device to a GPU the refresh goes through a pinned staging buffer and a
non-blocking copy on the replica's current stream.
"""

from __future__ import annotations

import torch

from . import torch_internals

__all__ = ["DeviceMirror"]

_tensor_version = torch_internals.tensor_version  # bound: read for every tensor on every refresh


class _Group:
    """The tensors of one dtype and their flat mirror."""

    def __init__(self, tensors: list, device: torch.device, param_device: torch.device):
        self.tensors = tensors
        self.numels = [t.numel() for t in tensors]
        total = sum(self.numels)
        dtype = tensors[0].dtype
        self.flat = torch.empty(total, dtype=dtype, device=device)
        self.staging = None
        self.copied = None  # an event: the last copy out of ``staging`` has finished
        if device.type == "cuda" and param_device.type == "cpu":
            self.staging = torch.empty(total, dtype=dtype, pin_memory=True)
        self.leaves = []
        self.version = None  # the flat buffer's version after the last copy into it
        offset = 0
        for tensor, numel in zip(tensors, self.numels):
            view = self.flat[offset:offset + numel].view(tensor.shape)
            self.leaves.append(view.detach().requires_grad_(tensor.requires_grad))
            offset += numel
        self.stamp = None

    def refresh(self, force: bool) -> None:
        stamp = [(_tensor_version(t), t.data_ptr(), t.requires_grad) for t in self.tensors]
        if stamp == self.stamp and not force:
            return
        for tensor, leaf in zip(self.tensors, self.leaves):  # frozen or unfrozen since
            if leaf.requires_grad != tensor.requires_grad:
                leaf.requires_grad_(tensor.requires_grad)
        with torch.no_grad():
            flat = [t.detach().reshape(-1) for t in self.tensors]
            if self.staging is not None:
                if self.copied is not None:  # the last non-blocking copy may still read it
                    self.copied.synchronize()
                torch.cat(flat, out=self.staging)
                self.flat.copy_(self.staging, non_blocking=True)
                self.copied = torch.cuda.Event()
                self.copied.record()
            elif self.flat.device == self.tensors[0].device:
                torch.cat(flat, out=self.flat)
            else:
                self.flat.copy_(torch.cat(flat))
        self.stamp = stamp
        self.version = _tensor_version(self.flat)

    def written(self) -> list:
        """The central tensors whose copies a replica wrote in place since the last copy
        (one version read when none was: the leaves share the flat buffer's counter)."""
        if _tensor_version(self.flat) == self.version:
            return []
        return [t for t, leaf in zip(self.tensors, self.leaves)
                if not torch.equal(leaf.detach().to(t.device), t.detach())]


class DeviceMirror:
    """Flat copies of a store's tracked tensors on one replica device."""

    def __init__(self, device: torch.device, param_device: torch.device):
        self.device = device
        self.param_device = param_device
        self._groups: list[_Group] = []
        self._leaf_of: dict = {}
        self._generation = -1

    def refresh(self, store, reset_grads: bool = True, force: bool = False) -> None:
        """Bring every leaf up to date with the central tensors.

        ``reset_grads`` starts a new run; a refresh in the middle of a run (after a merge
        updated parameters) keeps the gradients the leaves already hold. Without
        ``force`` only the groups whose tensors changed version are copied: a write
        through ``.data`` (``p.data.copy_(ema)``) changes none, so a run's first refresh,
        and the one after user code ran in ``merge_call``, copy everything (as
        ``DataParallel`` copies on every forward).
        """
        # read before the tensors: one registered meanwhile by a replica adopting a
        # module (a run's middle) is then missed once, and found by the next refresh
        generation = store.generation
        if generation != self._generation or self._layout_changed():
            if reset_grads or self._layout_changed():
                self._build(store.tensors())
            else:  # tensors registered during a run: the leaves served so far stay valid
                self._extend(store.tensors())
            self._generation = generation
        for group in self._groups:
            group.refresh(force)
            if reset_grads:
                for leaf in group.leaves:
                    leaf.grad = None

    def prepare(self, store) -> None:
        """Lay out the flat buffers and leaves for tensors registered since (a first
        read inside ``torch.func.vmap`` cannot make a leaf there); the values come with
        the run's first :meth:`refresh`."""
        generation = store.generation  # before the tensors, as in refresh
        if generation != self._generation:
            self._build(store.tensors())
            self._generation = generation

    def _layout_changed(self) -> bool:
        """A central tensor changed dtype or size (e.g. ``model.double()``)."""
        return any(t.dtype != leaf.dtype or t.shape != leaf.shape
                   for group in self._groups for t, leaf in zip(group.tensors, group.leaves))

    def _build(self, tensors: list) -> None:
        self._groups, self._leaf_of = [], {}
        self._extend(tensors)

    def _extend(self, tensors: list) -> None:
        """Flat buffers for the tensors that have none yet (a module adopted in a run's
        middle: rebuilding would orphan the leaves already served, and their gradients)."""
        by_dtype: dict = {}
        for tensor in tensors:
            if tensor not in self._leaf_of:
                by_dtype.setdefault(tensor.dtype, []).append(tensor)
        groups = [_Group(ts, self.device, self.param_device) for ts in by_dtype.values()]
        for group in groups:
            for tensor, leaf in zip(group.tensors, group.leaves):
                self._leaf_of[tensor] = leaf
        self._groups += groups

    def written(self) -> list:
        """The central tensors whose copies were written in place since the last copy."""
        return [t for group in self._groups for t in group.written()]

    def leaf(self, central: torch.Tensor) -> torch.Tensor:
        leaf = self._leaf_of.get(central)
        if leaf is None:
            raise KeyError("csrun: a served tensor is not tracked by its strategy")
        return leaf

    def start_grads(self) -> list:
        """Start moving this replica's new gradients to the parameter device.

        One coalesced copy per dtype; from a GPU to a CPU parameter device it is a
        non-blocking copy into fresh pinned memory (the caching host allocator makes that
        cheap), so the copies of several GPUs overlap. :func:`finish_grads` waits for them.
        Only leaves that received a gradient take part.
        """
        transfers = []
        for group in self._groups:
            pairs = [(t, leaf) for t, leaf in zip(group.tensors, group.leaves)
                     if leaf.grad is not None]
            if not pairs:
                continue
            flat = torch.cat([leaf.grad.reshape(-1) for _, leaf in pairs])
            for _, leaf in pairs:
                leaf.grad = None
            if flat.device.type == "cuda" and self.param_device.type == "cpu":
                host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
                host.copy_(flat, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                transfers.append(([t for t, _ in pairs], host, event))
            else:
                transfers.append(([t for t, _ in pairs], flat.to(self.param_device), None))
        return transfers


def finish_grads(transfers: list) -> tuple[list, list]:
    """Wait for :meth:`DeviceMirror.start_grads` copies; the central tensors and their
    gradients, each gradient a view of its arrived flat buffer."""
    centrals, grads = [], []
    for tensors, flat, event in transfers:
        if event is not None:
            event.synchronize()
        offset = 0
        for tensor in tensors:
            numel = tensor.numel()
            centrals.append(tensor)
            grads.append(flat[offset:offset + numel].view(tensor.shape))
            offset += numel
    return centrals, grads
