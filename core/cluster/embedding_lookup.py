"""Embedding tables served by rows: a worker reads only the rows its batch looks up.

In a parameter-server job, an ``nn.Embedding`` or ``nn.EmbeddingBag`` whose weight only
that module uses (TF's ``embedding_lookup`` on a ``ShardedVariable``) is not kept on the
worker: its local weight becomes a one-element placeholder of the table's shape, and the
module's forward asks the ps tasks that own the looked-up rows for them (one request per
ps per lookup). The backward gives the placeholder a sparse gradient over those rows,
which travels to the ps tasks as (row ids, rows): a worker's memory and traffic follow
the batch, not the table.

A table used otherwise too (a tied output layer reads it whole), with ``max_norm``
(which renormalizes rows in place), or of a subclass with a forward of its own is served
whole, as any other variable. A replica that reads a served table's ``weight`` (not
through the lookup) is refused, naming it; outside replicas the placeholder reads NaN.

``state_dict()`` of such a module holds the whole table, read from the ps tasks (so
checkpoints, exports and digests see the model's own keys and shapes); its
``load_state_dict()`` writes the rows there.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import torch
import torch.nn.functional as F

from ..distribute import torch_internals
from .transport import ParameterServerError

__all__ = ["SPARSE_OPTIMIZERS", "RowTable", "ServedModel", "find_tables", "serve_by_rows",
           "sparse_update_problem", "table_label", "unservable", "is_lookup", "served_tables"]

# torch optimizers with a sparse update (checked against torch by the tests)
SPARSE_OPTIMIZERS = ("SGD", "Adagrad", "SparseAdam")
_LOOKUP_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)
READ_CHUNK_ROWS = 65536  # rows per request when a whole table is read (state_dict)


@dataclasses.dataclass
class RowTable:
    """A table served by rows: variable ``var`` of the job, read by ``fetch(ids)``
    (sorted unique row ids -> rows) and written by ``assign(ids, rows)``."""

    var: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    sparse: bool  # the module's own sparse=True: the optimizer's sparse update applies
    fetch: Callable[[torch.Tensor], torch.Tensor]
    assign: Callable[[torch.Tensor, torch.Tensor], None]
    weight: Callable[[], torch.Tensor]  # what the backward's sparse gradient goes to
    # rows of several tables (var, sorted unique ids), in one request per ps
    fetch_many: Callable[[list], list] | None = None
    label: str = "a table"  # as messages name it: ``Embedding(10000, 64)``

    def read_all(self) -> torch.Tensor:
        """The whole table, each chunk copied into it as it comes (a chunk may be a view
        of the message it came in, which must not be kept); every row is written, as
        :meth:`read_chunks` checks."""
        table = torch.empty(self.shape, dtype=self.dtype)
        at = 0
        with torch.no_grad():
            for rows in self.read_chunks():
                table[at:at + len(rows)] = rows
                at += len(rows)
        return table

    def read_chunks(self):
        """The table's rows in order, ``READ_CHUNK_ROWS`` at a time (a digest of it
        holds no more than that at once).

        Raises:
          ParameterServerError: a chunk is not the rows asked (their count or width).
        """
        with torch.no_grad():
            for a in range(0, self.shape[0], READ_CHUNK_ROWS):
                b = min(a + READ_CHUNK_ROWS, self.shape[0])
                yield self._checked(a, b, self.fetch(torch.arange(a, b)))

    def _checked(self, a: int, b: int, rows: torch.Tensor) -> torch.Tensor:
        if tuple(rows.shape) != (b - a, *self.shape[1:]):
            raise ParameterServerError(
                f"{self.label} (variable {self.var}): the ps tasks answered rows of shape "
                f"{tuple(rows.shape)} for its rows {a} to {b - 1}, shape "
                f"{(b - a, *self.shape[1:])}; the table cannot be read whole")
        return rows


def sparse_update_problem(cls: type, groups: list[dict]) -> str | None:
    """Why ``cls`` with each of ``groups``' settings cannot apply a sparse gradient (one
    tried on a 4-row variable: torch's own answer), or None."""
    for settings in groups:
        weight = torch.nn.Parameter(torch.ones(4, 2))
        weight.grad = torch.sparse_coo_tensor(torch.tensor([[1, 3]]), torch.ones(2, 2),
                                              (4, 2), check_invariants=False)
        try:
            # the gradient is ours, its ids made above: torch's invariant check (and its
            # warning that the check is off) has nothing to add
            with torch.sparse.check_sparse_tensor_invariants(enable=False):
                cls([{**settings, "params": [weight]}]).step()
        except (RuntimeError, ValueError, TypeError) as exc:
            return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return None


def table_label(module: torch.nn.Module) -> str:
    """``Embedding(10000, 64)``: a table as messages name it."""
    return f"{type(module).__name__}({module.weight.shape[0]}, {module.weight.shape[1]})"


def find_tables(modules) -> tuple[dict[int, torch.nn.Module], list[str]]:
    """Of ``modules``' parameters, the lookup tables to serve by rows (``id(weight)`` ->
    its module), and the names of tables that must be served whole, with why."""
    uses: dict[int, int] = {}
    for module in modules:
        for _, value in module.named_parameters(recurse=False, remove_duplicate=False):
            uses[id(value)] = uses.get(id(value), 0) + 1
    tables, whole = {}, []
    for module in modules:
        if not isinstance(module, _LOOKUP_MODULES) or module.weight is None:
            continue
        weight, label = module.weight, table_label(module)
        why = unservable(module)
        if uses[id(weight)] > 1:
            whole.append(f"{label}: its weight is also another module's (tied)")
        elif why is not None:
            whole.append(f"{label}: {why}")
        else:
            tables[id(weight)] = module
    return tables, whole


def unservable(module: torch.nn.Module) -> str | None:
    """Why ``module`` (an Embedding or EmbeddingBag) cannot be served by rows whatever
    else reads its weight, or None."""
    own = type(module).forward is (torch.nn.EmbeddingBag.forward if isinstance(
        module, torch.nn.EmbeddingBag) else torch.nn.Embedding.forward)
    if not own:
        return f"{type(module).__name__} has a forward of its own"
    if module.max_norm is not None:
        return "max_norm renormalizes looked-up rows in place"
    return None


def is_lookup(module: torch.nn.Module) -> bool:
    """An ``nn.Embedding`` or ``nn.EmbeddingBag`` (a table that may be served by rows)."""
    return isinstance(module, _LOOKUP_MODULES)


class _Rows(torch.autograd.Function):
    """The fetched rows of a table, differentiable into the table as a sparse gradient
    over exactly those rows (what ``F.embedding(..., sparse=True)`` gives)."""

    @staticmethod
    def forward(ctx, weight, ids, rows):
        ctx.ids, ctx.shape = ids, weight.shape
        return rows.clone()

    @staticmethod
    def backward(ctx, grad):
        sparse = torch.sparse_coo_tensor(ctx.ids.unsqueeze(0), grad, ctx.shape,
                                         is_coalesced=True, check_invariants=False)
        return sparse, None, None


def unique_ids(module: torch.nn.Module, table: RowTable, input: torch.Tensor):
    """The sorted unique ids of ``input`` (checked against the table's rows), and
    ``input`` as positions among them."""
    unique, inverse = torch.unique(input, return_inverse=True)
    for row in (unique[:1], unique[-1:]):
        if row.numel() and not 0 <= int(row) < table.shape[0]:
            raise IndexError(f"index out of range in self: {type(module).__name__} has "
                             f"{table.shape[0]} rows, the input holds row {int(row)}")
    return unique, inverse


def looked_up(module: torch.nn.Module, table: RowTable, unique: torch.Tensor,
              fetched: torch.Tensor):
    """The fetched rows, differentiable into the table, and padding_idx among them."""
    rows = _Rows.apply(table.weight(), unique, fetched)
    pad = None
    if module.padding_idx is not None:
        hit = (unique == module.padding_idx).nonzero()
        pad = int(hit[0]) if len(hit) else None
    return rows, pad


def _rows_for(module: torch.nn.Module, table: RowTable, input: torch.Tensor):
    """(input remapped to the fetched rows, the rows, padding_idx remapped)."""
    unique, inverse = unique_ids(module, table, input)
    return (inverse, *looked_up(module, table, unique, table.fetch(unique)))


def _embedding_forward(module: torch.nn.Embedding, table: RowTable):
    def forward(input):
        inverse, rows, pad = _rows_for(module, table, input)
        return F.embedding(inverse, rows, pad, None, module.norm_type,
                           module.scale_grad_by_freq, False)
    return forward


def _bag_forward(module: torch.nn.EmbeddingBag, table: RowTable):
    def forward(input, offsets=None, per_sample_weights=None):
        return bag(module, *_rows_for(module, table, input), offsets, per_sample_weights)
    return forward


def bag(module: torch.nn.EmbeddingBag, inverse, rows, pad, offsets, per_sample_weights):
    """``module``'s bags of the looked-up ``rows`` (``inverse``: the input's positions)."""
    return F.embedding_bag(inverse, rows, offsets, None, module.norm_type,
                           module.scale_grad_by_freq, module.mode, False,
                           per_sample_weights, module.include_last_offset, pad)


_UNREAD = threading.local()  # .active: state_dict() leaves the served tables out
_UNREAD.active = False


def served_tables(model: torch.nn.Module) -> dict[str, RowTable]:
    """The tables of ``model`` served by rows, by ``state_dict`` key."""
    return {f"{name}.weight" if name else "weight": module.csrun_row_table
            for name, module in model.named_modules()
            if isinstance(getattr(module, "csrun_row_table", None), RowTable)}


class ServedModel:
    """A model's checkpoint entry in a parameter-server job whose checkpoints are by
    shard: its ``state_dict()`` without the tables served by rows (the ps tasks write
    those), and a ``load_state_dict()`` that expects them missing."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict:
        _UNREAD.active = True
        try:
            return self.model.state_dict()
        finally:
            _UNREAD.active = False

    def load_state_dict(self, state: dict) -> None:
        # the tables that would be served by rows (they may not be yet: a run registers
        # its variables when it first runs); the ps tasks restore them
        served = {f"{name}.weight" if name else "weight"
                  for name, module in self.model.named_modules()
                  if isinstance(module, _LOOKUP_MODULES)}
        missing, unexpected = self.model.load_state_dict(state, strict=False)
        missing = [key for key in missing if key not in served]
        if missing or unexpected:
            raise RuntimeError(f"Error(s) in loading state_dict for "
                               f"{type(self.model).__name__}: missing keys {missing}, "
                               f"unexpected keys {unexpected}")


def _placeholder(tensor: torch.Tensor) -> torch.Tensor:
    """One element standing for the whole table: its shape, none of its memory; NaN, so
    that a read of it outside a replica (where nothing can refuse it) shows."""
    fill = float("nan") if tensor.is_floating_point() else 0
    return torch.full((1,), fill, dtype=tensor.dtype, device=tensor.device).as_strided(
        tensor.shape, [0] * tensor.dim())


def serve_by_rows(module: torch.nn.Module, table: RowTable) -> None:
    """Make ``module`` read ``table`` by rows from now on; free its local weight."""
    with torch.no_grad():
        module.weight.data = _placeholder(module.weight)
    module.csrun_row_table = table
    is_bag = isinstance(module, torch.nn.EmbeddingBag)
    module.forward = _bag_forward(module, table) if is_bag else \
        _embedding_forward(module, table)
    loaded: list[str] = []
    lock = threading.Lock()

    def save(mod, state, prefix, local_metadata):
        if prefix + "weight" in state:
            if _UNREAD.active:  # a checkpoint by shard: the ps tasks write the table
                del state[prefix + "weight"]
            else:
                state[prefix + "weight"] = table.read_all()

    def load_pre(mod, state, prefix, *args):
        value = state.pop(prefix + "weight", None)
        if value is not None:
            if tuple(value.shape) != table.shape:
                raise RuntimeError(f"size mismatch for {prefix}weight: copying a param "
                                   f"with shape {tuple(value.shape)}, the table is "
                                   f"{table.shape}")
            table.assign(torch.arange(table.shape[0]), value.to(mod.weight.dtype))
            with lock:
                loaded.append(prefix + "weight")

    def load_post(mod, incompatible):
        with lock:
            for key in loaded:
                if key in incompatible.missing_keys:
                    incompatible.missing_keys.remove(key)
            loaded.clear()

    torch_internals.register_state_dict_hooks(module, save, load_pre)
    module.register_load_state_dict_post_hook(load_post)
