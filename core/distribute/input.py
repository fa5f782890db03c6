"""Distributed input: global batches split across replicas and prefetched to their devices.

``experimental_distribute_dataset`` takes any iterable of *global* batches -- a tensor or a
nest (tuple/list/dict) of tensors per step, e.g. a ``torch.utils.data.DataLoader``. Each
batch of ``n`` examples is split as TF splits it: ``ceil(n / R)`` consecutive examples per
replica in replica order, so trailing replicas can be empty (size 0 along the batch
dimension, right trailing shape). A background thread reads ahead and copies each
component onto its replica's device (from pinned memory, non-blocking, for GPUs) into a
bounded buffer; a list or tuple of batches for CPU replicas is split on the consumer's
thread instead, as it needs no reading ahead.

``distribute_datasets_from_function`` calls ``dataset_fn(InputContext)`` and deals whole
*per-replica* batches to the replicas in turn; an incomplete last round is dropped, as TF
drops it, but with a warning that says what was dropped.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import queue
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np
import torch

from .batch_split import even_sizes
from .jagged import JaggedTensor
from .values import PerReplica, flatten, map_structure, regroup

__all__ = [
    "InputOptions",
    "InputReplicationMode",
    "InputContext",
    "ValueContext",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "TensorSpec",
    "PerReplicaSpec",
    "TensorSliceDataset",
    "split_batch",
    "Feeder",
    "place_values",
    "UNKNOWN_CARDINALITY",
]

UNKNOWN_CARDINALITY = -2


class InputReplicationMode(enum.Enum):
    """How ``dataset_fn`` is replicated: once per worker (default) or once per replica."""

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclasses.dataclass
class InputOptions:
    """TF's ``tf.distribute.InputOptions``.

    Attributes:
      experimental_fetch_to_device: copy components onto their replica's device (True) or
        leave them on the host CPU (False).
      experimental_replication_mode: ``PER_WORKER`` or ``PER_REPLICA`` (the latter only for
        ``distribute_datasets_from_function``).
      experimental_place_dataset_on_device: TF's flag for building the pipeline on the
        device; accepted with TF's consistency rule, no effect in PyTorch.
      experimental_per_replica_buffer_size: how many steps the background thread reads ahead.
    """

    experimental_fetch_to_device: bool = True
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1

    def __post_init__(self):
        mode = self.experimental_replication_mode
        if isinstance(mode, str):
            try:
                mode = InputReplicationMode[mode.upper()]
            except KeyError:
                raise ValueError(f"experimental_replication_mode must be PER_WORKER or "
                                 f"PER_REPLICA, got {mode!r}") from None
        if not isinstance(mode, InputReplicationMode):
            raise TypeError(f"experimental_replication_mode must be an InputReplicationMode, "
                            f"got {mode!r}")
        self.experimental_replication_mode = mode
        size = self.experimental_per_replica_buffer_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"experimental_per_replica_buffer_size must be a positive int, "
                             f"got {size!r}")
        if (self.experimental_place_dataset_on_device and self.experimental_fetch_to_device
                and mode is InputReplicationMode.PER_WORKER):
            raise ValueError("experimental_place_dataset_on_device=True needs "
                             "experimental_fetch_to_device=False or PER_REPLICA mode (TF's rule)")


class InputContext:
    """What ``dataset_fn`` knows about where its dataset is consumed.

    Attributes:
      num_input_pipelines: how many times ``dataset_fn`` is called (pipelines).
      input_pipeline_id: which pipeline this call builds.
      num_replicas_in_sync: how many replicas consume batches each step.
    """

    def __init__(self, num_input_pipelines: int = 1, input_pipeline_id: int = 0,
                 num_replicas_in_sync: int = 1):
        self.num_input_pipelines = num_input_pipelines
        self.input_pipeline_id = input_pipeline_id
        self.num_replicas_in_sync = num_replicas_in_sync

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """``global_batch_size / num_replicas_in_sync``; it must divide evenly."""
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(f"The `global_batch_size` {global_batch_size} is not divisible by "
                             f"`num_replicas_in_sync` {self.num_replicas_in_sync}")
        return global_batch_size // self.num_replicas_in_sync

    def __str__(self) -> str:
        return (f"csrun.core.InputContext(input pipeline id {self.input_pipeline_id}, "
                f"total: {self.num_input_pipelines})")

    __repr__ = __str__


class ValueContext:
    """What ``value_fn`` of ``experimental_distribute_values_from_function`` knows."""

    def __init__(self, replica_id_in_sync_group: int = 0, num_replicas_in_sync: int = 1):
        self.replica_id_in_sync_group = replica_id_in_sync_group
        self.num_replicas_in_sync = num_replicas_in_sync

    def __str__(self) -> str:
        return (f"csrun.core.ValueContext(replica id {self.replica_id_in_sync_group}, "
                f"total replicas in sync: {self.num_replicas_in_sync})")

    __repr__ = __str__


TensorSpec = collections.namedtuple("TensorSpec", ["shape", "dtype"])


class PerReplicaSpec(tuple):
    """The spec of a PerReplica: one TensorSpec per replica."""

    def __repr__(self) -> str:
        return f"PerReplicaSpec{tuple.__repr__(self)}"


# -- splitting --------------------------------------------------------------------------
def _leaf_tensor(leaf: Any) -> torch.Tensor:
    if isinstance(leaf, (torch.Tensor, JaggedTensor)):  # jagged ids split by examples too
        return leaf
    if isinstance(leaf, (np.ndarray, np.generic)):  # host data, whatever the default device
        return torch.as_tensor(leaf, device="cpu")
    raise TypeError(
        f"a batch must hold tensors (or numpy arrays), got a {type(leaf).__name__} leaf "
        f"({leaf!r:.60}); convert it in the dataset or collate function")


def split_batch(batch: Any, num_replicas: int,
                sizes: Callable[[int], Sequence[int]] | None = None) -> list:
    """Split one global batch into ``num_replicas`` consecutive slices.

    ``sizes(n)`` gives each replica's examples of a batch of ``n``; default TF's rule,
    ``ceil(n / num_replicas)`` each (:func:`~.batch_split.even_sizes`).
    """
    rule = sizes if sizes is not None else _even_rule(num_replicas)
    if num_replicas > 1 and type(batch) in (tuple, list):
        pieces = _split_flat(batch, rule)
        if pieces is not None:
            return pieces
    leaves = [_leaf_tensor(x) for x in flatten(batch)]
    if num_replicas == 1:
        it = iter(leaves)
        return [map_structure(lambda _: next(it), batch)]
    counts = set()
    for leaf in leaves:
        if leaf.dim() == 0:
            raise ValueError(
                "the dataset yields unbatched (0-d) elements, which cannot be split across "
                f"{num_replicas} replicas; give experimental_distribute_dataset global "
                "batches (e.g. a DataLoader with batch_size=...)")
        counts.add(leaf.shape[0])
    if len(counts) > 1:
        raise ValueError(f"the tensors of one batch have different batch sizes {sorted(counts)}; "
                         "every tensor of a batch needs the same leading dimension")
    out = []
    for piece in _slices(leaves, rule(counts.pop() if counts else 0)):
        it = iter(piece)
        out.append(map_structure(lambda _: next(it), batch))
    return out


@functools.lru_cache(maxsize=64)
def _even_rule(num_replicas: int) -> Callable[[int], tuple]:
    """TF's split for ``num_replicas``, remembered per batch size (asked every step)."""
    return functools.lru_cache(maxsize=8)(lambda n: tuple(even_sizes(n, num_replicas)))


def _split_flat(batch: tuple | list, rule: Callable[[int], Sequence[int]]) -> list | None:
    """:func:`split_batch` of a flat tuple or list of batched tensors, the usual
    ``(x, y)``, without walking nests (a step's input path: 50 → 31 µs for two
    tensors). None for anything else, which takes the general path and its errors."""
    size = None
    for leaf in batch:
        if type(leaf) is not torch.Tensor or leaf.dim() == 0:
            return None
        if size is None:
            size = leaf.shape[0]
        elif leaf.shape[0] != size:
            return None
    if size is None:
        return None
    kind = type(batch)
    return [kind(piece) for piece in _slices(batch, rule(size))]


def _slices(leaves: Sequence[torch.Tensor], sizes: Sequence[int]) -> list[list]:
    """Each replica's consecutive slice of every leaf, ``sizes[r]`` examples for replica
    ``r`` (a replica with none gets an empty slice of the right trailing shape)."""
    out, start = [], 0
    for size in sizes:
        end = start + size
        out.append([leaf[start:end] for leaf in leaves])
        start = end
    return out


# -- prefetching ------------------------------------------------------------------------
_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class _Warning:
    def __init__(self, message: str):
        self.message = message


class _Exhausted(StopIteration):
    """The source ended; ``warning`` says what was dropped, if anything."""

    def __init__(self, warning: str | None = None):
        super().__init__()
        self.warning = warning


class _Prefetcher:
    """A thread that turns source items into per-step values ahead of the consumer."""

    def __init__(self, source: Iterator, produce: Callable[[Iterator], Any], buffer_size: int):
        self.queue: queue.Queue = queue.Queue(maxsize=buffer_size)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, args=(source, produce),
                                       name="csrun-prefetch", daemon=True)
        self.thread.start()

    def _put(self, item: Any) -> bool:
        while not self.stop.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _loop(self, source: Iterator, produce: Callable[[Iterator], Any]) -> None:
        try:
            while not self.stop.is_set():
                try:
                    item = produce(source)
                except StopIteration as stop:
                    if getattr(stop, "warning", None):
                        self._put(_Warning(stop.warning))
                    break
                if not self._put(item):
                    return
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            self._put(_Failure(exc))
            return
        finally:
            source = None
        self._put(_END)

    def get(self) -> Any:
        while True:
            try:
                return self.queue.get(timeout=0.5)
            except queue.Empty:
                if not self.thread.is_alive() and self.queue.empty():
                    return _END

    def close(self) -> None:
        self.stop.set()
        try:
            while True:
                self.queue.get_nowait()
        except queue.Empty:
            pass
        if self.thread is not threading.current_thread():
            self.thread.join(timeout=5)


class _Inline:
    """:class:`_Prefetcher`'s interface without the thread: each step is produced when the
    consumer asks. For batches already in memory that stay on the CPU, producing a step
    is a few slices, so a thread would add only its hand-offs (measured once at 2-3% of
    a 9 ms step; docs/performance.md)."""

    def __init__(self, source: Iterator, produce: Callable[[Iterator], Any]):
        self._source, self._produce = source, produce

    def get(self) -> Any:
        if self._source is None:
            return _END
        try:
            if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
                return self._produce(self._source)  # the usual case: no ~7 µs guard
            # made as on the prefetch thread (grad on, no inference mode): never as
            # inference tensors, which training could not use, nor cut from the graph of
            # a dataset tensor that requires grad when the consumer is in no_grad
            with torch.inference_mode(False):
                return self._produce(self._source)
        except StopIteration as stop:
            self._source = None
            warning = getattr(stop, "warning", None)
            return _Warning(warning) if warning else _END
        except Exception as exc:  # noqa: BLE001 - raised by the consumer, as threaded
            self._source = None  # (a Ctrl-C propagates and leaves the iterator usable)
            return _Failure(exc)

    def close(self) -> None:
        self._source = None


class Feeder:
    """Moves each replica's share of a step onto its device; regroups it for the consumer.

    Every component reaches its own replica's device, wherever the dataset made it (TF's
    ``experimental_fetch_to_device``): host slices go to a GPU replica from pinned memory,
    non-blocking, on a copy stream the replica's stream then waits for; a slice of a
    batch already on a GPU goes to another GPU the same way, and to a CPU replica as a
    copy the host waits for (the replica reads it as soon as it starts). With
    ``fetch_to_device=False`` components stay where the dataset made them.

    ``place`` runs on the prefetch thread (on the consumer's for in-memory batches of
    CPU replicas), ``finish`` on the consumer's thread.
    """

    def __init__(self, devices: list, fetch_to_device: bool, streams: list | None = None):
        self._devices = [d.torch_device for d in devices]
        # decided once: `device.type` costs ~2 µs, and place runs for every step
        kinds = [d.type for d in self._devices]
        self._to_gpu_ids = [r for r, k in enumerate(kinds) if k == "cuda"]
        self._gpu = fetch_to_device and bool(self._to_gpu_ids)
        # a CPU replica's slice can only be elsewhere when something else exists: on a
        # CPU-only machine its check (~0.5 µs a tensor) is skipped
        self._check = fetch_to_device and (
            any(k not in ("cpu", "cuda") for k in kinds) or
            (any(k == "cpu" for k in kinds) and torch.accelerator.is_available()))
        self._kinds = kinds
        self._streams = streams  # the replicas' CUDA streams (None: no GPU replica)
        self._copy_streams = {}

    @property
    def copies(self) -> bool:
        """Whether placing a step copies anything to a GPU (then a thread reads ahead)."""
        return self._gpu

    def place(self, per_replica: list) -> tuple[list, list]:
        if not (self._gpu or self._check):  # the usual CPU case: nothing can be elsewhere
            return per_replica, []
        placed, events = list(per_replica), []
        for replica_id, (nest, device) in enumerate(zip(per_replica, self._devices)):
            kind = self._kinds[replica_id]
            if kind == "cuda":
                if self._gpu:
                    placed[replica_id], event = self._to_gpu(nest, device)
                    events.append((replica_id, event, placed[replica_id]))
            elif self._check and not all(_on(t, kind, device) for t in flatten(nest)):
                placed[replica_id] = map_structure(lambda t: self._to_other(t, device), nest)
        return placed, events

    def _copy_stream(self, device: torch.device):
        stream = self._copy_streams.get(device)
        if stream is None:
            stream = self._copy_streams[device] = torch.cuda.Stream(device)
        return stream

    def _to_gpu(self, nest: Any, device: torch.device):
        stream = self._copy_stream(device)
        sources = {t.device for t in flatten(nest) if isinstance(t, torch.Tensor) and t.is_cuda}
        for source in sources:
            _after_producer(stream, source)
        with torch.cuda.stream(stream):
            moved = map_structure(
                lambda t: (t if t.is_pinned() else t.pin_memory()).to(device, non_blocking=True)
                if t.device.type == "cpu" else t.to(device, non_blocking=True), nest)
            event = torch.cuda.Event()
            event.record(stream)
        return moved, event

    def _to_other(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """A slice for a CPU (or other non-CUDA) replica: on its device before the
        replica starts. Off a GPU the copy runs on a copy stream of that GPU and the host
        waits for it: not on the default stream, which would also wait for the
        replicas' work in flight."""
        if not isinstance(tensor, torch.Tensor) or tensor.device == device:
            return tensor
        if tensor.device.type != "cuda":
            return tensor.to(device)
        stream = self._copy_stream(tensor.device)
        _after_producer(stream, tensor.device)
        with torch.cuda.stream(stream):
            return tensor.to(device)

    def finish(self, item: tuple[list, list]) -> Any:
        nests, events = item
        for replica_id, event, nest in events:
            stream = (self._streams[replica_id] if self._streams
                      else torch.cuda.current_stream(self._devices[replica_id]))
            stream.wait_event(event)
            for tensor in flatten(nest):
                tensor.record_stream(stream)
        if len(nests) == 1:
            return nests[0]
        return regroup(nests, collapse_identical=False)


def _after_producer(stream, source: torch.device) -> None:
    """``stream`` (a copy stream: torch makes them non-blocking, so they do not follow
    the default stream by themselves) waits for the work that made a batch on GPU
    ``source``: whatever this thread queued there, the dataset's own ops included."""
    stream.wait_stream(torch.cuda.current_stream(source))


def _on(tensor: Any, kind: str, device: torch.device) -> bool:
    """Whether a component is on its replica's device already (non-tensors always are)."""
    if not isinstance(tensor, torch.Tensor):
        return True
    return tensor.is_cpu if kind == "cpu" else tensor.device == device


def place_values(values: list, devices: Sequence[torch.device]) -> list:
    """Each replica's value (a nest) with its tensors on that replica's device.

    ``experimental_distribute_values_from_function``: TF leaves a value where
    ``value_fn`` made it and copies it when a replica's op reads it on another device;
    torch would fail there instead, so a tensor on another torch device moves now. On its
    own device (every logical CPU is the host's) it is the very tensor ``value_fn``
    returned.
    """
    copies: dict = {}  # (tensor, device) -> its copy: one copy per device

    def moved(v: Any, d: torch.device) -> Any:
        if not isinstance(v, torch.Tensor) or v.device == d:
            return v
        key = (id(v), d)
        if key not in copies:
            copies[key] = (v, v.to(d))  # (v kept: its id is not reused meanwhile)
        return copies[key][1]
    return [map_structure(lambda v, d=device: moved(v, d), value)
            for value, device in zip(values, devices)]


class Optional_:
    """TF's ``tf.experimental.Optional`` for ``get_next_as_optional``."""

    def __init__(self, value: Any = None, has_value: bool = False):
        self._value, self._has_value = value, has_value

    def has_value(self) -> bool:
        return self._has_value

    def get_value(self) -> Any:
        if not self._has_value:
            raise ValueError("the Optional has no value (the iterator is exhausted)")
        return self._value


class DistributedIterator:
    """Iterates a distributed dataset: one PerReplica nest (plain with 1 replica) per step."""

    def __init__(self, source: Iterator, produce: Callable[[Iterator], Any], buffer_size: int,
                 finish: Callable[[Any], Any], prefetch: bool = True):
        self._prefetcher = (_Prefetcher(source, produce, buffer_size) if prefetch
                            else _Inline(source, produce))
        self._finish = finish
        self._done = False
        weakref.finalize(self, self._prefetcher.close)

    def __iter__(self) -> "DistributedIterator":
        return self

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._prefetcher.get()
        while isinstance(item, _Warning):
            warnings.warn(item.message, UserWarning, stacklevel=2)
            item = self._prefetcher.get()
        if item is _END:
            self._done = True
            raise StopIteration
        if isinstance(item, _Failure):
            self._done = True
            raise item.exc
        return self._finish(item)

    def get_next(self) -> Any:
        """The next element; raises StopIteration (TF: OutOfRangeError) at the end."""
        return next(self)

    def get_next_as_optional(self) -> Optional_:
        """The next element as an Optional that is empty at the end."""
        try:
            return Optional_(next(self), True)
        except StopIteration:
            return Optional_()

    def close(self) -> None:
        """Stop the background reader now (it also stops when the iterator is collected)."""
        self._done = True
        self._prefetcher.close()


class _DistributedBase:
    """What both kinds of distributed dataset share: iteration, spec, cardinality."""

    def __init__(self, strategy, options: InputOptions | None):
        self._strategy = strategy
        self._options = options if options is not None else InputOptions()
        if not isinstance(self._options, InputOptions):
            raise TypeError(f"options must be an InputOptions, got {type(options).__name__}")
        self._element_spec = None

    @property
    def _num_replicas(self) -> int:
        """Replicas on this machine (each step yields this many components)."""
        return self._strategy.extended.num_local_replicas

    @property
    def _total_replicas(self) -> int:
        """Replicas of the whole sync group (all workers of a cluster)."""
        return self._strategy.num_replicas_in_sync

    @property
    def _offset(self) -> int:
        return self._strategy.extended.replica_offset

    def __iter__(self) -> DistributedIterator:
        feeder = self._strategy.extended.input_feeder(self._options)
        return DistributedIterator(self._source_iterator(), self._producer(feeder),
                                   self._options.experimental_per_replica_buffer_size,
                                   feeder.finish, not self._in_memory() or feeder.copies)

    def _in_memory(self) -> bool:
        """True when every step is already in memory (reading ahead gains nothing)."""
        return False

    @property
    def element_spec(self) -> Any:
        """The structure of an element: TensorSpecs, wrapped in PerReplicaSpec for R > 1.

        Computed from the first element of a fresh pass over the data.
        """
        if self._element_spec is None:
            iterator = iter(self)
            try:
                first = next(iterator)
            except StopIteration:
                raise ValueError("the dataset is empty, so its element_spec is unknown") \
                    from None
            finally:
                iterator.close()
            self._element_spec = map_structure(_spec_of, first)
        return self._element_spec

    def __len__(self) -> int:
        raise TypeError(f"object of type {type(self).__name__!r} has no len(); use "
                        ".cardinality")


def _spec_of(value: Any) -> Any:
    if isinstance(value, PerReplica):
        return PerReplicaSpec(_spec_of(v) for v in value.values)
    if isinstance(value, torch.Tensor):
        return TensorSpec((None,) + tuple(value.shape[1:]) if value.dim() else (), value.dtype)
    return type(value)


def _check_iterable(value: Any, what: str) -> Any:
    if isinstance(value, (torch.Tensor, np.ndarray)) or not isinstance(value, Iterable):
        raise TypeError(
            f"{what} must be an iterable of batches (a DataLoader, a list of tensors, a "
            f"generator, ...), got {type(value).__name__}")
    return value


class DistributedDataset(_DistributedBase):
    """The result of ``experimental_distribute_dataset``: re-iterable, one step per batch."""

    def __init__(self, strategy, dataset: Iterable, options: InputOptions | None = None):
        super().__init__(strategy, options)
        if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
            raise ValueError("InputReplicationMode.PER_REPLICA works with "
                             "distribute_datasets_from_function, not experimental_"
                             "distribute_dataset")
        self._dataset = _check_iterable(dataset, "the dataset")

    def _source_iterator(self) -> Iterator:
        return iter(self._dataset)

    def _in_memory(self) -> bool:
        return isinstance(self._dataset, (list, tuple))

    def _producer(self, feeder) -> Callable[[Iterator], Any]:
        total, first, count = self._total_replicas, self._offset, self._num_replicas
        rule = _split_rule(self._strategy.extended.batch_balancer, total, first, count)

        def produce(source: Iterator) -> Any:
            # In a cluster every worker reads each global batch and keeps its replicas' part.
            return feeder.place(split_batch(next(source), total, rule)[first:first + count])
        return produce

    @property
    def cardinality(self) -> int:
        """The number of steps when the source has a length, else -2 (unknown)."""
        try:
            return len(self._dataset)
        except TypeError:
            return UNKNOWN_CARDINALITY


def _split_rule(balancer, total: int, first: int, count: int):
    """The sizes rule of :func:`split_batch` for this machine's replicas: None (TF's even
    split) unless they are balanced. In a cluster each worker's part of a global batch
    stays TF's (the workers cannot time each other), split by speed among its replicas."""
    if not balancer.balanced:
        return None
    if total == count:
        return balancer.sizes

    def rule(size: int) -> list[int]:
        sizes = even_sizes(size, total)
        sizes[first:first + count] = balancer.sizes(sum(sizes[first:first + count]))
        return sizes
    return rule


class DistributedDatasetsFromFunction(_DistributedBase):
    """The result of ``distribute_datasets_from_function``."""

    def __init__(self, strategy, dataset_fn: Callable, options: InputOptions | None = None):
        super().__init__(strategy, options)
        if not callable(dataset_fn):
            raise TypeError(f"dataset_fn must be callable, got {type(dataset_fn).__name__}")
        self._dataset_fn = dataset_fn
        self._per_replica = (self._options.experimental_replication_mode
                             is InputReplicationMode.PER_REPLICA)

    def _datasets(self) -> list:
        total, first = self._total_replicas, self._offset
        if self._per_replica:
            contexts = [InputContext(total, first + i, total) for i in range(self._num_replicas)]
        else:
            workers = total // self._num_replicas
            contexts = [InputContext(workers, first // self._num_replicas, total)]
        return [_check_iterable(self._dataset_fn(ctx), "dataset_fn's result") for ctx in contexts]

    def _source_iterator(self) -> Iterator:
        return [iter(d) for d in self._datasets()]

    def _producer(self, feeder) -> Callable[[Iterator], Any]:
        num_replicas = self._num_replicas
        per_replica = self._per_replica

        def produce(sources: list) -> Any:
            if per_replica:
                batches = _take_lockstep(sources)
            else:
                batches = _take_round(sources[0], num_replicas)
            batches = list(batches)
            for i, batch in enumerate(batches):
                leaves = flatten(batch)
                if any(_leaf_tensor(leaf) is not leaf for leaf in leaves):
                    # numpy leaves become tensors, as a TF dataset's elements are: the
                    # feeder (pinned copies to a GPU) and the replicas see tensors only
                    batches[i] = map_structure(_leaf_tensor, batch)
            return feeder.place(batches)
        return produce

    @property
    def cardinality(self) -> int:
        if self._per_replica:
            return UNKNOWN_CARDINALITY
        try:
            return len(self._datasets()[0]) // self._num_replicas
        except TypeError:
            return UNKNOWN_CARDINALITY


def _examples(batch: Any) -> int:
    leaves = flatten(batch)
    first = leaves[0] if leaves else None
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() else 1


def _take_round(source: Iterator, num_replicas: int) -> list:
    batches = []
    for _ in range(num_replicas):
        try:
            batches.append(next(source))
        except StopIteration:
            if not batches:
                raise _Exhausted() from None
            dropped = sum(_examples(b) for b in batches)
            raise _Exhausted(
                f"distribute_datasets_from_function: the last round had {len(batches)} "
                f"batch(es) for {num_replicas} replicas; dropped them ({dropped} examples), "
                "as TF does. Make the number of batches a multiple of the replica count "
                "(e.g. drop_last or repeat) to use every example.") from None
    return batches


def _take_lockstep(sources: list) -> list:
    batches = []
    for replica_id, source in enumerate(sources):
        try:
            batches.append(next(source))
        except StopIteration:
            if not batches:
                raise _Exhausted() from None
            raise _Exhausted(
                f"distribute_datasets_from_function (PER_REPLICA): replica {replica_id}'s "
                f"dataset ended first; dropped the {len(batches)} batch(es) the other "
                "replicas had for that step.") from None
    return batches


class TensorSliceDataset(torch.utils.data.Dataset):
    """A map-style dataset over the first dimension of a nest of arrays (TF's
    ``from_tensor_slices``; the result of ``experimental_make_numpy_dataset``)."""

    def __init__(self, nest: Any):
        self._nest = map_structure(lambda a: torch.as_tensor(np.asarray(a)), nest)
        lengths = {t.shape[0] if t.dim() else None for t in flatten(self._nest)}
        if None in lengths or len(lengths) != 1:
            raise ValueError("every array needs the same leading dimension to be sliced")
        self._length = lengths.pop()

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        return map_structure(lambda t: t[index], self._nest)
