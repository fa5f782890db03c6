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

import dataclasses
import importlib
import importlib.resources
import itertools
import pathlib
import random
import warnings
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import torch

from ..config.problems import ConfigError, Problem

if TYPE_CHECKING:  # pragma: no cover
    from ..config.schema import DatasetConfig

__all__ = ["SourceData", "load_source", "source_bytes", "split_holdout", "Pipeline",
           "import_object", "derive_seed"]


@dataclasses.dataclass(frozen=True)
class SourceData:
    """All examples of a source, in memory.

    Attributes:
      features: float32 tensor ``(N, ...)``.
      targets: int64 ``(N,)`` class labels, or float32 ``(N, k)`` regression targets.
      task: ``"classification"`` or ``"regression"``.
      classes: the number of classes (classification), else None.
      name: a short description for logs.
    """

    features: torch.Tensor
    targets: torch.Tensor
    task: str
    classes: int | None
    name: str

    def __len__(self) -> int:
        return int(self.features.shape[0])

    @property
    def feature_shape(self) -> tuple:
        return tuple(self.features.shape[1:])

    @property
    def outputs(self) -> int:
        """Model outputs needed: classes, or target values per example."""
        return self.classes if self.task == "classification" else int(self.targets.shape[1])


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from a few integers (stable across runs, platforms and versions)."""
    entropy = [p % (1 << 64) for p in parts]
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0] >> np.uint64(1))


# -- sources -------------------------------------------------------------------------------
def load_source(source: Any) -> SourceData:
    """Read (or generate) every example of ``dataset.source``.

    Raises:
      ConfigError: a missing or unreadable file, unknown keys/columns, bad shapes.
    """
    loader = {"range": _range, "synthetic": _synthetic, "file": _file,
              "digits": _digits}[source.kind]
    return loader(source)


def source_bytes(source: Any) -> int | None:
    """About the peak memory of loading ``source``, known before loading it (a generated
    source could be too big to make); None when it is what the file is on disk.
    """
    per_example = 64  # its index in the plan's Python lists and the holdout permutation
    if source.kind == "range":
        return _range_count(source.start, source.stop, source.step) * (8 + per_example)
    if source.kind != "synthetic":
        return None
    n, f = source.examples, source.features
    per_example += f * (8 + 8 + 4)  # float64 draws and noise, then the float32 features
    if source.task == "classification":
        return n * (per_example + 16) + source.classes * f * 8
    return n * (per_example + source.targets * 20) + f * source.targets * 8


def _range_count(start: int, stop: int, step: int) -> int:
    # len(range(...)) overflows past sys.maxsize; the arithmetic does not
    if step == 0:
        return 0
    return max(0, (stop - start + step - (1 if step > 0 else -1)) // step)


def _range(source) -> SourceData:
    if source.step == 0:
        raise ConfigError([Problem("dataset.source.step", "must not be 0")])
    if _range_count(source.start, source.stop, source.step) == 0:
        raise ConfigError([Problem("dataset.source", f"range({source.start}, {source.stop}, "
                                   f"{source.step}) holds no integers",
                                   "stop must lie past start in the direction of step")])
    values = torch.arange(source.start, source.stop, source.step, dtype=torch.float32)
    column = values.reshape(-1, 1)
    return SourceData(column, column.clone(), "regression", None,
                      f"range({source.start}, {source.stop}, {source.step})")


def _synthetic(source) -> SourceData:
    rng = np.random.default_rng(source.seed)
    n, f = source.examples, source.features
    if source.task == "classification":
        centers = rng.normal(0.0, 2.0, size=(source.classes, f))
        labels = rng.integers(0, source.classes, size=n)
        x = centers[labels] + rng.normal(0.0, source.noise, size=(n, f))
        return SourceData(torch.tensor(x, dtype=torch.float32),
                          torch.tensor(labels, dtype=torch.int64), "classification",
                          source.classes, f"synthetic blobs ({source.classes} classes)")
    weights = rng.normal(0.0, 1.0, size=(f, source.targets))
    x = rng.normal(0.0, 1.0, size=(n, f))
    y = x @ weights + rng.normal(0.0, source.noise, size=(n, source.targets))
    return SourceData(torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.float32),
                      "regression", None, f"synthetic linear map ({source.targets} targets)")


def _digits(source) -> SourceData:
    with importlib.resources.files("csrun.core.data").joinpath("digits.npz").open("rb") as f:
        arrays = np.load(f, allow_pickle=False)
        images, labels = arrays["images"], arrays["labels"]
    x = torch.tensor(images, dtype=torch.float32)
    if source.scale:
        x = x / 16.0
    x = x.reshape(len(x), 64) if source.layout == "flat" else x.reshape(len(x), 1, 8, 8)
    return SourceData(x, torch.tensor(labels, dtype=torch.int64), "classification", 10,
                      "UCI optical digits (1797 8x8 images)")


# What each kind of file starts with; anything else is not that kind of file.
_MAGIC = {".npz": (b"PK\x03\x04", b"PK\x05\x06"), ".npy": (b"\x93NUMPY",)}
_FORMATS = {".npz": "a .npz (a zip of .npy arrays, from numpy.savez)",
            ".npy": "a .npy (a NumPy array, from numpy.save)",
            ".csv": "a .csv (comma-separated numbers, UTF-8)"}


def _file(source) -> SourceData:
    path = pathlib.Path(source.path)
    suffix = path.suffix.lower()
    if suffix not in _FORMATS:
        raise _source_error("path", f"{source.path!r} is not a .npz, .npy or .csv file")
    _check_file(path, source.path, suffix)
    try:
        with warnings.catch_warnings():  # numpy warns of an empty table; we say so below
            warnings.simplefilter("ignore")
            x, y = _npz(path, source) if suffix == ".npz" else _table(path, source, suffix)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - numpy and zipfile raise many kinds
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise _source_error("path", f"cannot read {source.path!r} as {_FORMATS[suffix]}: "
                            f"{type(exc).__name__}: {reason}", "is it complete (not "
                            "truncated) and written by NumPy (or as plain CSV)?") from None
    return _from_arrays(x, y, source, path.name)


def _check_file(path: pathlib.Path, shown: str, suffix: str) -> None:
    """The file exists, can be read, and starts as its kind of file does."""
    if path.is_dir():
        raise _source_error("path", f"{shown!r} is a directory, not a data file")
    if not path.is_file():
        raise _source_error("path", f"file {shown!r} not found (relative paths start "
                            f"at the current directory, {str(pathlib.Path.cwd())!r})")
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError as exc:
        raise _source_error("path", f"cannot read {shown!r}: {exc.strerror or exc}",
                            "check the file's permissions") from None
    if suffix in _MAGIC and not head.startswith(_MAGIC[suffix]) or \
            suffix == ".csv" and b"\0" in head:
        raise _source_error("path", f"{shown!r} is not {_FORMATS[suffix]}",
                            "is it damaged, or another kind of file?")


def _source_error(field: str, message: str, hint: str | None = None) -> ConfigError:
    return ConfigError([Problem(f"dataset.source.{field}", message, hint)])


def _npz(path: pathlib.Path, source) -> tuple[np.ndarray, np.ndarray]:
    with np.load(path, allow_pickle=False) as arrays:
        problems = [Problem(f"dataset.source.{field}", f"{path.name} has no array {key!r}",
                            f"its arrays: {', '.join(arrays.files)}")
                    for field, key in (("features_key", source.features_key),
                                       ("target_key", source.target_key))
                    if key not in arrays.files]
        if problems:
            raise ConfigError(problems)
        x, y = arrays[source.features_key], arrays[source.target_key]
    if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray)):  # a non-.npy member
        raise _source_error("path", f"{path.name}: {source.features_key!r} and "
                            f"{source.target_key!r} must be .npy arrays inside the .npz")
    return x, y


def _table(path: pathlib.Path, source, suffix: str) -> tuple[np.ndarray, np.ndarray]:
    header: list[str] = []
    if suffix == ".npy":
        table = np.load(path, allow_pickle=False)
    else:
        with open(path, encoding="utf-8") as f:
            first = f.readline()
        cells = [c.strip() for c in first.split(",")]
        if any(not _is_number(c) for c in cells):
            header = cells
        table = np.loadtxt(path, delimiter=",", skiprows=1 if header else 0, ndmin=2)
    if table.size == 0:
        raise _source_error("path", f"{path.name} has no data rows")
    if table.ndim != 2 or table.shape[1] < 2:
        raise _source_error("path", f"{path.name} must be a 2-D table with at least 2 "
                            f"columns (features and a target), got shape {table.shape}")
    column = _column_index(source.target_column, header, table.shape[1])
    features = np.delete(table, column, axis=1)
    return features, table[:, column]


def _is_number(text: str) -> bool:
    try:
        float(text)
        return True
    except ValueError:
        return False


def _column_index(column: int | str, header: list[str], width: int) -> int:
    if isinstance(column, str):
        if column in header:
            return header.index(column)
        from ..config.problems import did_you_mean
        raise _source_error("target_column", f"no column named {column!r}",
                            did_you_mean(column, header) or (f"columns: {', '.join(header)}"
                                                             if header else "the file has "
                                                             "no header; give an index"))
    if not -width <= column < width:
        raise _source_error("target_column", f"column {column} is out of range for "
                            f"{width} columns", f"use 0..{width - 1} or -1 for the last")
    return column % width


def _from_arrays(x: np.ndarray, y: np.ndarray, source, name: str) -> SourceData:
    _check_shapes(x, y, name)
    with np.errstate(over="ignore"):  # a value past float32's range: refused just below
        features = torch.tensor(np.asarray(x, dtype=np.float32))
    _check_finite(features, "features", name)
    _check_finite(torch.tensor(np.asarray(y, dtype=np.float64)), "targets", name)
    whole = bool(np.all(np.mod(y, 1) == 0)) and y.ndim == 1
    task = source.task if source.task != "auto" else (
        "classification" if whole else "regression")
    if task == "classification":
        if not whole or y.min() < 0:
            raise _source_error("task", f"{name}: classification needs whole, non-negative "
                                "class labels in a 1-D target", "set task: regression")
        labels = torch.tensor(y.astype(np.int64))
        return SourceData(features, labels, task, int(labels.max()) + 1, name)
    targets = torch.tensor(np.asarray(y, dtype=np.float32)).reshape(len(y), -1)
    return SourceData(features, targets, task, None, name)


def _check_shapes(x: np.ndarray, y: np.ndarray, name: str) -> None:
    """One row per example in both arrays, real numbers, at least one feature."""
    if x.ndim < 2 or y.ndim < 1:
        raise _source_error("path", f"{name}: features need the shape (examples, features"
                            f"...) and targets (examples,...); got {x.shape} and {y.shape}",
                            "save one row per example, e.g. x.reshape(-1, 1) for one feature")
    if len(x) != len(y) or len(x) == 0:
        raise _source_error("path", f"{name}: {len(x)} feature rows and {len(y)} targets; "
                            "they must match and not be empty")
    if 0 in x.shape[1:]:
        raise _source_error("path", f"{name}: the examples have no features (shape "
                            f"{x.shape})")
    for what, array in (("features", x), ("targets", y)):
        if not np.issubdtype(array.dtype, np.number) or \
                np.issubdtype(array.dtype, np.complexfloating):
            raise _source_error("path", f"{name}: the {what} have dtype {array.dtype}; they "
                                "must be real numbers (int or float)",
                                "convert them, e.g. array.astype('float32')")


def _check_finite(values: torch.Tensor, what: str, name: str) -> None:
    """No NaN or infinity (nor a number past float32's range, which becomes infinity):
    they would only show later, as a non-finite loss."""
    bad = ~torch.isfinite(values)
    if bool(bad.any()):
        rows = bad.reshape(len(values), -1).any(1).nonzero().flatten()
        raise _source_error("path", f"{name}: the {what} hold {int(bad.sum())} NaN or "
                            f"infinite value(s) (or beyond float32's range), the first in "
                            f"row {int(rows[0])}", "clean the data: drop or fill those rows")


def split_holdout(count: int, fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of the training and held-out examples (a seeded permutation)."""
    held = int(count * fraction)
    if held == 0:
        return torch.arange(count), torch.arange(0)
    order = torch.randperm(count, generator=torch.Generator().manual_seed(derive_seed(seed, 1)))
    return order[held:].sort().values, order[:held].sort().values


# -- element and batch transforms (picklable, for worker processes) ------------------------
def import_object(target: str, field: str) -> Any:
    """Import ``"package.module:name"``.

    Raises:
      ConfigError: at ``field``, with what failed (format, module, attribute).
    """
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError([Problem(field, f"{target!r} is not 'package.module:name'",
                                   "e.g. mypackage.models:Net")])
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the user's to fix
        raise ConfigError([Problem(field, f"cannot import module {module_name!r}: "
                                   f"{type(exc).__name__}: {exc}",
                                   "is it installed, or on PYTHONPATH?")]) from None
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            from ..config.problems import did_you_mean
            names = [n for n in dir(obj) if not n.startswith("_")]
            raise ConfigError([Problem(field, f"module {module_name!r} has no {attr!r}",
                                       did_you_mean(part, names))])
        obj = getattr(obj, part)
    return obj


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
        result = self._fn(x, y, **self.kwargs)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"map function {self.target} must return (x, y), got "
                            f"{type(result).__name__}")
        return result


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
def _shuffled(stream: Iterator, buffer: int, seed: int) -> Iterator:
    """``tf.data`` buffered shuffle: yield a random element of a ``buffer``-sized window."""
    rng = np.random.default_rng(seed)
    draws: list = []
    window: list = []
    for item in stream:
        if len(window) < buffer:
            window.append(item)
            continue
        if not draws:
            draws = rng.random(1024).tolist()
        j = int(draws.pop() * buffer)
        yield window[j]
        window[j] = item
    while window:
        if not draws:
            draws = rng.random(1024).tolist()
        j = int(draws.pop() * len(window))
        yield window[j]
        window[j] = window[-1]
        window.pop()


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


class Pipeline:
    """The compiled ``dataset`` section over the training examples ``indices``.

    Args:
      config: the ``dataset`` section.
      data: the loaded source.
      indices: which examples of ``data`` the pipeline starts from (the non-held-out ones).
      seed: ``train.seed`` (the default seed of shuffles, and the workers' seeds).

    Raises:
      ConfigError: every problem of the steps (no batch step, bad map function, ...).
    """

    def __init__(self, config: "DatasetConfig", data: SourceData, indices: torch.Tensor,
                 seed: int):
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
        if problems:
            raise ConfigError(problems)
        self.dataset = ExampleSet(data, element_fns, batch_fns)

    def _compile(self, k: int, step, fns: list) -> list[Problem]:
        field = f"dataset.steps.{k}"
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
                import_object(step.fn, f"{field}.fn")
            except ConfigError as exc:
                return exc.problems
            fns.append(_Map(step.fn, step.kwargs, f"{field}.fn"))
            return []
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
             batch_size: int | None = None) -> Iterator[list[int]]:
        """The batches of example indices of pass ``epoch`` (deterministic).

        ``pipelines``/``pipeline_id`` resolve ``shard`` steps left to the InputContext;
        ``batch_size`` replaces the batch step's size (per-replica batches).
        """
        stream: Callable = lambda iteration: iter(self.indices)  # noqa: E731
        for k, step in self._ops:
            stream = self._stage(stream, k, step, (pipelines, pipeline_id), batch_size)
        return stream((epoch,))

    def _stage(self, up: Callable, k: int, step, context: tuple, batch_size) -> Callable:
        if step.op == "shuffle":
            seed = self.seed if step.seed is None else step.seed

            def shuffle(it):
                key = it if step.reshuffle_each_iteration else ()
                return _shuffled(up(it), step.buffer, derive_seed(seed, 3, k, *key))
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
                          batch_size: int | None = None) -> int | None:
        """How many batches one pass yields; None when the pipeline repeats forever."""
        if self.infinite:
            return None
        return sum(1 for _ in self.plan(0, pipelines, pipeline_id, batch_size))

    def steps_per_epoch(self, replicas: int) -> int | None:
        """Training steps in one pass, as the configured distribution consumes batches."""
        if self.infinite:
            return None
        if self.config.distribute == "global":
            return self.batches_per_epoch()
        per_replica = self.batch_size // replicas
        if self.config.replication == "per_worker":  # one pipeline deals `replicas` a step
            return self.batches_per_epoch(1, 0, per_replica) // replicas
        return min(self.batches_per_epoch(replicas, r, per_replica) for r in range(replicas))

    # -- loaders -----------------------------------------------------------------------
    def loader(self, epoch: int, skip: int = 0, *, pipelines: int = 1, pipeline_id: int = 0,
               batch_size: int | None = None, pin_memory: bool = False):
        """A DataLoader over pass ``epoch`` of the plan, after its first ``skip`` batches."""
        sampler = _PlanSampler(self, epoch, skip, (pipelines, pipeline_id, batch_size))
        return self._loader(sampler, derive_seed(self.seed, 2, epoch, pipeline_id), pin_memory)

    def eval_loader(self, indices: torch.Tensor, batch_size: int, pin_memory: bool = False):
        """A DataLoader over ``indices`` in order (the held-out examples), same transforms."""
        order = [int(i) for i in indices]
        batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        return self._loader(batches, derive_seed(self.seed, 4), pin_memory)

    def _loader(self, batch_sampler: Any, seed: int, pin_memory: bool):
        workers = self.config.workers
        extra = dict(worker_init_fn=_seed_worker, prefetch_factor=self.prefetch) \
            if workers else {}
        return torch.utils.data.DataLoader(
            self.dataset, batch_sampler=batch_sampler, collate_fn=_as_is, num_workers=workers,
            pin_memory=pin_memory, generator=torch.Generator().manual_seed(seed), **extra)


class _PlanSampler(torch.utils.data.Sampler):
    """``batch_sampler`` of a DataLoader: one pass of the plan, resumable by ``skip``."""

    def __init__(self, pipeline: Pipeline, epoch: int, skip: int, context: tuple):
        self.pipeline, self.epoch, self.skip, self.context = pipeline, epoch, skip, context

    def __iter__(self) -> Iterator[list[int]]:
        return itertools.islice(self.pipeline.plan(self.epoch, *self.context), self.skip, None)

    def __len__(self) -> int:
        total = self.pipeline.batches_per_epoch(*self.context)
        if total is None:
            raise TypeError("the pipeline repeats forever; it has no length")
        return max(0, total - self.skip)
