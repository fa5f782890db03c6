"""The input pipeline of a run: a source, ``tf.data``-style steps, a ``DataLoader``.

The steps compile into an *index plan*: for each epoch, a deterministic sequence of
batches of example indices (shuffle, repeat, take, skip, shard and batch act on indices
only). A ``torch.utils.data.DataLoader`` takes the plan as its ``batch_sampler`` and loads
the examples (in worker processes when ``dataset.workers > 0``, into pinned memory for
GPUs), applying ``map``/``normalize`` there. Because the plan is cheap to recompute, a run
resumes mid-epoch by skipping plan entries, without reading the skipped data.

Example::

    data = load_source(config.dataset.source)
    pipeline = Pipeline(config.dataset, data, data.indices(), seed=0)
    for x, y in pipeline.loader(epoch=0):
        ...
"""

from __future__ import annotations

import inspect
import itertools
import random
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ..config.problems import ConfigError, Problem
from ..config.schema import DatasetConfig
from ..config.targets import import_object
from ..config.user_code import UserCodeError, user_code_error
from .imported import Collate, Guarded, ImportedData, examples
from .sources import SourceData, derive_seed
from .worker_share import WorkerShare

__all__ = ["Pipeline", "ExampleSet", "is_worker_death", "worker_died"]


# -- element and batch transforms (picklable, for worker processes) ------------------------
class _Normalize:
    def __init__(self, mean: Any, std: Any, example_shape: tuple):
        self.mean = _per_feature(mean, example_shape)
        self.std = _per_feature(std, example_shape)

    def __call__(self, x: torch.Tensor, y: torch.Tensor):
        return (x - self.mean) / self.std, y


def _per_feature(value: Any, example_shape: tuple) -> torch.Tensor:
    if isinstance(value, (int, float)):
        return torch.tensor(float(value))
    return torch.tensor(value, dtype=torch.float32).reshape(example_shape)


class _Map:
    """``map`` step: the function is imported by name in each worker (so it pickles)."""

    def __init__(self, target: str, kwargs: dict, field: str):
        self.target, self.kwargs, self.field = target, dict(kwargs), field
        self._fn: Callable | None = None

    def __getstate__(self):
        return {"target": self.target, "kwargs": self.kwargs, "field": self.field, "_fn": None}

    def __call__(self, x: torch.Tensor, y: torch.Tensor):
        if self._fn is None:
            self._fn = import_object(self.target, self.field)
        try:
            result = self._fn(x, y, **self.kwargs)
        except Exception as exc:  # noqa: BLE001 - the user's code: named, with its line
            raise user_code_error(self.field, f"map function {self.target}", exc) from exc
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"map function {self.target} must return (x, y), got "
                            f"{type(result).__name__}")
        return result


def _check_map_signature(fn: Callable, step, field: str) -> list[Problem]:
    """A map function is called as ``fn(x, y, **kwargs)``: one that cannot take that is
    a config problem now, not a TypeError at the first batch."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: the first batch tells
        return []
    try:
        signature.bind(None, None, **step.kwargs)
    except TypeError as exc:
        return [Problem(f"{field}.fn", f"{step.fn} cannot be called as fn(x, y"
                        f"{', **kwargs' if step.kwargs else ''}): {exc}",
                        "a map function takes an example's features and label (and the "
                        "step's kwargs) and returns (x, y)")]
    return []


class ExampleSet(torch.utils.data.Dataset):
    """Map-style dataset over the source; ``__getitems__`` loads a whole batch at once."""

    def __init__(self, data: SourceData, element_fns: list, batch_fns: list):
        self.features, self.targets = data.features, data.targets
        self.element_fns, self.batch_fns = element_fns, batch_fns

    def __len__(self) -> int:
        return int(self.features.shape[0])

    def __getitem__(self, index: int):
        x, y = self.features[index], self.targets[index]
        for fn in self.element_fns:
            x, y = fn(x, y)
        return x, y

    def __getitems__(self, indices: Sequence[int]):
        if self.element_fns:
            pairs = [self[i] for i in indices]
            x = torch.stack([p[0] for p in pairs])
            y = torch.stack([p[1] for p in pairs])
        else:
            index = torch.as_tensor(indices, dtype=torch.int64)
            x, y = self.features[index], self.targets[index]
        for fn in self.batch_fns:
            x, y = fn(x, y)
        return x, y


def _as_is(batch):
    return batch


def _seed_worker(worker_id: int) -> None:
    # torch seeds each worker from the loader's generator; numpy and random follow it
    seed = torch.initial_seed() % (1 << 32)
    np.random.seed(seed)
    random.seed(seed)


# -- the index plan ---------------------------------------------------------------------------
def _shuffled(stream: Iterator, buffer: int, seed: int, chunk: int = 256) -> Iterator:
    """``tf.data`` buffered shuffle: yield a random element of a ``buffer``-sized window.

    Index plans are worked out ``chunk`` at a time in one loop and handed on through
    ``itertools``: the plan runs on the prefetch thread while the replicas compute, and a
    generator step per example held the GIL they need (~80 µs a batch of 128, ~40 now).
    A streamed dataset's plan holds the examples themselves: ``chunk=1`` reads no further
    ahead than the window, and a failing read ends the plan right after what came
    before it, as tf.data's does."""
    return itertools.chain.from_iterable(_shuffled_chunks(stream, buffer, seed, chunk))


def _shuffled_chunks(stream: Iterator, buffer: int, seed: int, chunk: int) -> Iterator[list]:
    rng = np.random.default_rng(seed)
    stream = iter(stream)
    window = list(itertools.islice(stream, buffer))
    chunk = max(1, min(buffer, chunk))  # no more read ahead than the window already holds
    draws: list = []
    out: list = []
    for item in stream:
        if not draws:
            draws = rng.random(1024).tolist()
        j = int(draws.pop() * buffer)
        out.append(window[j])
        window[j] = item
        if len(out) >= chunk:
            yield out
            out = []
    while window:
        if not draws:
            draws = rng.random(1024).tolist()
        j = int(draws.pop() * len(window))
        out.append(window[j])
        window[j] = window[-1]
        window.pop()
        if len(out) >= chunk:
            yield out
            out = []
    if out:
        yield out


def _batched(stream: Iterator, size: int, drop_remainder: bool) -> Iterator[list]:
    while True:
        batch = list(itertools.islice(stream, size))
        if not batch or (drop_remainder and len(batch) < size):
            return
        yield batch


def _repeated(upstream: Callable, iteration: tuple, count: int | None) -> Iterator:
    r = 0
    while count is None or r < count:
        empty = True
        for item in upstream(iteration + (r,)):
            empty = False
            yield item
        if empty:  # repeating nothing forever would hang; TF ends here too
            return
        r += 1


def _count_after(step, count: int | None, context: tuple, batch_size: int | None
                 ) -> int | None:
    """How many items ``step`` yields from ``count`` (None: endless), as
    :meth:`Pipeline._stage` does."""
    if count is None:
        return step.count if step.op == "take" else None
    if step.op == "batch":
        size = batch_size or step.size
        return count // size if step.drop_remainder else -(-count // size)
    if step.op == "repeat":  # an empty upstream stays empty, even repeated forever
        return None if step.count is None and count else count * (step.count or 0)
    if step.op == "take":
        return min(count, step.count)
    if step.op == "skip":
        return max(0, count - step.count)
    if step.op == "shard":
        shards = step.num_shards or context[0]
        index = step.index if step.index is not None else context[1]
        return max(0, -(-(count - index) // shards))
    return count  # shuffle reorders only


class Pipeline:
    """The compiled ``dataset`` section over the training examples ``indices``.

    Args:
      config: the ``dataset`` section.
      data: the loaded source: in memory, or the user's dataset (its examples collated
        by ``dataset.collate``; an iterable one is streamed through the steps).
      indices: which examples of ``data`` the pipeline starts from (the non-held-out ones).
      seed: ``train.seed`` (the default seed of shuffles, and the workers' seeds).

    Raises:
      ConfigError: every problem of the steps (no batch step, bad map function, ...).
    """

    def __init__(self, config: "DatasetConfig", data: "SourceData | ImportedData",
                 indices: torch.Tensor, seed: int):
        self.config, self.data, self.seed = config, data, seed
        self.indices = [int(i) for i in indices]
        self.batch_size: int | None = None
        self.prefetch = 1
        self.infinite = False
        self._ops: list = []
        element_fns: list = []
        batch_fns: list = []
        problems: list[Problem] = []
        for k, step in enumerate(config.steps):
            problems += self._compile(k, step, batch_fns if self.batch_size else element_fns)
        if self.batch_size is None:
            problems.append(Problem("dataset.steps", "no batch step", "add "
                                    "{op: batch, size: 32} (the global batch size)"))
        problems += self._imported_problems()
        if problems:
            raise ConfigError(problems)
        self.imported = isinstance(data, ImportedData)
        self.streamed = self.imported and data.iterable
        if self.imported:  # batches: the user's examples through dataset.collate
            self.dataset, self.collate = (None if self.streamed else Guarded(data)), \
                Collate(config.collate)
        else:  # batches: (x, y) indexed at once; transforms applied in ExampleSet
            self.dataset, self.collate = ExampleSet(data, element_fns, batch_fns), _as_is

    def _imported_problems(self) -> list[Problem]:
        """What a user's dataset cannot take (an iterable one has no indices)."""
        config = self.config
        if not isinstance(self.data, ImportedData):
            return [Problem("dataset.collate", "applies to source kind: import only",
                            "remove it; built-in sources batch (x, y) themselves")] \
                if config.collate else []
        problems = [Problem(f"dataset.steps.{k}", f"{step.op} works on built-in sources "
                            "only", "transform in your dataset or collate function")
                    for k, step in enumerate(config.steps) if step.op in ("map", "normalize")]
        if self.data.iterable and config.workers:
            problems.append(Problem("dataset.workers", "an IterableDataset is read in the "
                                    "main process (workers would each read all of it)",
                                    "set workers: 0, or make the dataset map-style"))
        if self.data.iterable and config.holdout:
            problems.append(Problem("dataset.holdout", "an IterableDataset has no length "
                                    "to hold a fraction out of", "set holdout: 0"))
        return problems

    def _compile(self, k: int, step, fns: list) -> list[Problem]:
        field = f"dataset.steps.{k}"
        if step.op in ("map", "normalize") and isinstance(self.data, ImportedData):
            return []  # reported by _imported_problems
        if step.op == "batch" and self.batch_size is not None:
            return [Problem(field, "a second batch step", "batch once; steps after it act "
                            "on whole batches")]
        if step.op == "batch":
            self.batch_size = step.size
        elif step.op == "prefetch":
            self.prefetch = step.buffer
            return []
        elif step.op == "normalize":
            return self._compile_normalize(field, step, fns)
        elif step.op == "map":
            try:
                fn = import_object(step.fn, f"{field}.fn")
            except ConfigError as exc:
                return exc.problems
            fns.append(_Map(step.fn, step.kwargs, f"{field}.fn"))
            return _check_map_signature(fn, step, field)
        elif step.op == "shard" and None not in (step.num_shards, step.index) \
                and step.index >= step.num_shards:
            return [Problem(f"{field}.index", f"index {step.index} is not below num_shards "
                            f"{step.num_shards}", f"use 0..{step.num_shards - 1}")]
        if step.op == "repeat" and step.count is None:
            self.infinite = True
        elif step.op == "take":
            self.infinite = False
        self._ops.append((k, step))
        return []

    def _compile_normalize(self, field: str, step, fns: list) -> list[Problem]:
        shape = self.data.feature_shape
        size = int(np.prod(shape)) if shape else 1
        problems = []
        for name in ("mean", "std"):
            value = getattr(step, name)
            values = value if isinstance(value, list) else [value]
            if isinstance(value, list) and len(value) != size:
                problems.append(Problem(f"{field}.{name}", f"has {len(value)} values; the "
                                        f"examples have {size} features",
                                        "give one number, or one per feature"))
            if name == "std" and any(v <= 0 for v in values):
                problems.append(Problem(f"{field}.std", "must be positive"))
        if not problems:
            fns.append(_Normalize(step.mean, step.std, shape))
        return problems

    # -- plans -------------------------------------------------------------------------
    def plan(self, epoch: int, pipelines: int = 1, pipeline_id: int = 0,
             batch_size: int | None = None, share: WorkerShare | None = None
             ) -> Iterator[list[int]]:
        """The batches of example indices of pass ``epoch`` (deterministic).

        ``pipelines``/``pipeline_id`` resolve ``shard`` steps left to the InputContext;
        ``batch_size`` replaces the batch step's size (per-replica batches); ``share``
        keeps a parameter-server worker's part of each global step (its replicas'
        batches). A streamed (iterable) dataset's plan holds its examples instead of
        indices.
        """
        stream: Callable = (lambda iteration: examples(self.data)) if self.streamed else \
            (lambda iteration: iter(self.indices))
        for k, step in self._ops:
            stream = self._stage(stream, k, step, (pipelines, pipeline_id), batch_size)
        return share.parts(stream((epoch,))) if share else stream((epoch,))

    def _stage(self, up: Callable, k: int, step, context: tuple, batch_size) -> Callable:
        if step.op == "shuffle":
            seed = self.seed if step.seed is None else step.seed

            def shuffle(it):
                key = it if step.reshuffle_each_iteration else ()
                return _shuffled(up(it), step.buffer, derive_seed(seed, 3, k, *key),
                                 1 if self.streamed else 256)
            return shuffle
        if step.op == "batch":
            size = batch_size or step.size
            return lambda it: _batched(up(it), size, step.drop_remainder)
        if step.op == "repeat":
            return lambda it: _repeated(up, it, step.count)
        if step.op == "take":
            return lambda it: itertools.islice(up(it), step.count)
        if step.op == "skip":
            return lambda it: itertools.islice(up(it), step.count, None)
        shards = step.num_shards or context[0]
        index = step.index if step.index is not None else context[1]
        return lambda it: itertools.islice(up(it), index, None, shards)

    def batches_per_epoch(self, pipelines: int = 1, pipeline_id: int = 0,
                          batch_size: int | None = None, share: WorkerShare | None = None
                          ) -> int | None:
        """How many batches one pass yields (a worker's ``share``: its per-replica
        ones); None when the pipeline repeats forever or streams a dataset of unknown
        length."""
        if self.infinite or self.streamed:
            return None
        # counted, not walked: a `repeat` of 10**12 would take days to walk
        count = len(self.indices)
        for _, step in self._ops:
            count = _count_after(step, count, (pipelines, pipeline_id), batch_size)
        return share.count(count) if share else count

    def examples_per_pass(self) -> int | None:
        """The examples that reach the batch step in one pass (None: endless)."""
        count: int | None = len(self.indices)
        for _, step in self._ops:
            if step.op == "batch":
                break
            count = _count_after(step, count, (1, 0), None)
        return count

    def steps_per_epoch(self, replicas: int) -> int | None:
        """Training steps in one pass, as the configured distribution consumes batches
        (None: unknown)."""
        if self.infinite or self.streamed:
            return None
        if self.config.distribute == "global":
            return self.batches_per_epoch()
        per_replica = self.batch_size // replicas
        if self.config.replication == "per_worker":  # one pipeline deals `replicas` a step
            return self.batches_per_epoch(1, 0, per_replica) // replicas
        return min(self.batches_per_epoch(replicas, r, per_replica) for r in range(replicas))

    # -- loaders -----------------------------------------------------------------------
    def loader(self, epoch: int, skip: int = 0, *, pipelines: int = 1, pipeline_id: int = 0,
               batch_size: int | None = None, pin_memory: bool = False,
               share: WorkerShare | None = None):
        """A DataLoader over pass ``epoch`` of the plan, after its first ``skip`` batches
        (a streamed dataset replays them: read, not collated). With a worker's ``share``
        it loads only that worker's examples (:class:`_SharedBatches`)."""
        context = (pipelines, pipeline_id, batch_size, share)
        if share is not None and not share.rounds:  # parts can be empty: see the class
            return _SharedBatches(self, epoch, skip, context, pin_memory)
        return self._plan_loader(epoch, skip, context, pin_memory)

    def _plan_loader(self, epoch: int, skip: int, context: tuple, pin_memory: bool):
        """The DataLoader of :meth:`loader` (of a share: its non-empty parts only)."""
        if self.streamed:
            batches = _StreamedBatches(self, epoch, skip, context)
            return torch.utils.data.DataLoader(batches, batch_size=None, collate_fn=_as_is,
                                               pin_memory=pin_memory)
        share = context[3]
        seed = derive_seed(self.seed, 2, epoch, context[1], *([share.index] if share else []))
        return self._loader(_PlanSampler(self, epoch, skip, context), seed, pin_memory)

    def eval_loader(self, indices: torch.Tensor, batch_size: int, pin_memory: bool = False):
        """A DataLoader over ``indices`` in order (the held-out examples), same transforms."""
        order = [int(i) for i in indices]
        batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        return self._loader(batches, derive_seed(self.seed, 4), pin_memory)

    def _loader(self, batch_sampler: Any, seed: int, pin_memory: bool):
        workers = self.config.workers
        extra = dict(worker_init_fn=_seed_worker, prefetch_factor=self.prefetch) \
            if workers else {}
        return _Loader(
            self.dataset, batch_sampler=batch_sampler, collate_fn=self.collate,
            num_workers=workers,
            pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed), **extra
        ).loading(self.loaded())

    def loaded(self) -> str:
        """What a DataLoader worker runs, as a failure of one names it."""
        if not self.imported:
            return f"dataset.source ({self.data.name})"
        collate = f", collated by dataset.collate {self.config.collate}" \
            if self.config.collate else ""
        return f"dataset.source.target {self.data.name}{collate}"


class _Loader(torch.utils.data.DataLoader):
    """A DataLoader whose worker's death (a segfault in the dataset's native code, the
    kernel's OOM killer) is a failure naming what the worker ran, not torch's own."""

    what = "the dataset"

    def loading(self, what: str) -> "_Loader":
        self.what = what
        return self

    def __iter__(self) -> Iterator:
        batches = super().__iter__()
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except RuntimeError as exc:
                if not is_worker_death(exc):
                    raise
                raise worker_died(exc, self.what) from None  # no traceback of use
            yield batch


def is_worker_death(exc: BaseException) -> bool:
    """Whether ``exc`` is torch's word that a DataLoader worker died. It comes from
    ``next()``, or from torch's SIGCHLD handler wherever the main thread then is."""
    return isinstance(exc, RuntimeError) and str(exc).startswith("DataLoader worker (pid")


def worker_died(exc: RuntimeError, what: str) -> UserCodeError:
    """torch's ``DataLoader worker (pid 12) is killed by signal: Segmentation fault.``
    as a failure of ``what`` the worker ran."""
    text = str(exc).split(". ", 1)[0].rstrip(".")
    return UserCodeError(f"a {text} while loading {what}",
                         "set dataset.workers: 0 to load in this process, and run "
                         "`python -X faulthandler -m csrun.cli ...` to see where it fails")


class _StreamedBatches(torch.utils.data.IterableDataset):
    """One pass of a streamed dataset's plan, collated; resumed by replaying ``skip``."""

    def __init__(self, pipeline: Pipeline, epoch: int, skip: int, context: tuple):
        self.pipeline, self.epoch, self.skip, self.context = pipeline, epoch, skip, context

    def __iter__(self) -> Iterator:
        plan = self.pipeline.plan(self.epoch, *self.context)
        return map(self.pipeline.collate, _loaded(plan, self.skip, self.context[3]))


class _PlanSampler(torch.utils.data.Sampler):
    """``batch_sampler`` of a DataLoader: one pass of the plan, resumable by ``skip``."""

    def __init__(self, pipeline: Pipeline, epoch: int, skip: int, context: tuple):
        self.pipeline, self.epoch, self.skip, self.context = pipeline, epoch, skip, context

    def __iter__(self) -> Iterator[list[int]]:
        return _loaded(self.pipeline.plan(self.epoch, *self.context), self.skip,
                       self.context[3])

    def __len__(self) -> int:
        total = self.pipeline.batches_per_epoch(*self.context)
        if total is None:
            raise TypeError("the pipeline repeats forever; it has no length")
        if self.context[3] is not None:  # a share's empty parts are not loaded: walked
            return sum(1 for _ in iter(self))
        return max(0, total - self.skip)


def _loaded(plan: Iterator[list], skip: int, share: WorkerShare | None) -> Iterator[list]:
    """The batches of ``plan`` a loader loads: after ``skip``; of a share, the non-empty."""
    batches = itertools.islice(plan, skip, None)
    return filter(len, batches) if share is not None else batches


class _SharedBatches:
    """A worker's batches of its share of a pass of global batches: where its part is
    empty (a global batch smaller than the workers or its replicas), an empty batch,
    as TF gives such a worker. Only the non-empty parts are loaded; an empty one has the
    structure of one of this worker's own batches (the last, else the next, else the
    pass's first)."""

    def __init__(self, pipeline: Pipeline, epoch: int, skip: int, context: tuple,
                 pin_memory: bool):
        self.pipeline, self.epoch, self.skip = pipeline, epoch, skip
        self.context, self.pin_memory = context, pin_memory

    def __len__(self) -> int:
        total = self.pipeline.batches_per_epoch(*self.context)
        if total is None:
            raise TypeError("the pipeline repeats forever; it has no length")
        return max(0, total - self.skip)

    def __iter__(self) -> Iterator:
        plan = self.pipeline.plan(self.epoch, *self.context)
        loaded = iter(self.pipeline._plan_loader(self.epoch, self.skip, self.context,
                                                 self.pin_memory))
        empty, held, last = None, [], None
        for part in itertools.islice(plan, self.skip, None):
            if len(part):
                last = held.pop() if held else next(loaded)
                yield last
                continue
            if empty is None and last is None:
                held = list(itertools.islice(loaded, 1))
            if empty is None:
                empty = _emptied(last if last is not None else held[0] if held
                                 else self._first())
            yield empty

    def _first(self) -> Any:
        """The pass's first batch of this worker (its rest has none to copy)."""
        for batch in self.pipeline._plan_loader(self.epoch, 0, self.context, False):
            return batch
        share = self.context[3]
        raise ValueError(f"worker {share.index} of {share.workers} has no example in pass "
                         f"{self.epoch}: the pass has fewer examples than the workers")


def _emptied(batch: Any) -> Any:
    """``batch`` with none of its examples: each tensor's first ``0`` rows."""
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, dict):
        return type(batch)((k, _emptied(v)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(_emptied(v) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_emptied(v) for v in batch)
    return batch
