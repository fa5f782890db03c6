"""An optimizer's sparse update of some rows of a table, applied to those rows alone.

torch's sparse updates add sparse tensors into the table and its state
(``dense.add_(sparse)``: a BLAS axpy per row) and read the state back through
``sparse_mask``; on issue 37's wide-and-deep model that was most of a ps's time. A row
update does the same arithmetic on the gathered rows: ``index_select`` of each of the
table's and its slots' rows, the update, ``index_copy_`` back; a few vectorized ops a
step, nothing table-sized made.

A ps uses it for a param group only when a trial shows it bit for bit equal to torch's
own sparse update of the class with the group's settings, on this machine
(:func:`row_update_exact`); otherwise, and for any other class, the ps hands torch the
sparse gradient as before.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["row_updater", "row_update_exact"]

RowUpdate = Callable[[torch.Tensor, torch.Tensor], None]


def _adagrad(optimizer: torch.optim.Optimizer, group: dict,
             table: torch.Tensor) -> RowUpdate | None:
    """torch's ``_single_tensor_adagrad`` sparse branch on rows ``ids`` (sorted,
    unique) of ``table``; None for settings it does not cover."""
    state = optimizer.state.get(table, {})
    step_t, sums = state.get("step"), state.get("sum")
    if group["weight_decay"] or group.get("differentiable") or group.get("fused") \
            or not isinstance(step_t, torch.Tensor) or not isinstance(sums, torch.Tensor):
        return None

    def update(ids: torch.Tensor, grad: torch.Tensor) -> None:
        with torch.no_grad():
            step_t.add_(1)
            clr = group["lr"] / (1 + (step_t.item() - 1) * group["lr_decay"])
            if group["maximize"]:
                grad = -grad
            rows = sums.index_select(0, ids).add_(grad.pow(2))
            sums.index_copy_(0, ids, rows)
            std = rows.sqrt_().add_(group["eps"])
            table.index_copy_(0, ids, table.index_select(0, ids).add_(grad / std,
                                                                      alpha=-clr))
    return update


def _sgd(optimizer: torch.optim.Optimizer, group: dict,
         table: torch.Tensor) -> RowUpdate | None:
    """torch's SGD without momentum or weight decay on rows ``ids`` of ``table``."""
    if group["momentum"] or group["weight_decay"] or group.get("differentiable") \
            or group.get("fused"):
        return None

    def update(ids: torch.Tensor, grad: torch.Tensor) -> None:
        with torch.no_grad():
            alpha = group["lr"] if group["maximize"] else -group["lr"]
            table.index_copy_(0, ids, table.index_select(0, ids).add_(grad, alpha=alpha))
    return update


_UPDATES = {torch.optim.Adagrad: _adagrad, torch.optim.SGD: _sgd}


def row_updater(optimizer: torch.optim.Optimizer, group: dict,
                table: torch.Tensor) -> RowUpdate | None:
    """``update(ids, grad)``: ``optimizer``'s sparse update of rows ``ids`` (sorted,
    unique) of ``table`` (of ``group``) with the group's settings now; None where the
    class (exactly: a subclass may change its step) or a setting is not covered."""
    make = _UPDATES.get(type(optimizer))
    return make(optimizer, group, table) if make is not None else None


def row_update_exact(cls: type, settings: dict) -> bool:
    """Whether :func:`row_updater`'s update of ``cls`` with a group's ``settings`` gives
    what torch's own sparse update gives, bit for bit (the table and every state
    tensor), over three steps of overlapping rows of a 64 x 37 table (rows of an odd width:
    vectorized and scalar code both), tried here."""
    if cls not in _UPDATES:
        return False
    settings = {k: v for k, v in settings.items() if k not in ("params", "initial_lr")}
    generator = torch.Generator().manual_seed(0)
    steps = [torch.tensor(ids) for ids in ([1, 5, 9, 63], [0, 5, 40], [5, 9, 10, 63])]
    grads = [torch.randn(len(ids), 37, generator=generator) for ids in steps]
    start = torch.randn(64, 37, generator=generator)
    results = []
    for rows in (False, True):
        weight = torch.nn.Parameter(start.clone())
        optimizer = cls([{**settings, "params": [weight]}])
        group = optimizer.param_groups[0]
        for ids, grad in zip(steps, grads):
            if rows:
                update = row_updater(optimizer, group, weight)
                if update is None:
                    return False
                update(ids, grad)
                continue
            try:  # checked: this gradient is made here, its check costs nothing
                with torch.sparse.check_sparse_tensor_invariants(enable=True):
                    weight.grad = torch.sparse_coo_tensor(ids.unsqueeze(0), grad,
                                                          weight.shape, is_coalesced=True)
                    optimizer.step()
            except (RuntimeError, ValueError, TypeError):
                return False
        state = [v for v in optimizer.state[weight].values() if isinstance(v, torch.Tensor)]
        results.append([weight.detach()] + [s.to_dense() if s.is_sparse else s for s in state])
    return len(results[0]) == len(results[1]) and all(
        torch.equal(a, b) for a, b in zip(*results))
