"""Your own data: ``dataset.source: {kind: import}`` names a factory returning a map-style
``torch.utils.data.Dataset`` or an ``IterableDataset``; ``dataset.collate`` makes batches
(default ``torch.utils.data.default_collate``). Examples are any nest of tensors and
numbers, kept in the dtypes the dataset gives.

Failures in the user's code name the config key and the user's ``file:line``: before a
run as config problems, during one as :class:`~csrun.core.config.user_code.UserCodeError`.

Example::

    data = load_imported(config.dataset.source)
    batch = first_batch(data, Collate(config.dataset.collate), 2)
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from ..config.problems import ConfigError, Problem
from ..config.targets import import_object
from ..config.user_code import (CHECKED_FAILURES, UserCodeError, user_code_error,
                                user_problem)
from ..distribute.jagged import JaggedTensor
from ..distribute.values import flatten

__all__ = ["ImportedData", "load_imported", "Collate", "Guarded", "examples", "first_batch"]

SOURCE, COLLATE = "dataset.source.target", "dataset.collate"


@dataclasses.dataclass(frozen=True)
class ImportedData:
    """A user's dataset.

    Attributes:
      dataset: the Dataset or IterableDataset the factory returned.
      target: the factory's ``package.module:name``.
    """

    dataset: Any
    target: str

    @property
    def iterable(self) -> bool:
        return isinstance(self.dataset, IterableDataset)

    @property
    def name(self) -> str:
        return f"{type(self.dataset).__name__} ({self.target})"

    # what a built-in source says of its data; a user's dataset does not say it
    task = None
    classes = None
    outputs = None
    feature_shape: tuple = ()

    def __len__(self) -> int:
        """Indexable examples: an iterable dataset has none (the pipeline streams it)."""
        return 0 if self.iterable else len(self.dataset)


def load_imported(source) -> ImportedData:
    """Call the factory of ``dataset.source``.

    Raises:
      ConfigError: it does not import, fails, or returns no usable dataset.
    """
    factory = import_object(source.target, SOURCE)
    try:
        dataset = factory(**source.kwargs)
    except CHECKED_FAILURES as exc:  # noqa: BLE001 - the user's code may raise anything
        raise ConfigError([user_problem(SOURCE, f"{source.target}(**kwargs)", exc,
                                        "check dataset.source.kwargs")]) from None
    data = ImportedData(dataset, source.target)
    if isinstance(dataset, IterableDataset):
        return data
    if not (isinstance(dataset, Dataset) or hasattr(dataset, "__getitem__")) or \
            not hasattr(dataset, "__len__"):
        raise ConfigError([Problem(SOURCE, f"{source.target} returned a "
                                   f"{type(dataset).__name__}, not a torch.utils.data."
                                   "Dataset (with __len__) or IterableDataset")])
    try:
        size = len(dataset)
    except CHECKED_FAILURES as exc:  # noqa: BLE001
        raise ConfigError([user_problem(SOURCE, f"len() of {data.name}", exc)]) from None
    if size <= 0:
        raise ConfigError([Problem(SOURCE, f"{data.name} holds no examples")])
    return data


class Guarded(Dataset):
    """A map-style user dataset whose failures name ``dataset.source.target``."""

    def __init__(self, data: ImportedData):
        self.dataset, self.target = data.dataset, data.target

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:  # noqa: BLE001
            raise user_code_error(SOURCE, f"{self.target}[{index}]", exc) from exc


def examples(data: ImportedData) -> Iterator:
    """The examples of an iterable dataset, failures naming ``dataset.source.target``."""
    iterator = iter(data.dataset)
    while True:
        try:
            example = next(iterator)
        except StopIteration:
            return
        except Exception as exc:  # noqa: BLE001
            raise user_code_error(SOURCE, f"iterating {data.target}", exc) from exc
        yield example


class Collate:
    """``dataset.collate``, picklable for DataLoader workers (imported again there)."""

    def __init__(self, target: str | None):
        self.target = target
        self._fn: Callable | None = None

    def __getstate__(self):
        return {"target": self.target, "_fn": None}

    def load(self) -> Callable:
        """The function (ConfigError when the target does not import)."""
        if self._fn is None:
            self._fn = import_object(self.target, COLLATE) if self.target else default_collate
        return self._fn

    def __call__(self, batch: list) -> Any:
        fn = self.load()
        try:
            collated = fn(batch)
        except Exception as exc:  # noqa: BLE001
            raise user_code_error(COLLATE, self.target or "default_collate", exc) from exc
        # each batch as the first one was checked (first_batch): a string mid-run would
        # otherwise fail deep in the split, naming no key
        problem = _unsplittable(collated, len(batch))
        if problem:
            raise UserCodeError(f"{COLLATE}: {self.target or 'default_collate'} on "
                                f"{len(batch)} examples returned no batch: {problem}",
                                UNSPLITTABLE_HINT)
        return collated


def first_batch(data: ImportedData, collate: Collate, count: int) -> Any:
    """The batch of the first ``count`` examples, checked to be splittable across replicas.

    Raises:
      ConfigError: reading, collating or the batch's structure failed.
    """
    try:
        if data.iterable:
            items = list(itertools.islice(examples(data), count))
        else:
            items = [Guarded(data)[i] for i in range(min(count, len(data)))]
    except CHECKED_FAILURES as exc:  # noqa: BLE001
        cause = exc.__cause__ or exc
        raise ConfigError([user_problem(SOURCE, f"reading the first examples of "
                                        f"{data.name}", cause)]) from None
    if not items:
        raise ConfigError([Problem(SOURCE, f"{data.name} yields no examples")])
    try:
        batch = collate.load()(items)
    except ConfigError:
        raise
    except CHECKED_FAILURES as exc:  # noqa: BLE001
        raise ConfigError([user_problem(COLLATE, f"{collate.target or 'default_collate'} "
                                        f"on the first {len(items)} examples", exc,
                                        None if collate.target else "write a collate "
                                        "function and set dataset.collate")]) from None
    problem = _unsplittable(batch, len(items))
    if problem:
        raise ConfigError([Problem(COLLATE, problem, UNSPLITTABLE_HINT)])
    return batch


UNSPLITTABLE_HINT = ("a batch is a nest (tuples, lists, dicts) of tensors whose first "
                     "dimension is the examples, or of JaggedTensors (ids by example: "
                     "csrun.core.JaggedTensor.collate)")


def _unsplittable(batch: Any, count: int) -> str | None:
    """Why the replicas could not each take a slice of ``batch``, or None."""
    for leaf in flatten(batch):
        if isinstance(leaf, JaggedTensor) and len(leaf) == count:  # ids by example
            continue
        if not isinstance(leaf, torch.Tensor):
            return f"the batch holds a {type(leaf).__name__} ({leaf!r:.40}), not a tensor"
        if leaf.dim() == 0 or leaf.shape[0] != count:
            return (f"a tensor of the batch of {count} examples has shape "
                    f"{list(leaf.shape)}: its first dimension must be the {count} examples")
    return None
