"""ReduceOp and the arithmetic of cross-replica reductions and gathers.

These functions take one value per replica (in replica order) and return one result on a
chosen device. The strategy decides which values and which device; this module only does
the arithmetic, with TF's rules:

* ``axis=None`` combines replicas elementwise; shapes must match; MEAN divides by the
  number of replicas.
* ``axis=k`` also sums along ``k`` inside each replica; MEAN divides by the true number of
  elements along ``k`` over all replicas (so partial batches weigh right). Only the size
  along ``k`` may differ between replicas: TF adds the partial sums without broadcasting.
* MEAN of integers gives float64, as TF does; SUM keeps the input's dtype on every axis
  (int32 stays int32, uint8 wraps as TF's does).
* Booleans are refused, as TF refuses them: adding them would be a logical OR, so SUM and
  MEAN would be wrong without a word.
"""

from __future__ import annotations

import enum
import numbers
from typing import Any, Sequence

import numpy as np
import torch

from . import torch_internals

__all__ = ["ReduceOp", "SPELLINGS", "reduce_values", "reduce_on_cpu", "gather_values",
           "as_tensor", "current_device", "destination"]

_CPU = torch.device("cpu")
_BOOL = torch.bool
_Tensor = torch.Tensor
_function_mode_depth = torch_internals.function_mode_depth  # bound: asked on every reduce


def current_device() -> torch.device:
    """TF's "current device": torch's default device (the CPU unless one was set).

    Reading it costs ~10 µs; this skips it in the common case. A default device, set by
    ``torch.set_default_device`` or ``with torch.device(...)``, is always a torch
    function mode, so an empty mode stack means none is set
    (:func:`~.torch_internals.default_device` says why not ``torch.get_default_device``).
    """
    if _function_mode_depth() == 0:
        return _CPU
    return torch_internals.default_device()


def destination(values: Sequence[Any], device: torch.device) -> torch.device:
    """Where ``strategy.reduce``/``gather`` put their result: ``device`` (the current
    device), except that with the CPU there, values on an accelerator stay on one (the
    first replica's in replica order that is on one). Copying a GPU loss to the host
    would wait for the GPU on every step, which a plain loop's ``loss.detach()`` does not
    (a deviation from TF, which copies to CPU:0: docs/tf-parity.md)."""
    if device is not _CPU and device.type != "cpu":
        return device
    for value in values:
        if type(value) is torch.Tensor and not value.is_cpu:
            return value.device
    return device


def _to(tensor: torch.Tensor, device: torch.device | None) -> torch.Tensor:
    # `device.type` costs ~2 µs: the usual CPU destination is recognised by identity
    if device is None or ((device is _CPU or device.type == "cpu") and tensor.is_cpu):
        return tensor
    return tensor.to(device)


class ReduceOp(enum.Enum):
    """How values are combined across replicas: ``SUM`` or ``MEAN``.

    Strings are accepted anywhere a ReduceOp is, case-insensitively (``"sum"``, ``"Mean"``).
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def from_string(cls, name: str) -> "ReduceOp":
        """``ReduceOp.from_string("mean") -> ReduceOp.MEAN``."""
        return cls.resolve(name)

    @classmethod
    def resolve(cls, op: Any) -> "ReduceOp":
        """Turn a ReduceOp or its name into a ReduceOp, with a clear error otherwise."""
        known = SPELLINGS.get(op) if isinstance(op, (str, ReduceOp)) else None
        if known is not None:  # one lookup: called on every reduce and all_reduce
            return known
        if isinstance(op, str):
            try:
                return cls[op.upper()]
            except KeyError:
                raise ValueError(f"{op.upper()!r} is not a valid ReduceOp; use SUM or MEAN") \
                    from None
        raise TypeError(f"reduce_op must be a ReduceOp or 'SUM'/'MEAN', got {type(op).__name__} "
                        f"{op!r}")


# each op by itself and by its names: resolve's one lookup (reduce's inline, for a str)
SPELLINGS = {name: op for op in ReduceOp for name in (op, op.value, op.value.lower())}


def as_tensor(value: Any) -> torch.Tensor:
    """A tensor view of a tensor, numpy array or Python/numpy number."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (np.ndarray, np.generic, numbers.Number)):
        return torch.as_tensor(value)
    raise TypeError(f"cannot reduce a {type(value).__name__}: expected tensors, numpy arrays "
                    "or numbers")


def _mean_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if (dtype.is_floating_point or dtype.is_complex) else torch.float64


def _check_axis(tensor: torch.Tensor, axis: int, replica: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, int):
        raise TypeError(f"axis must be None or an int, got {type(axis).__name__} {axis!r}")
    rank = tensor.dim()
    if not -rank <= axis < rank:
        raise ValueError(
            f"invalid reduction axis {axis} for the value of replica {replica}, which has "
            f"{rank} dimension(s) (shape {tuple(tensor.shape)})"
        )
    return axis % rank


def _refuse_booleans(tensors: Sequence[torch.Tensor]) -> None:
    if any([t.dtype is torch.bool for t in tensors]):
        raise TypeError("cannot reduce booleans across replicas (TF refuses them too): a sum "
                        "of booleans would be a logical OR; cast first, e.g. x.int() to "
                        "count or x.float() for a fraction")


def _sum_along(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    # torch promotes integer sums to int64; TF keeps the dtype (and so does axis=None here)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        return tensor.sum(dim=dim)
    return tensor.sum(dim=dim, dtype=tensor.dtype)


def _sum_in_order(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    total = tensors[0]
    for t in tensors[1:]:
        total = total + t
    return total


def _sum_elementwise(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The replicas' tensors added in replica order, checked as it goes (every step
    reduces its loss here: one pass, the checks' messages only when one fails)."""
    total = tensors[0]
    shape = total.shape
    good = total.dtype is not _BOOL
    for t in tensors[1:]:
        if not good or t.shape != shape or t.dtype is _BOOL:
            good = False
            break
        total = total + t
    if good:
        return total
    _refuse_booleans(tensors)
    listed = ", ".join(f"replica {i}: {tuple(t.shape)}" for i, t in enumerate(tensors))
    raise ValueError(
        f"cannot reduce across replicas with axis=None: the shapes differ ({listed}); "
        "pass axis=0 to reduce along the batch dimension as well")


def reduce_on_cpu(op: ReduceOp, values: Sequence[Any]) -> torch.Tensor | None:
    """``reduce_values(op, values, None, current_device())`` for the usual step's loss
    reduced onto the CPU, no default device set: plain CPU tensors of one shape, none
    boolean, added in replica order (the same adds). One pass of checks, no per-value
    conversions: an empty step's reduce was mostly those. None for anything else, which
    :func:`reduce_values` handles (with its messages)."""
    total = values[0]
    if _function_mode_depth() or type(total) is not _Tensor or not total.is_cpu \
            or total.dtype is _BOOL:  # (a default device is a function mode: see above)
        return None
    shape = total.shape
    for t in values[1:]:  # each checked, then added: an add has no side effect to undo
        if type(t) is not _Tensor or not t.is_cpu or t.dtype is _BOOL or t.shape != shape:
            return None
        total = total + t
    if op is ReduceOp.MEAN:
        return total.to(_mean_dtype(total.dtype)) / len(values)
    return total


def reduce_values(op: ReduceOp, values: Sequence[Any], axis: int | None,
                  device: torch.device | None) -> torch.Tensor:
    """Reduce one value per replica into a tensor on ``device`` (None: leave in place)."""
    # inlined for the usual case, CPU tensors reduced onto the CPU (a step's hot path)
    tensors = [v if device is _CPU and type(v) is torch.Tensor and v.is_cpu
               else _to(as_tensor(v), device) for v in values]
    if axis is None:
        total = _sum_elementwise(tensors)
        if op is ReduceOp.MEAN:
            return total.to(_mean_dtype(total.dtype)) / len(tensors)
        return total
    _refuse_booleans(tensors)
    dims = [_check_axis(t, axis, i) for i, t in enumerate(tensors)]
    partial = [_sum_along(t, d) for t, d in zip(tensors, dims)]
    shape = partial[0].shape
    if not all([p.shape == shape for p in partial[1:]]):  # TF's AddN: no broadcasting
        listed = ", ".join(f"replica {i}: {tuple(t.shape)}" for i, t in enumerate(tensors))
        raise ValueError(
            f"cannot reduce across replicas with axis={axis}: once summed along it, the "
            f"replicas' values differ in shape ({listed}); only the size along axis "
            f"{axis} may differ")
    total = _sum_in_order(partial)
    if op is ReduceOp.MEAN:
        count = sum(t.shape[d] for t, d in zip(tensors, dims))
        return total.to(_mean_dtype(total.dtype)) / count
    return total


def gather_values(values: Sequence[Any], axis: int, device: torch.device | None) -> torch.Tensor:
    """Concatenate one value per replica along ``axis`` (sizes along it may differ)."""
    tensors = [as_tensor(v) for v in values]
    for i, t in enumerate(tensors):
        if t.dim() == 0:
            raise ValueError(
                f"cannot gather scalars (replica {i} holds a 0-d value); gather concatenates "
                "along an axis, so give each replica at least one dimension"
            )
        _check_axis(t, axis, i)
    return torch.cat([_to(t, device) for t in tensors], dim=axis)
