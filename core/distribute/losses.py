"""Loss scaling across replicas: TF's ``tf.nn.compute_average_loss``.

Each replica sees a slice of the global batch; replica gradients are *summed* onto the
parameter device. A replica's loss must therefore be its examples' share of the global
mean: ``sum(per_example_loss) / global_batch_size``. The usual ``F.cross_entropy(out, y)``
(a mean over the replica's slice) gives R times the gradient of a plain loop instead.
"""

from __future__ import annotations

import numbers
from typing import Any

import torch

from .context import current_entry
from .reduce import ReduceOp, as_tensor
from .strategy import get_replica_context

__all__ = ["compute_average_loss"]


def compute_average_loss(per_example_loss: Any, sample_weight: Any = None,
                         global_batch_size: Any = None) -> torch.Tensor:
    """Scale per-example losses by ``sample_weight`` and average them over the global batch.

    Args:
      per_example_loss: losses of this replica's examples, shape ``[B, ...]`` (e.g.
        ``F.cross_entropy(out, y, reduction="none")``).
      sample_weight: optional weights: a scalar, ``[B]`` (or ``[B, 1]``), or any shape
        that broadcasts to the losses' (TF's alignment: on the batch dimension).
      global_batch_size: the number of examples of the global batch. Default: the real
        size of the current global batch, every replica's ``B`` summed, so a short last
        batch is scaled right (TF guesses ``B * num_replicas_in_sync``, which is wrong
        there). Across workers (ParameterServerStrategy) the other workers' slices are
        taken to be as large as this worker's, as TF does.

    Returns:
      A scalar: ``sum(per_example_loss * sample_weight) / global_batch_size`` (0 for an
      empty global batch, or a ``global_batch_size`` of 0), in the losses' dtype (float64
      for integer losses), as TF's.

    Raises:
      ValueError: a scalar ``per_example_loss`` (give one loss per example), weights
        that do not fit the losses, a ``global_batch_size`` that is not a scalar (a
        shape-[1] tensor) or is negative.
      TypeError: a ``global_batch_size`` that is not an integer (``2.5``, ``4.0``,
        ``True``, a float tensor), as TF's.
      RuntimeError: called without ``global_batch_size`` in cross-replica context.
    """
    loss = as_tensor(per_example_loss)
    if loss.dim() == 0:
        raise ValueError("per_example_loss must have at least one dimension (one loss per "
                         "example); pass reduction='none' to the loss function")
    # TF's dtype: the losses' own (weighted losses are cast back to it), float64 for
    # integer losses (TF's division of integers); csrun casts integer losses before
    # weighing them, where TF truncates the weighted values back to integers
    dtype = loss.dtype if loss.is_floating_point() or loss.is_complex() else torch.float64
    loss = loss.to(dtype)
    if sample_weight is not None:
        weight = as_tensor(sample_weight).to(loss.device)
        loss = (loss * _broadcast_weight(weight, loss)).to(dtype)
    total = loss.sum()
    if global_batch_size is None:
        global_batch_size = _current_global_batch_size(loss.shape[0])
    else:
        global_batch_size = _checked_size(global_batch_size)
    if global_batch_size == 0:
        return total * 0  # TF's div_no_nan; keeps the graph for backward
    return total / global_batch_size


def _broadcast_weight(weight: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
    # TF's squeeze_or_expand_dimensions: a weight of one more dimension loses its last
    # ([B, 1] weighs [B], not [B, B]); one of fewer gains trailing ones, aligning on the
    # batch dimension ([B] weighs [B, T] row by row; csrun also for [B] and [B, T, U])
    if weight.dim() == loss.dim() + 1 and weight.shape[-1] == 1:
        weight = weight.squeeze(-1)
    while 0 < weight.dim() < loss.dim():
        weight = weight.unsqueeze(-1)
    try:
        fits = torch.broadcast_shapes(weight.shape, loss.shape) == loss.shape
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"sample_weight of shape {tuple(weight.shape)} does not fit "
                         f"per_example_loss of shape {tuple(loss.shape)}: give a scalar, "
                         "one weight per example ([B] or [B, 1]), or the losses' shape")
    return weight


def _checked_size(size: Any) -> int:
    """TF 2.21's checks of ``global_batch_size``, in its order: a scalar, an integer,
    not negative (0 gives 0, TF's ``div_no_nan``)."""
    tensor = size if isinstance(size, torch.Tensor) else None
    if tensor is None and isinstance(size, (list, tuple)):
        tensor = torch.as_tensor(size)
    if tensor is not None and tensor.dim() != 0:
        raise ValueError(f"global_batch_size must be scalar, got shape {tuple(tensor.shape)}")
    if tensor is not None:
        integer = not (tensor.dtype.is_floating_point or tensor.dtype.is_complex
                       or tensor.dtype == torch.bool)
        value = tensor.item()
    else:
        value = size
        integer = isinstance(size, numbers.Integral) and not isinstance(size, bool)
    if not integer:
        raise TypeError(f"global_batch_size must be an integer, got {size!r:.80}")
    if value < 0:
        raise ValueError(f"global_batch_size must be non-negative, got {value}")
    return int(value)


def _current_global_batch_size(local: int) -> int:
    """Every replica's batch size summed: one all-reduce among this worker's replicas."""
    entry = current_entry()
    if entry.strategy is not None and entry.replica is None:
        raise RuntimeError("compute_average_loss without global_batch_size must be called in "
                           "replica context (inside strategy.run), where the batch is split; "
                           "in cross-replica context pass global_batch_size")
    replica = get_replica_context()
    count = replica.all_reduce(ReduceOp.SUM, torch.tensor(local, dtype=torch.int64))
    workers = replica.num_replicas_in_sync // replica.strategy.extended.num_local_replicas
    return int(count) * max(workers, 1)
