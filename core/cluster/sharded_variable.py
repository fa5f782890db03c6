"""Partitioned variables: TF's partitioners (``tf.distribute.experimental.partitioners``).

A partitioner says into how many shards a variable splits along dim 0
(``FixedShardsPartitioner``, ``MinSizePartitioner``, ``MaxSizePartitioner``, or the
user's own: a ``Partitioner`` subclass or any callable ``(shape, dtype)``, as TF takes);
the plan (:mod:`.plan`) cuts the rows and places the shards.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

__all__ = ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner",
           "MaxSizePartitioner", "partitioner_from_config"]


class Partitioner:
    """Into how many shards a variable splits along dim 0 (TF's Partitioner): called
    with its shape and dtype, returns ``[n, 1, 1, ...]`` (TF's rules for what it may
    return are the plan's: :func:`.plan.shard_count`)."""

    def __call__(self, shape: Sequence[int], dtype: torch.dtype, axis: int = 0) -> list[int]:
        raise NotImplementedError


def _whole_number(value, name: str) -> int:
    """``value`` as the count it must be: an int (TF takes 2.5 or "2" here and fails
    when a variable is made; csrun says so at once, naming it)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    return value


def _at_least_one(value, name: str) -> None:
    """TF's check of a byte count: a number, at least 1 (1.5 is fine)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    if not value >= 1:
        raise ValueError(f"Argument `{name}` must be positive. Received: {value}")


def _axis_of(shape, axis: int) -> int:
    """``axis``, checked against ``shape`` (TF indexes past the end: an IndexError)."""
    if not 0 <= axis < len(shape):
        raise ValueError(f"Cannot partition variable along axis {axis} when shape is "
                         f"only {tuple(shape)}")
    return axis


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class FixedShardsPartitioner(Partitioner):
    """``num_shards`` shards (fewer for a variable with fewer rows), as TF's."""

    def __init__(self, num_shards: int):
        if _whole_number(num_shards, "num_shards") < 1:
            raise ValueError(f"num_shards must be at least 1, got {num_shards}")
        self.num_shards_wanted = num_shards

    def __call__(self, shape, dtype, axis: int = 0) -> list[int]:
        rows = shape[_axis_of(shape, axis)]
        result = [1] * len(shape)
        result[axis] = min(self.num_shards_wanted, rows)
        return result

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self.num_shards_wanted})"


class MinSizePartitioner(Partitioner):
    """As many shards as the variable has ``min_shard_bytes`` (rounded up, as TF's
    ``min_max_variable_partitioner``), at most ``max_shards`` (TF's MinSizePartitioner;
    its defaults). ``bytes_per_string``: TF's size of a string element (torch has no
    string tensors: checked, and kept for TF's signature)."""

    def __init__(self, min_shard_bytes: float = 256 << 10, max_shards: int = 1,
                 bytes_per_string: float = 16):
        _at_least_one(min_shard_bytes, "min_shard_bytes")
        _at_least_one(bytes_per_string, "bytes_per_string")
        if _whole_number(max_shards, "max_shards") < 1:
            raise ValueError(f"Argument `max_shards` must be positive. Received: {max_shards}")
        self.min_shard_bytes, self.max_shards = min_shard_bytes, max_shards
        self.bytes_per_string = bytes_per_string

    def __call__(self, shape, dtype, axis: int = 0) -> list[int]:
        _axis_of(shape, axis)
        total = _element_size(dtype) * math.prod(shape)
        result = [1] * len(shape)
        result[axis] = max(1, min(shape[axis], self.max_shards,
                                  math.ceil(total / self.min_shard_bytes)))
        return result

    def __repr__(self) -> str:
        return (f"MinSizePartitioner(min_shard_bytes={self.min_shard_bytes}, "
                f"max_shards={self.max_shards})")


class MaxSizePartitioner(Partitioner):
    """As few shards as keep each within ``max_shard_bytes`` (whole rows, at least one row
    a shard), at most ``max_shards`` (None or 0: no limit), as TF's MaxSizePartitioner
    (``variable_axis_size_partitioner``). ``bytes_per_string``: as for MinSize."""

    def __init__(self, max_shard_bytes: float, max_shards: int | None = None,
                 bytes_per_string: float = 16):
        _at_least_one(max_shard_bytes, "max_shard_bytes")
        _at_least_one(bytes_per_string, "bytes_per_string")
        if max_shards is not None and _whole_number(max_shards, "max_shards") < 0:
            raise ValueError(f"Argument `max_shards` must be positive. Received {max_shards}")
        self.max_shard_bytes, self.max_shards = max_shard_bytes, max_shards
        self.bytes_per_string = bytes_per_string

    def __call__(self, shape, dtype, axis: int = 0) -> list[int]:
        rows = shape[_axis_of(shape, axis)]
        if rows == 0:  # TF: a ZeroDivisionError
            raise ValueError(f"{self!r} cannot size the shards of a variable of shape "
                             f"{list(shape)}: it has no rows along axis {axis}")
        row_bytes = math.prod(shape) / rows * _element_size(dtype)
        shards = 1
        if row_bytes:  # rows of zero bytes: one shard holds them all
            shards = math.ceil(rows / max(1, math.floor(self.max_shard_bytes / row_bytes)))
        result = [1] * len(shape)
        result[axis] = min(self.max_shards, shards) if self.max_shards else shards
        return result

    def __repr__(self) -> str:
        return (f"MaxSizePartitioner(max_shard_bytes={self.max_shard_bytes}, "
                f"max_shards={self.max_shards})")


def partitioner_from_config(settings) -> Partitioner | None:
    """The partitioner of ``strategy.variable_partitioner`` (None: variables stay whole)."""
    if settings is None:
        return None
    if settings.kind == "fixed":
        return FixedShardsPartitioner(settings.num_shards)
    if settings.kind == "max_size":
        return MaxSizePartitioner(settings.max_shard_bytes, settings.max_shards)
    return MinSizePartitioner(settings.min_shard_bytes, settings.max_shards)
