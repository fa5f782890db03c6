"""The plan of a parameter-server job: which ps task owns which shard of which variable.

Built once, when the variables register (:meth:`ShardingPlan.of`), and the index a
checkpoint is written and read by. A partitioner (:mod:`.sharded_variable`) says into
how many shards a variable splits along dim 0; the first ``rows % n`` shards take one row
more (TF's ``ShardedVariable`` rule). Shards are placed over the ps tasks as TF places
variables: each shard counts as one variable in creation order (round-robin), or by size
(``balanced``). A worker keeps the whole variable (or, for an embedding table served by
rows, only the rows it looked up); only the ps tasks hold shards.

    plan = ShardingPlan.of(tensors, num_ps=2, partitioner=FixedShardsPartitioner(2))
    plan.shards_of(0)   # [Shard(id=0, var=0, start=0, stop=5, ps=0), Shard(1, 0, 5, 10, 1)]
"""

from __future__ import annotations

import dataclasses
import math

import torch

from .sharded_variable import Partitioner

__all__ = ["Shard", "ShardingPlan", "placement", "shard_count"]


def placement(sizes: list[int], num_ps: int, mode: str = "round_robin",
              colocate: dict[int, int] | None = None) -> list[int]:
    """The ps task of each variable (here: each shard), in creation order.

    ``round_robin`` is TF's rule: the i-th variable placed on ps i mod n, where a
    colocated one (``colocate`` maps an index to an earlier one whose ps it shares, TF's
    ``colocate_vars_with``) is not counted; ``balanced`` puts each on the ps holding the
    fewest bytes so far (TF users complained of skew).
    """
    if mode not in ("round_robin", "balanced"):
        raise ValueError(f"variable placement must be 'round_robin' or 'balanced', got {mode!r}")
    owners: list[int] = []
    load = [0] * num_ps
    placed = 0  # TF's variable count: the variables placed by the rule, not colocated
    for index, size in enumerate(sizes):
        if colocate and index in colocate:
            owner = owners[colocate[index]]
        elif mode == "round_robin":
            owner, placed = placed % num_ps, placed + 1
        else:
            owner = min(range(num_ps), key=lambda k: (load[k], k))
        owners.append(owner)
        load[owner] += size
    return owners


def shard_count(partitioner: Partitioner, shape: tuple, dtype: torch.dtype) -> int:
    """Into how many shards ``partitioner`` splits a variable, by TF's rules: a scalar is
    never offered; any ``[n, 1, ...]`` with n not 0 is taken (its length unchecked, as
    TF); n = 1 leaves it whole; at most one shard per row."""
    if len(shape) == 0:
        return 1
    parts = partitioner(tuple(shape), dtype)
    if not parts or parts[0] == 0 or any(p != 1 for p in parts[1:]):
        raise ValueError(f"variable_partitioner must return a list/tuple whose elements are "
                         f"1 besides the first element (non-zero), got: {parts!r} "
                         f"({partitioner!r}, for a variable of shape {list(shape)})")
    first = int(parts[0]) if isinstance(parts[0], bool) else parts[0]  # True is 1, as in TF
    if not isinstance(first, int) or first < 0:
        # TF fails later, in the split (range() of 2.5); say so here
        raise ValueError(f"{partitioner!r} returned {list(parts)!r} for a variable of shape "
                         f"{list(shape)}: the first element must be a positive whole number")
    if first == 1:
        return 1
    if shape[0] == 0:  # TF: a ZeroDivisionError in its split
        raise ValueError(f"{partitioner!r} splits a variable of shape {list(shape)} into "
                         f"{first} shards, but it has no rows; return [1, ...] for it")
    return min(first, shape[0])


@dataclasses.dataclass(frozen=True)
class Shard:
    """Rows ``start:stop`` of variable ``var``, held by ``ps`` as shard ``id``."""

    id: int
    var: int
    start: int
    stop: int
    ps: int

    @property
    def rows(self) -> int:
        return self.stop - self.start


def _bounds(rows: int, shards: int) -> list[tuple[int, int]]:
    """TF's split: the first ``rows % shards`` shards take one row more."""
    base, extra = divmod(rows, shards)
    bounds, start = [], 0
    for k in range(shards):
        stop = start + base + (1 if k < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


class ShardingPlan:
    """Every variable's shards (one, unless partitioned) and the ps of each."""

    def __init__(self, shards: list[Shard], shapes: list[tuple[int, ...]]):
        self.shards = shards
        self.shapes = shapes  # each variable's whole shape
        self._of: list[list[Shard]] = [[] for _ in shapes]
        for shard in shards:
            self._of[shard.var].append(shard)
        self._starts = [torch.tensor([s.start for s in group], dtype=torch.int64)
                        for group in self._of]

    @classmethod
    def of(cls, tensors: list[torch.Tensor], num_ps: int, mode: str = "round_robin",
           colocate: dict[int, int] | None = None,
           partitioner: Partitioner | None = None) -> "ShardingPlan":
        """Shard ``tensors`` (variables in creation order) and place the shards.

        Colocated variables (TF's ``colocate_vars_with``) stay whole, on their target's
        (first shard's) ps."""
        colocate = colocate or {}
        pieces: list[tuple[int, int, int]] = []  # (var, start, stop)
        first_piece: dict[int, int] = {}
        piece_colocate: dict[int, int] = {}
        for var, tensor in enumerate(tensors):
            rows = tensor.shape[0] if tensor.dim() else 1
            count = 1 if partitioner is None or var in colocate else \
                shard_count(partitioner, tuple(tensor.shape), tensor.dtype)
            first_piece[var] = len(pieces)
            if var in colocate:
                piece_colocate[len(pieces)] = first_piece[colocate[var]]
            pieces.extend((var, a, b) for a, b in _bounds(rows, count))
        row_bytes = [t.element_size() * math.prod(t.shape[1:]) for t in tensors]
        owners = placement([(b - a) * row_bytes[v] for v, a, b in pieces], num_ps, mode,
                           piece_colocate)
        shards = [Shard(i, v, a, b, owners[i]) for i, (v, a, b) in enumerate(pieces)]
        return cls(shards, [tuple(t.shape) for t in tensors])

    def shards_of(self, var: int) -> list[Shard]:
        return self._of[var]

    def owner(self, var: int) -> int:
        """The ps of a variable's first shard (where a whole variable lives)."""
        return self._of[var][0].ps

    def partitioned(self, var: int) -> bool:
        return len(self._of[var]) > 1

    def split_rows(self, var: int, ids: torch.Tensor) -> list[tuple[Shard, slice]]:
        """``ids`` (sorted row ids of variable ``var``) as (shard, the slice of ``ids``
        that falls in it) for each shard: slices, not index tensors, so that a step's
        ids and rows are cut by views, never gathered."""
        shards = self._of[var]
        if len(shards) == 1:
            return [(shards[0], slice(0, len(ids)))]
        bounds = torch.searchsorted(ids, self._starts[var][1:]).tolist()
        return [(shard, slice(a, b))
                for shard, a, b in zip(shards, [0] + bounds, bounds + [len(ids)])]

    def by_ps(self, num_ps: int) -> list[list[Shard]]:
        """The shards each ps holds, by shard id."""
        held: list[list[Shard]] = [[] for _ in range(num_ps)]
        for shard in self.shards:
            held[shard.ps].append(shard)
        return held
