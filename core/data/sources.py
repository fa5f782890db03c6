"""Where a run's examples come from: a range, synthetic data, the bundled digits, or a
``.npz``/``.npy``/``.csv``/``.tsv`` file; all examples in memory, checked as they load.

Example::

    data = load_source(config.dataset.source)
    train, held_out = split_holdout(len(data), 0.1, seed=0)
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.resources
import pathlib
import warnings
from typing import Any

import numpy as np
import torch

from ..config.problems import ConfigError, Problem
from .imported import ImportedData, load_imported

__all__ = ["SourceData", "load_source", "source_bytes", "split_holdout", "derive_seed"]


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
def load_source(source: Any) -> "SourceData | ImportedData":
    """Read (or generate) every example of ``dataset.source``; for ``kind: import``, the
    user's dataset (:mod:`.imported`), read as the pipeline goes.

    Raises:
      ConfigError: a missing or unreadable file, unknown keys/columns, bad shapes, a
        user dataset that fails.
    """
    if source.kind == "import":
        return load_imported(source)
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
