"""The copy path: central parameters mirrored on a replica device as flat buffers.

GPU replicas (and, on request, logical CPU replicas) cannot alias the central storage, so
each keeps a mirror: one flat buffer per dtype holding every tracked parameter, refreshed
at each run's first read (a write through ``.data`` changes no version to tell it by); in
a run's middle only what changed version. The replica's leaves are views into that
buffer. Each buffer moves in buckets (:mod:`.buckets`): one coalesced copy per bucket each
way, the gradients leaving while the backward still runs.

From a CPU parameter device to a GPU the copies go through pinned memory on side streams.

A copy replica's buffers (BatchNorm's running statistics, a user's counters) are per
replica, as TF's variables written in replica context are: :class:`BufferMirror` keeps
those it reads in one flat buffer per dtype, filled by one copy at the run's first buffer
read; after the run, the dtypes holding a written one go to the parameter device in one
copy each, where the writes are combined (:mod:`.parameters`).
"""

from __future__ import annotations

import torch

from . import torch_internals
from .buckets import DEFAULT_BYTES_PER_PACK, Bucket, pinned_home, plan, transport_for

__all__ = ["DeviceMirror", "BufferMirror", "finish_grads"]

_tensor_version = torch_internals.tensor_version  # bound: read on every refresh


class _Group:
    """The tensors of one dtype, their flat mirror, cut into buckets."""

    def __init__(self, tensors: list, device: torch.device, transport, bytes_per_pack: int):
        self.tensors = tensors
        numels = [t.numel() for t in tensors]
        dtype = tensors[0].dtype
        self.flat = torch.empty(sum(numels), dtype=dtype, device=device)
        self.transport = transport
        # GPU replicas of CPU parameters copy from the central tensors' own pinned memory
        home = pinned_home(tensors, transport) if transport.staged else None
        self.leaves = []
        offsets = [0]
        for tensor, numel in zip(tensors, numels):
            view = self.flat[offsets[-1]:offsets[-1] + numel].view(tensor.shape)
            self.leaves.append(view.detach().requires_grad_(tensor.requires_grad))
            offsets.append(offsets[-1] + numel)
        ranges = plan(numels, self.flat.element_size(), bytes_per_pack)
        self.buckets = [
            Bucket(tensors[a:b], self.leaves[a:b], self.flat[offsets[a]:offsets[b]],
                   None if home is None else home[offsets[a]:offsets[b]],
                   transport, hooked=len(ranges) > 1)
            for a, b in ranges]
        self.version = None  # the flat buffer's version after the last copy into it

    def refresh(self, force: bool) -> None:
        copied = False
        with torch.no_grad():
            for bucket in self.buckets:
                copied = bucket.copy_in(force) or copied
        if copied:
            self.version = _tensor_version(self.flat)

    def written(self) -> list:
        """The central tensors whose copies a replica wrote in place since the last copy:
        none unless the flat buffer's version moved (one read; the leaves share its
        counter), which only a write to a leaf does. Found by the version alone, so a
        step never waits for the device to tell; a write that changed no value (an
        ``Embedding(max_norm=...)`` whose rows were short enough) counts too, as the same
        code would lose a write another step. The values are compared only to name the
        tensors, on the way to an error: those that changed, else all of the buffer's."""
        if _tensor_version(self.flat) == self.version:
            return []
        changed = [t for t, leaf in zip(self.tensors, self.leaves)
                   if not torch.equal(leaf.detach().to(t.device), t.detach())]
        return changed or list(self.tensors)

    def start_grads(self, transfers: list) -> None:
        """Each bucket's gradients into ``transfers``, numbered in the order they left
        (:meth:`Bucket.take`); those that did not leave during the backward go now, in
        one copy."""
        rest: list = []
        for bucket in self.buckets:
            bucket.take(transfers, rest)
        if rest:
            with torch.no_grad():
                flat, event = self.transport.send([g for _, g in rest])
            pairs, offset = [], 0
            for central, grad in rest:
                pairs.append((central, offset))
                offset += grad.numel()
            transfers.append((self.transport.next_number(), (pairs, flat, event)))


class DeviceMirror:
    """Flat copies of a store's tracked tensors on one replica device.

    ``bytes_per_pack``: the most bytes a bucket holds (:func:`.buckets.plan`)."""

    def __init__(self, device: torch.device, param_device: torch.device,
                 bytes_per_pack: int = DEFAULT_BYTES_PER_PACK):
        self.device = device
        self.param_device = param_device
        self.bytes_per_pack = bytes_per_pack
        self._transport = transport_for(device, param_device)
        self._groups: list[_Group] = []
        self._leaf_of: dict = {}  # central tensor -> (leaf, its bucket, index in it)
        self._generation = -1

    def refresh(self, store, reset_grads: bool = True, force: bool = False) -> None:
        """Bring every leaf up to date with the central tensors.

        ``reset_grads`` starts a new run; a refresh in the middle of a run (after a merge
        updated parameters) keeps the gradients the leaves already hold. Without
        ``force`` only the buckets whose tensors changed version are copied: a write
        through ``.data`` (``p.data.copy_(ema)``) changes none, so a run's first refresh,
        and the one after user code ran in ``merge_call``, copy everything (as
        ``DataParallel`` copies on every forward). A run's first refresh leaves each
        bucket's copy to be waited for at its first read (:meth:`leaf`); a later one
        waits for them at once, as leaves already served read the buffers.
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
        self._transport.begin_copy_in()
        for group in self._groups:
            group.refresh(force)
            for bucket in group.buckets:
                if reset_grads:
                    bucket.new_run()
                else:
                    bucket.wait_in()
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
        groups = [_Group(ts, self.device, self._transport, self.bytes_per_pack)
                  for ts in by_dtype.values()]
        for group in groups:
            for bucket in group.buckets:
                for index, (tensor, leaf) in enumerate(zip(bucket.tensors, bucket.leaves)):
                    self._leaf_of[tensor] = (leaf, bucket, index)
        self._groups += groups

    def written(self) -> list:
        """The central tensors whose copies were written in place since the last copy."""
        return [t for group in self._groups for t in group.written()]

    def leaf(self, central: torch.Tensor) -> torch.Tensor:
        """The replica's leaf for ``central``, read from now on: its bucket's copy is
        waited for (once), and its gradient awaited before the bucket leaves."""
        entry = self._leaf_of.get(central)
        if entry is None:
            raise KeyError("csrun: a served tensor is not tracked by its strategy")
        leaf, bucket, index = entry
        bucket.serve(index)
        return leaf

    def copied_in(self) -> None:
        """Wait (the host) until every copy in has read the central tensors: then they
        may change (a run returning before its gradients arrive, offload.py)."""
        for group in self._groups:
            for bucket in group.buckets:
                bucket.copied_in()

    @property
    def buckets(self) -> list:
        """Every bucket, by dtype, in creation order."""
        return [bucket for group in self._groups for bucket in group.buckets]

    def start_grads(self) -> list:
        """Hand over this replica's new gradients on their way to the parameter device.

        One coalesced copy per bucket, most of them started by the backward itself; from
        a GPU to a CPU parameter device a non-blocking copy into fresh pinned memory (the
        caching host allocator makes that cheap), so the copies of several GPUs overlap.
        :func:`finish_grads` waits for them. Only leaves that received a gradient take
        part, with the gradient they hold now. In the order the copies left.
        """
        numbered: list = []
        for group in self._groups:
            group.start_grads(numbered)
        numbered.sort(key=lambda item: item[0])  # the order they left in
        return [transfer for _, transfer in numbered]


def finish_grads(transfers: list) -> tuple[list, list]:
    """Wait for :meth:`DeviceMirror.start_grads` copies; the central tensors and their
    gradients, each gradient a view of its arrived flat buffer."""
    centrals, grads = [], []
    for pairs, flat, event in transfers:
        if event is not None:
            event.synchronize()
        for tensor, offset in pairs:
            centrals.append(tensor)
            grads.append(flat[offset:offset + tensor.numel()].view(tensor.shape))
    return centrals, grads


class _BufferGroup:
    """The buffers of one dtype: their central tensors, one flat copy on the replica
    device, and an alias of each slot with a version counter of its own (views would
    share the flat's: a write to one would look like a write to all)."""

    __slots__ = ("centrals", "flat", "aliases")

    def __init__(self, centrals: list, device: torch.device):
        self.centrals = centrals
        total = sum(t.numel() for t in centrals)
        self.flat = torch.empty(total, dtype=centrals[0].dtype, device=device)
        storage, offset = self.flat.untyped_storage(), 0
        self.aliases = []
        for central in centrals:
            alias = self.flat.new_empty(0).set_(storage, offset, central.shape)
            self.aliases.append(alias)
            offset += central.numel()

    def copy_in(self, transport) -> None:
        transport.buffers_in([t.detach().reshape(-1) for t in self.centrals], self.flat)


class BufferMirror:
    """A copy replica's buffers on its device: one flat buffer per dtype, one copy in per
    dtype a run (at its first buffer read), one copy out per dtype holding a written one.

    The layout holds the central buffers this replica read: a buffer read for the first
    time (or replaced since, or resized) is copied by itself in that run and joins the
    layout for the next (:meth:`new_run`), so the steady state copies once per dtype."""

    def __init__(self, device: torch.device, param_device: torch.device):
        self.device = device
        self._transport = transport_for(device, param_device)
        self._groups: list[_BufferGroup] = []
        self._slot: dict = {}  # id(central) -> (central, its alias, its group)
        self._missing: list = []  # read this run, not in the layout: in it next run
        self._read: set = set()  # ids of the layout's buffers read this run
        self._copied = False  # this run's copy in is done

    def new_run(self) -> None:
        """A run begins: copy in again at its first read. Buffers missing from the layout
        last run join it; those the last run did not read leave it then (a buffer
        replaced every step must not grow it)."""
        self._copied = False
        if self._missing:
            self._build()
        self._read = set()

    def _build(self) -> None:
        centrals = [c for key, (c, _, _) in self._slot.items() if key in self._read]
        centrals += self._missing
        self._missing = []
        seen, by_dtype = set(), {}
        for central in centrals:
            if id(central) not in seen:
                seen.add(id(central))
                by_dtype.setdefault(central.dtype, []).append(central)
        with torch.no_grad(), torch.inference_mode(False):
            self._groups = [_BufferGroup(ts, self.device) for ts in by_dtype.values()]
        self._slot = {id(c): (c, alias, group) for group in self._groups
                      for c, alias in zip(group.centrals, group.aliases)}

    def serve(self, central: torch.Tensor) -> torch.Tensor | None:
        """This replica's copy of the buffer ``central`` for this run, or None when the
        layout lacks it (the caller copies it alone; it is in the layout next run).
        Never an inference tensor, even inside ``torch.inference_mode``: those keep no
        version, which tells whether the replica wrote its copy."""
        entry = self._slot.get(id(central))
        if entry is None or entry[0] is not central or entry[1].shape != central.shape \
                or entry[1].dtype != central.dtype:
            self._missing.append(central)
            return None
        self._read.add(id(central))
        if not self._copied:
            self._copied = True
            with torch.no_grad(), torch.inference_mode(False):
                for group in self._groups:
                    group.copy_in(self._transport)
        return entry[1]

    def send(self, written: list) -> tuple[dict, list]:
        """The written copies among ``written`` (this replica's, any tensors) on the
        parameter device: ``{id(copy): tensor there}`` for those this mirror holds, one
        copy per dtype holding one; and the events to wait for before reading them."""
        ids = {id(t) for t in written if t is not None}
        arrived, events = {}, []
        for group in self._groups:
            if not any(id(alias) in ids for alias in group.aliases):
                continue
            with torch.no_grad():
                flat, event = self._transport.buffers_out(group.flat)
            if event is not None:
                events.append(event)
            offset = 0
            for alias in group.aliases:
                arrived[id(alias)] = flat[offset:offset + alias.numel()].view(alias.shape)
                offset += alias.numel()
        return arrived, events
