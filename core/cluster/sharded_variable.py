"""Partitioned variables: TF's partitioners (``tf.distribute.experimental.partitioners``).

A partitioner says into how many shards a variable splits along dim 0
(``FixedShardsPartitioner``, ``MinSizePartitioner``, or one of the user's own); the plan
(:mod:`.plan`) cuts the rows and places the shards.
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["Partitioner", "FixedShardsPartitioner", "MinSizePartitioner",
           "partitioner_from_config"]


class Partitioner:
    """Into how many shards a variable splits along dim 0 (TF's Partitioner): called
    with its shape and dtype, returns ``[n, 1, 1, ...]``."""

    def __call__(self, shape: Sequence[int], dtype: torch.dtype) -> list[int]:
        raise NotImplementedError

    def num_shards(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        """The shard count for a variable; scalars and one-row variables stay whole."""
        if len(shape) == 0 or shape[0] <= 1:
            return 1
        partitions = list(self(tuple(shape), dtype))
        if len(partitions) != len(shape) or any(p != 1 for p in partitions[1:]) \
                or not 1 <= partitions[0]:
            raise ValueError(f"{type(self).__name__} returned {partitions} for shape "
                             f"{list(shape)}; a partitioner splits dim 0 only: [n, 1, ...] "
                             "with n >= 1")
        return min(partitions[0], shape[0])


class FixedShardsPartitioner(Partitioner):
    """``num_shards`` shards (fewer for a variable with fewer rows), as TF's."""

    def __init__(self, num_shards: int):
        if int(num_shards) < 1:
            raise ValueError(f"num_shards must be at least 1, got {num_shards}")
        self.num_shards_wanted = int(num_shards)

    def __call__(self, shape, dtype) -> list[int]:
        return [min(self.num_shards_wanted, shape[0])] + [1] * (len(shape) - 1)

    def __repr__(self) -> str:
        return f"FixedShardsPartitioner(num_shards={self.num_shards_wanted})"


class MinSizePartitioner(Partitioner):
    """As many shards as the variable has ``min_shard_bytes`` (rounded up, as TF's
    ``min_max_variable_partitioner``), at most ``max_shards`` (TF's MinSizePartitioner;
    its defaults)."""

    def __init__(self, min_shard_bytes: int = 256 << 10, max_shards: int = 1):
        if int(min_shard_bytes) < 1 or int(max_shards) < 1:
            raise ValueError(f"min_shard_bytes and max_shards must be at least 1, got "
                             f"{min_shard_bytes} and {max_shards}")
        self.min_shard_bytes, self.max_shards = int(min_shard_bytes), int(max_shards)

    def __call__(self, shape, dtype) -> list[int]:
        element = torch.empty((), dtype=dtype).element_size()
        total = element
        for size in shape:
            total *= size
        shards = max(1, min(self.max_shards, shape[0], -(-total // self.min_shard_bytes)))
        return [shards] + [1] * (len(shape) - 1)

    def __repr__(self) -> str:
        return (f"MinSizePartitioner(min_shard_bytes={self.min_shard_bytes}, "
                f"max_shards={self.max_shards})")


def partitioner_from_config(settings) -> Partitioner | None:
    """The partitioner of ``strategy.variable_partitioner`` (None: variables stay whole)."""
    if settings is None:
        return None
    if settings.kind == "fixed":
        return FixedShardsPartitioner(settings.num_shards)
    return MinSizePartitioner(settings.min_shard_bytes, settings.max_shards)
