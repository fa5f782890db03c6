"""A table's initializer: the steps that give an embedding table its first values, run
where the table lives, shard by shard (TF's callable ``initial_value`` that a
``ShardedVariable`` calls once per shard with its ``shard_info``).

A worker records the steps of a table's initialization instead of running them
(:mod:`.deferred_table`): ``normal_`` and ``uniform_`` with the generator's state when they
were called, fills (of the whole table or of rows: ``padding_idx``), and scalar
arithmetic. Each ps runs them over its own rows, in chunks, and ends with exactly the
values ``torch.manual_seed(s); Net()`` gives those rows:

* ``uniform_`` draws one number per element in memory order, so any run of elements is
  drawn by starting the generator where those elements start;
* ``normal_`` on CPU draws one uniform per element, then turns them into normals 16 at a
  time (Box-Muller), and when the count is not a multiple of 16 it draws 16 more and
  redoes the last 16 elements. Chunks that start at multiples of 16 from the table's
  first element, the last one holding at least 16 elements, draw exactly the same.

The ps draws its rows' chunks after skipping those before them (draws it discards), so
its time grows with the table, never its memory beyond a chunk; a worker advances its
generator the same way, so layers built after the table draw what they would have.
Whether chunks draw what the whole would is checked on the spot, once per kind of step
and dtype, against torch itself (:func:`chunking_holds`): a torch that draws otherwise
makes the table be built whole instead, never differently.
"""

from __future__ import annotations

import base64
import functools
import math

import torch

__all__ = ["TableInitializer", "chunk_bounds", "chunking_holds", "draw_rows", "CHUNK",
           "RANDOM_STEPS", "SCALAR_STEPS"]

CHUNK = 1 << 20  # elements drawn at a time (a multiple of 16): 4 MiB of float32
_BLOCK = 16      # normal_'s block on CPU (its tail is redrawn when the count is not a multiple)
RANDOM_STEPS = ("normal", "uniform")
SCALAR_STEPS = ("mul", "div", "add", "sub")


def chunk_bounds(numel: int, chunk: int = CHUNK) -> list[tuple[int, int]]:
    """The element ranges a table of ``numel`` elements is drawn in: every ``chunk``
    elements, the last range at least 16 long (it takes the short rest)."""
    starts = list(range(0, numel, chunk))
    if len(starts) > 1 and numel - starts[-1] < _BLOCK:
        starts.pop()
    return list(zip(starts, starts[1:] + [numel]))


def _draw(piece: torch.Tensor, step: dict, generator: torch.Generator) -> None:
    if step["op"] == "normal":
        piece.normal_(step["mean"], step["std"], generator=generator)
    else:
        piece.uniform_(step["low"], step["high"], generator=generator)


def draw_rows(step: dict, numel: int, dtype: torch.dtype, pieces: list, generator,
              chunk: int = CHUNK) -> None:
    """Run the random ``step`` over a table of ``numel`` elements drawn in chunks, writing
    only ``pieces`` (``(first element, flat view)``); draws stop after the last piece
    (none: every draw is made, as a worker advancing its generator needs)."""
    end = max((first + view.numel() for first, view in pieces), default=numel)
    buffer = None
    for a, b in chunk_bounds(numel, chunk):
        if a >= end:
            break
        if buffer is None:
            buffer = torch.empty(min(numel, chunk + _BLOCK), dtype=dtype)
        drawn = buffer[:b - a]
        _draw(drawn, step, generator)
        for first, view in pieces:
            lo, hi = max(a, first), min(b, first + view.numel())
            if lo < hi:
                view[lo - first:hi - first] = drawn[lo - a:hi - a]


def _generator(state: str) -> torch.Generator:
    generator = torch.Generator()
    generator.set_state(torch.frombuffer(bytearray(base64.b64decode(state)),
                                         dtype=torch.uint8))
    return generator


def encode_state(generator: torch.Generator) -> str:
    return base64.b64encode(bytes(generator.get_state().numpy())).decode()


def _apply(step: dict, rows: torch.Tensor, first_row: int) -> None:
    """A step that draws nothing, on ``rows`` (a table's, from row ``first_row``)."""
    op = step["op"]
    if op == "fill":
        span = step.get("rows")
        if span is None:
            rows.fill_(step["value"])
            return
        lo, hi = max(span[0], first_row), min(span[1], first_row + len(rows))
        if lo < hi:
            rows[lo - first_row:hi - first_row] = step["value"]
    elif op in SCALAR_STEPS:
        getattr(rows, f"{op}_")(step["value"])
    elif op == "clamp":
        rows.clamp_(step["min"], step["max"])
    else:
        raise ValueError(f"a table initializer has an unknown step {op!r}")


class TableInitializer:
    """What makes a table's first values: ``given`` values (the user's own: ``_weight=``,
    a ``copy_``), then ``steps``; or steps alone, which a ps runs by shard."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype,
                 given: torch.Tensor | None = None):
        self.shape, self.dtype, self.given = tuple(shape), dtype, given
        self.steps: list[dict] = []

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    def record(self, step: dict, whole: bool, generator: torch.Generator | None = None):
        """Add ``step`` (a random one reads ``generator``'s state and advances it as the
        step would have). ``whole``: it writes every element, so what came before it
        no longer matters."""
        if whole:
            self.given, self.steps = None, []
        if generator is not None:
            step = {**step, "state": encode_state(generator)}
            draw_rows(step, self.numel, self.dtype, [], generator)
        self.steps.append(step)

    def whole(self) -> torch.Tensor:
        """The table's values, whole, exactly as the steps would have left them (random
        steps draw from their own generators, at the recorded states)."""
        table = self.given if self.given is not None else torch.empty(self.shape,
                                                                      dtype=self.dtype)
        with torch.no_grad():
            for step in self.steps:
                if step["op"] in RANDOM_STEPS:
                    _draw(table, step, _generator(step["state"]))
                else:
                    _apply(step, table, 0)
        return table

    def fill(self, pieces: list[tuple[int, torch.Tensor]], chunk: int = CHUNK) -> None:
        """Give each piece (``(first row, rows)``: a ps's shards of this table) its
        values, step by step; each random step draws only as far as the last piece."""
        flat = [(first * self.row_numel, piece.view(-1)) for first, piece in pieces]
        for step in self.steps:
            if step["op"] in RANDOM_STEPS:
                draw_rows(step, self.numel, self.dtype, flat, _generator(step["state"]),
                          chunk)
            else:
                for first, piece in pieces:
                    _apply(step, piece, first)

    def to_json(self) -> dict:
        if self.given is not None:
            raise ValueError("a table with given values is sent as values")
        return {"shape": list(self.shape), "dtype": str(self.dtype).replace("torch.", ""),
                "steps": self.steps}

    @classmethod
    def from_json(cls, data: dict) -> "TableInitializer":
        dtype = getattr(torch, str(data["dtype"]), None)
        if not isinstance(dtype, torch.dtype) or not isinstance(data.get("steps"), list):
            raise ValueError(f"a table initializer names no dtype or steps: {data!r:.200}")
        made = cls(tuple(int(n) for n in data["shape"]), dtype)
        made.steps = data["steps"]
        return made


@functools.lru_cache(maxsize=None)
def chunking_holds(op: str, dtype: torch.dtype) -> bool:
    """Whether this torch draws ``op`` (``normal`` or ``uniform``) in ``dtype`` chunk by
    chunk exactly as over the whole: values and the generator's state after, for counts
    with and without a short rest, and for pieces alone (what a ps draws). Tried with
    small chunks: the rule is the same at any size (tests try it at full size)."""
    step = {"op": op, "mean": 0.25, "std": 1.5, "low": -0.75, "high": 0.5}
    for numel in (7, 16, 105, 120, 161):
        whole, chunked = torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)
        expected = torch.empty(numel, dtype=dtype)
        _draw(expected, step, whole)
        got = torch.empty(numel, dtype=dtype)
        draw_rows(step, numel, dtype, [(0, got)], chunked, chunk=32)
        advanced = torch.Generator().manual_seed(11)  # a worker's: draws made, none kept
        draw_rows(step, numel, dtype, [], advanced, chunk=32)
        piece = torch.empty(numel // 3, dtype=dtype)
        draw_rows(step, numel, dtype, [(numel // 2, piece)], torch.Generator().manual_seed(11),
                  chunk=32)
        state = whole.get_state()
        if not (torch.equal(expected, got) and torch.equal(state, chunked.get_state())
                and torch.equal(state, advanced.get_state()) and torch.equal(piece, expected[numel // 2:numel // 2 + numel // 3])):
            return False
    return True
