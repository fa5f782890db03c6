"""Buckets: a copy replica's parameters and gradients moved in pieces, as a step makes them.

A copy replica (a GPU, or any replica with ``copy_parameters``) computes on flat copies of
the central tensors, one buffer per dtype (:mod:`.broadcast`). Moved whole, a buffer
waits for the whole backward before its gradients leave, and the forward waits for every
parameter before its first layer starts. So each buffer is cut into buckets of at most
``bytes_per_pack`` bytes (TF's ``CommunicationOptions.bytes_per_pack``; DDP calls them
buckets, ``bucket_cap_mb``): contiguous runs of tensors in creation order, filled from the
last tensor, whose gradients a backward makes first. Each bucket moves by itself, one
coalesced copy each way per step:

* **Parameters in.** A run's first read copies every bucket, in creation order (the order
  a forward reads them). From a CPU parameter device to a GPU the copy runs on a side
  stream straight from the central tensors, which live in pinned memory, one buffer per
  dtype (:func:`pinned_home`: no host copy first), and the replica's stream waits for a
  bucket only when it first reads one of its tensors: the first layer computes while the
  next ones arrive.
* **Gradients out.** A hook on each leaf notes the gradients a bucket received in the
  replica's backward; when every tensor of it that the replica read (and that requires a
  gradient) has one, the bucket leaves -- from a GPU on a side stream into pinned memory
  -- while the backward goes on with the layers before it.

**Results are today's.** Where the gradients are summed nothing changed: when the run
ends (or a backward through its outputs does), each replica's gradients are added to the
central ``.grad`` in replica order, as the copies of one whole buffer were. A gradient
changed after its bucket left (a second backward in the same run, ``clip_grad_norm_`` or
any in-place change inside the replica, a new ``.grad``) has another version or is
another tensor by then; it is sent again, and only the current value counts. (A write
through ``.grad.data`` changes no version: made inside a replica after its backward, it
is not seen. Make it on the summed gradient after ``run``, where it belongs.) A tensor read
but left out of the loss keeps its bucket until the run ends, where what did not leave
early goes in one copy.

A buffer that is one bucket (a model under the bucket size, or ``bytes_per_pack=0``)
carries no hooks: a Python hook costs each replica's backward the GIL once per parameter,
which only pays where there is a transfer to overlap.

**Parameters go in at a run's first read, not when the step ends.** Writes through
``.data`` (WGAN's weight clipping), torch's fused CPU optimizers (``Adam(fused=True)``
leaves the version counter as it was) and extension kernels change parameters without a
trace, so only a copy made when the next run reads them is sure to be current; the
forward then waits for each bucket at its first read rather than for all of them. How
the optimizer steps while the gradients still arrive is :mod:`.offload`'s.
"""

from __future__ import annotations

import itertools
import threading

import torch

from . import torch_internals

__all__ = ["DEFAULT_BYTES_PER_PACK", "plan", "Bucket", "transport_for", "pinned_home"]

# DDP's default bucket: it crosses the 55 GB/s measured on an H200's PCIe link in ~0.5 ms,
# small next to a large model's backward, while each bucket costs a few Python calls
DEFAULT_BYTES_PER_PACK = 25 * 2**20

_tensor_version = torch_internals.tensor_version  # bound: read per tensor per refresh


def plan(numels: list[int], itemsize: int, bytes_per_pack: int) -> list[tuple[int, int]]:
    """Cut tensors (in creation order) into runs of at most ``bytes_per_pack`` bytes.

    Returns ``(start, stop)`` index ranges in creation order, filled from the last tensor
    (a backward makes its gradient first, so the bucket that leaves first is a full one). A
    tensor larger than the size is a bucket of its own; ``bytes_per_pack`` 0: one bucket.

    Example: ``plan([4, 4, 4], 4, 32) == [(0, 1), (1, 3)]``.
    """
    count = len(numels)
    if bytes_per_pack <= 0 or count == 0:
        return [(0, count)]
    ranges, stop, size = [], count, 0
    for index in range(count - 1, -1, -1):
        nbytes = numels[index] * itemsize
        if stop - index > 1 and size + nbytes > bytes_per_pack:  # full: close it
            ranges.append((index + 1, stop))
            stop, size = index + 1, 0
        size += nbytes
    ranges.append((0, stop))
    return ranges[::-1]


class _SameDevice:
    """Replica and parameters on one torch device (logical CPU replicas with
    ``copy_parameters``): a copy is a concatenation."""

    staged = False  # copies in go from one pinned buffer holding the central tensors
    # numbers the copies out of one mirror in the order they start, which is the order
    # they land in (one side stream per device)
    sequence = None

    def next_number(self) -> int:
        if self.sequence is None:
            self.sequence = itertools.count()
        return next(self.sequence)

    def begin_copy_in(self) -> None:
        pass

    def copy_in(self, source, flat: torch.Tensor):
        """Copy ``source`` (flat tensors to concatenate, or one flat tensor) into ``flat``;
        the event that says it is done, or None."""
        torch.cat(source, out=flat)
        return None

    def wait_in(self, event) -> None:
        pass

    def send(self, grads: list):
        return torch.cat([g.reshape(-1) for g in grads]), None

    # -- a mirror's buffers (:class:`.broadcast.BufferMirror`): on the replica's stream --
    def buffers_in(self, sources: list, flat: torch.Tensor) -> None:
        """Copy central buffers (flat, one dtype) into a replica's ``flat``."""
        torch.cat(sources, out=flat)

    def buffers_out(self, flat: torch.Tensor):
        """A replica's written buffers (``flat``) on the parameter device, and the event
        that says they are there (None: they are). Same device: ``flat`` itself, read
        where it is (the replica is done with it)."""
        return flat, None


class _CrossDevice(_SameDevice):
    """Two devices without a pinned path (GPU to GPU, a CPU replica of GPU parameters):
    torch's ordinary copies, ordered by the devices' current streams."""

    def __init__(self, param_device: torch.device):
        self.param_device = param_device

    def copy_in(self, source, flat: torch.Tensor):
        flat.copy_(torch.cat(source))
        return None

    def send(self, grads: list):
        return torch.cat([g.reshape(-1) for g in grads]).to(self.param_device), None

    def buffers_in(self, sources: list, flat: torch.Tensor) -> None:
        flat.copy_(torch.cat(sources))

    def buffers_out(self, flat: torch.Tensor):
        return flat.to(self.param_device), None


class _Offload(_SameDevice):
    """A GPU replica of CPU parameters: copies on side streams, one for each direction
    (a GPU has copy engines for both at once), from and into pinned memory."""

    staged = True

    def __init__(self, device: torch.device):
        self.device = device
        self.in_stream = torch.cuda.Stream(device)
        self.out_stream = torch.cuda.Stream(device)

    def home(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Pinned memory for central tensors the GPU copies straight from."""
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def is_home(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def begin_copy_in(self) -> None:
        # the flat buffers are written on the side stream: after the replica's last reads
        self.in_stream.wait_stream(torch.cuda.current_stream(self.device))

    def copy_in(self, source, flat: torch.Tensor):
        with torch.cuda.stream(self.in_stream):
            flat.copy_(source, non_blocking=True)
            arrived = torch.cuda.Event()
            arrived.record(self.in_stream)
        return arrived

    def wait_in(self, event) -> None:
        torch.cuda.current_stream(self.device).wait_event(event)

    def send(self, grads: list):
        made = torch.cuda.Event()  # where the backward made them: the current stream
        made.record(torch.cuda.current_stream(self.device))
        stream = self.out_stream
        with torch.cuda.stream(stream):
            stream.wait_event(made)
            flat = torch.cat([g.reshape(-1) for g in grads])
            host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            host.copy_(flat, non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(stream)
        for grad in grads:  # read on the side stream: not reused before the copy is done
            grad.record_stream(stream)
        return host, landed

    def buffers_in(self, sources: list, flat: torch.Tensor) -> None:
        # through fresh pinned memory (the caching host allocator keeps a block until
        # the copies that read it are done): a copy from pageable memory waits the host
        staging = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        torch.cat(sources, out=staging)
        flat.copy_(staging, non_blocking=True)

    def buffers_out(self, flat: torch.Tensor):
        # on the replica's device's current stream, after the replica's writes; landed
        # (waited for) only when the central buffers are next read
        host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record(torch.cuda.current_stream(self.device))
        return host, landed


def transport_for(device: torch.device, param_device: torch.device):
    """How a mirror on ``device`` copies from and to ``param_device``."""
    if device == param_device:
        return _SameDevice()
    if device.type == "cuda" and param_device.type == "cpu":
        return _Offload(device)
    return _CrossDevice(param_device)


_homing = threading.Lock()  # GPUs' replicas build their mirrors at once: one moves them


def pinned_home(tensors: list, transport) -> torch.Tensor:
    """One flat buffer holding ``tensors`` (one dtype) one after another, from which a
    staged transport copies without a host copy first: theirs if they already live so
    (another GPU's mirror moved them there), else new, with their ``.data`` moved in.

    Moving ``.data`` keeps each tensor (its optimizer state, its hooks, the modules and
    optimizers holding it) and its values; only its storage is another.
    """
    with _homing:
        return _pinned_home(tensors, transport)


def _pinned_home(tensors: list, transport) -> torch.Tensor:
    first = tensors[0]
    total = sum(t.numel() for t in tensors)
    storage, address = first.untyped_storage(), first.data_ptr()
    shared = transport.is_home(first)
    for tensor in tensors:
        if not shared:
            break
        shared = (tensor.untyped_storage().data_ptr() == storage.data_ptr()
                  and tensor.data_ptr() == address and tensor.is_contiguous())
        address += tensor.numel() * tensor.element_size()
    if shared:
        return first.new_empty(0).set_(storage, first.storage_offset(), (total,))
    home = transport.home(total, first.dtype)
    offset = 0
    with torch.no_grad():
        for tensor in tensors:
            slot = home[offset:offset + tensor.numel()]
            slot.copy_(tensor.detach().reshape(-1))
            tensor.data = slot.view(tensor.shape)
            offset += tensor.numel()
    return home


class Bucket:
    """A run of one dtype's tensors and their leaves: one coalesced copy each way.

    Per run it counts the leaves the replica read (:meth:`serve`) and the gradients they
    received (:meth:`arrive`, a post-accumulate-grad hook); when the two meet, the
    gradients leave (:meth:`_send`). :meth:`take` hands them over when the run's
    gradients are collected, checked against the leaves' gradients as they are then.
    """

    __slots__ = ("tensors", "leaves", "flat", "home", "transport", "hooked", "_hooks",
                 "_addresses", "stamp", "ready", "_copied", "_served", "_arrived",
                 "_expected", "_count", "_sent")

    def __init__(self, tensors: list, leaves: list, flat: torch.Tensor, home,
                 transport, hooked: bool):
        self.tensors = tensors
        self.leaves = leaves
        self.flat = flat  # this bucket's slice of the group's flat buffer
        # its slice of the pinned buffer the central tensors live in (GPU replicas of
        # CPU parameters, :func:`pinned_home`), or None; and where each tensor starts
        self.home = home
        self._addresses = None if home is None else [
            t.data_ptr() for t in _slices(home, [t.numel() for t in tensors])]
        self.transport = transport
        self.hooked = hooked
        self._hooks = [False] * len(leaves)
        self.stamp = None  # the central tensors' (version, data_ptr, requires_grad) at copy
        self.ready = None  # the copy in, until the replica's stream has waited for it
        self._copied = None  # the copy in: done before the home is written again
        self._served = bytearray(len(leaves))
        self._arrived = bytearray(len(leaves))
        self._expected = 0  # leaves read this run that require a gradient
        self._count = 0  # of those, how many received one since the last send
        self._sent = None  # (flat, event, [(index, grad, version, offset)], number)
        for index in range(len(leaves)):
            self._hook(index)

    def _hook(self, index: int) -> None:
        leaf = self.leaves[index]
        if self.hooked and leaf.requires_grad and not self._hooks[index]:
            leaf.register_post_accumulate_grad_hook(lambda _, i=index: self.arrive(i))
            self._hooks[index] = True

    # -- parameters in -------------------------------------------------------------------
    def copy_in(self, force: bool) -> bool:
        """Copy the central values in if any changed (or ``force``); True if copied."""
        stamp = [(_tensor_version(t), t.data_ptr(), t.requires_grad) for t in self.tensors]
        if stamp == self.stamp and not force:
            return False
        for index, (tensor, leaf) in enumerate(zip(self.tensors, self.leaves)):
            if leaf.requires_grad != tensor.requires_grad:  # frozen or unfrozen since
                leaf.requires_grad_(tensor.requires_grad)
                self._hook(index)
        if self.home is None:
            source = [t.detach().reshape(-1) for t in self.tensors]
        else:
            self._stage(stamp)
            source = self.home
        self._copied = self.ready = self.transport.copy_in(source, self.flat)
        self.stamp = stamp
        return True

    def _stage(self, stamp: list) -> None:
        """The pinned home holds every tensor's values: a tensor given other storage
        since (``p.data = x``) has its values copied to its place first."""
        moved = [k for k, (address, (_, ptr, _)) in enumerate(zip(self._addresses, stamp))
                 if ptr != address or not self.tensors[k].is_contiguous()]
        if not moved:
            return
        if self._copied is not None:  # the last copy from this place may still read it
            self._copied.synchronize()
        slots = _slices(self.home, [t.numel() for t in self.tensors])
        with torch.no_grad():
            for k in moved:
                slots[k].copy_(self.tensors[k].detach().reshape(-1))

    def copied_in(self) -> None:
        """Wait (the host) until the last copy in has read the central tensors."""
        if self._copied is not None:
            self._copied.synchronize()

    def wait_in(self) -> None:
        """The current stream waits for the copy in (once)."""
        if self.ready is not None:
            self.transport.wait_in(self.ready)
            self.ready = None

    def new_run(self) -> None:
        """A run begins: nothing read, nothing received yet."""
        self._served = bytearray(len(self.leaves))
        self._arrived = bytearray(len(self.leaves))
        self._expected = self._count = 0
        self._sent = None

    def serve(self, index: int) -> None:
        """The replica reads leaf ``index``: its gradient is awaited, its values too."""
        if not self._served[index]:
            self._served[index] = 1
            if self.leaves[index].requires_grad:
                self._expected += 1
        if self.ready is not None:
            self.wait_in()

    # -- gradients out -------------------------------------------------------------------
    def arrive(self, index: int) -> None:
        """Leaf ``index`` received a gradient (the hook, inside a backward)."""
        if self._sent is not None or not self._served[index] or self._arrived[index]:
            return
        self._arrived[index] = 1
        self._count += 1
        if self._count == self._expected:
            self._send()

    def _send(self) -> None:
        entries, grads, offset = [], [], 0
        for index, leaf in enumerate(self.leaves):
            grad = leaf.grad
            if grad is not None:
                entries.append((index, grad, _tensor_version(grad), offset))
                grads.append(grad)
                offset += grad.numel()
        if grads:
            with torch.no_grad():  # grads made with create_graph=True are not traced
                flat, event = self.transport.send(grads)
            self._sent = (flat, event, entries, self.transport.next_number())

    def take(self, transfers: list, rest: list) -> None:
        """Hand over the leaves' gradients and clear them: those that left early and are
        still the current ones as ``(number, (pairs of (central, offset), flat, event))``
        into ``transfers`` (``number``: the order it left in); the others, as ``(central,
        grad)``, into ``rest`` (sent by the caller)."""
        sent, self._sent = self._sent, None
        self._arrived = bytearray(len(self.leaves))
        self._count = 0
        current = {}
        if sent is not None:
            for index, grad, version, offset in sent[2]:
                if self.leaves[index].grad is grad and _tensor_version(grad) == version:
                    current[index] = offset
        pairs = []
        for index, leaf in enumerate(self.leaves):
            grad = leaf.grad
            if grad is None:
                continue
            offset = current.get(index)
            if offset is None:
                rest.append((self.tensors[index], grad))
            else:
                pairs.append((self.tensors[index], offset))
            leaf.grad = None
        if pairs:
            transfers.append((sent[3], (pairs, sent[0], sent[1])))


def _slices(flat: torch.Tensor, numels: list) -> list:
    """Consecutive slices of ``flat``, ``numels[i]`` elements each."""
    out, offset = [], 0
    for numel in numels:
        out.append(flat[offset:offset + numel])
        offset += numel
    return out
