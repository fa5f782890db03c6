"""Scatter a call's inputs over the replicas; gather their outputs on one device.

torch's ``nn.parallel.scatter_gather`` for csrun's engine, as :class:`DataParallel` uses
it. **Scatter** splits every tensor of the arguments (inside tuples, lists, namedtuples
and dicts) along ``dim``, evenly: with a batch of 5 on 2 replicas they get 3 and 2
(torch's ``chunk`` would give 4 on 3 replicas only 2 chunks; here every replica gets a
part, one of them perhaps empty), or by the replicas' measured speed when the strategy
balances its batches (:mod:`.batch_split`). Each part goes to its replica's device,
wherever the input was. Anything else is passed to every replica as it is.

**Gather** concatenates each output tensor of the replicas along ``dim`` on the output
device, through tuples, lists, dicts and dataclasses (Hugging Face's ``ModelOutput``
included). A 0-dim tensor becomes a vector of the replicas' values, as torch does, except
a floating one named ``loss`` (a dict key or a dataclass field): a loss a model computed
per replica, combined into the whole batch's mean by weighting each replica's with its
share of the examples (exact when each replica's loss is the mean over its examples).

The gathered tensors come from one autograd function, :class:`_Gather`, whose inputs are
not the replicas' graphs: its backward splits the incoming gradients and hands each
replica its part, to be backpropagated as a run of the strategy of its own (the replicas'
backwards run concurrently, synchronized BatchNorm meets there, and the run's end sums
the gradients into the central ``.grad`` in replica order).
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import numbers
import warnings
from collections.abc import AsyncIterator, Awaitable, Iterator, Mapping
from typing import Any, Callable, Sequence

import torch

from . import torch_internals

__all__ = ["split_sizes", "scatter", "gather", "to_device"]

# The input that makes the gathered tensors part of the caller's graph (they need one
# that requires grad); its gradient is always None, so nothing accumulates in it.
_ANCHOR = torch.empty(0, requires_grad=True)


def split_sizes(size: int, count: int) -> list[int]:
    """``size`` examples over ``count`` replicas, the first ``size % count`` one more."""
    base, extra = divmod(size, count)
    return [base + 1 if r < extra else base for r in range(count)]


# A keyword argument that is the whole batch's count, not per example: Hugging Face's
# models divide their summed loss by it (gradient accumulation across batches and
# devices). Every replica gets it whole; the gathered loss is then the replicas' sum.
WHOLE_BATCH_KWARGS = ("num_items_in_batch",)


def scatter(args: tuple, kwargs: dict, devices: list[torch.device], dim: int,
            sizes: Callable[[int], Sequence[int]] | None = None
            ) -> tuple[list, list, list[int]]:
    """Each replica's args and kwargs, and how many examples each got (the split of the
    first tensor found, args before kwargs). Every part is on its replica's device;
    ``num_items_in_batch`` goes to every replica whole.

    ``sizes(n)``: each replica's part of ``n`` along ``dim`` (default
    :func:`split_sizes`; a strategy's balancer splits by replica speed).

    Raises:
      ValueError: no tensor to split, an empty batch, a tensor without ``dim``, or
        tensors whose sizes along ``dim`` differ (naming them).
    """
    rule = sizes if sizes is not None else (lambda n: split_sizes(n, len(devices)))
    split = _Split(devices, dim, rule)
    whole = {k: v for k, v in kwargs.items() if k in WHOLE_BATCH_KWARGS and v is not None}
    replica_args = split(tuple(args), "args")
    replica_kwargs = split({k: v for k, v in kwargs.items() if k not in whole}, "kwargs")
    if not split.counts:
        raise ValueError("DataParallel splits the tensors of its inputs along dim, but this "
                         "call has none; call .module(...) directly for work without a batch")
    for name, value in whole.items():
        for r, device in enumerate(devices):
            replica_kwargs[r][name] = to_device(value, device)
    return replica_args, replica_kwargs, split.counts


def whole_batch_loss(kwargs: dict) -> bool:
    """Whether a call's model divides its loss by the whole batch's count
    (``num_items_in_batch=``): each replica's loss is then a part of the batch's, and
    the parts add up (:func:`gather`'s ``loss_sum``)."""
    return any(kwargs.get(name) is not None for name in WHOLE_BATCH_KWARGS)


def to_device(value: Any, device: torch.device) -> Any:
    """``value`` with every tensor (through tuples, lists and dicts) moved to ``device``,
    unsplit: one replica's call."""
    if isinstance(value, torch.Tensor):
        return _moved(value, device)
    if isinstance(value, Mapping):
        return _rebuild_mapping(value, {k: to_device(v, device) for k, v in value.items()})
    if isinstance(value, (tuple, list)):
        return _rebuild_sequence(value, [to_device(v, device) for v in value])
    return value


def _moved(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: without waiting when it goes to a GPU (the GPU's stream
    orders the copy before its use); to the host with a copy the host waits for, since a
    CPU replica reads it at once (a non-blocking copy there could be read unfinished)."""
    return tensor.to(device, non_blocking=device.type == "cuda")


class _Split:
    """Splits every tensor of a call's inputs along ``dim`` into the same parts: the
    first one found sets them (``counts``, by ``rule``), any other batch size is refused."""

    def __init__(self, devices: list, dim: int, rule: Callable[[int], Sequence[int]]):
        self.devices, self.dim, self._rule = devices, dim, rule
        self.counts: list[int] = []
        self._first = ""  # where the first tensor was, for the error

    def __call__(self, value: Any, path: str) -> list:
        count = len(self.devices)
        if isinstance(value, torch.Tensor):
            return self._split(value, path)
        if isinstance(value, Mapping):
            columns = {k: self(v, f"{path}[{k!r}]") for k, v in value.items()}
            return [_rebuild_mapping(value, {k: c[r] for k, c in columns.items()})
                    for r in range(count)]
        if isinstance(value, (tuple, list)):
            columns = [self(v, f"{path}[{i}]") for i, v in enumerate(value)]
            return [_rebuild_sequence(value, [c[r] for c in columns]) for r in range(count)]
        return [value] * count

    def _split(self, tensor: torch.Tensor, path: str) -> list:
        dim = self.dim
        if tensor.dim() <= dim:
            raise ValueError(f"DataParallel splits inputs along dim={dim}, but {path} is a "
                             f"tensor of shape {tuple(tensor.shape)}; pass per-batch tensors "
                             "(a value the same for every example can go as a Python number)")
        size = tensor.shape[dim]
        if size == 0:
            raise ValueError(f"DataParallel got an empty batch ({path}: a tensor of shape "
                             f"{tuple(tensor.shape)}, 0 along dim={dim})")
        if not self.counts:
            self.counts.extend(self._rule(size))
            self._first = path
        elif size != sum(self.counts):
            raise ValueError(
                f"DataParallel splits every input tensor along dim={dim} into the same "
                f"parts, but the inputs' batch sizes differ: {self._first} has "
                f"{sum(self.counts)} along dim {dim}, {path} has {size}; pass tensors of "
                "one batch (a value the same for every example can go as a Python number)")
        return [_moved(part, device)
                for part, device in zip(tensor.split(self.counts, dim), self.devices)]


def _rebuild_mapping(like: Mapping, items: dict) -> Mapping:
    return items if type(like) is dict else type(like)(items)


def _rebuild_sequence(like: tuple | list, items: list) -> tuple | list:
    if isinstance(like, tuple) and hasattr(like, "_fields"):  # a namedtuple
        return type(like)(*items)
    return type(like)(items)


# -- gather -------------------------------------------------------------------------------
@dataclasses.dataclass
class _Position:
    """One gathered tensor: the replicas' tensors and how they combine."""

    tensors: list
    how: str  # "cat" along dim, "loss" (weighted mean), "stack" (0-dim values)

    @property
    def differentiable(self) -> bool:
        return any(t.requires_grad for t in self.tensors) and \
            (self.tensors[0].is_floating_point() or self.tensors[0].is_complex())


class _Plan:
    """The gathered tensors of one call and, for the backward, where they came from."""

    def __init__(self, counts: list[int], device: torch.device, dim: int,
                 run_backward: Callable[[list], None], loss_sum: bool = False):
        self.counts = counts
        self.device = device
        self.dim = dim
        self.run_backward = run_backward  # (each replica's (tensors, grads)) -> None
        self.positions: list[_Position] = []
        total = sum(counts)
        # a replica's loss weighs its share of the examples (the mean of its examples'
        # losses), or 1 (a part of the whole batch's: its sum over the batch's count)
        self.weights = [float(n > 0) if loss_sum else n / total for n in counts]

    def add(self, tensors: list, name: Any) -> int:
        if tensors[0].dim() > 0:
            how = "cat"
        elif name == "loss" and tensors[0].is_floating_point():
            how = "loss"
        else:
            how = "stack"
        self.positions.append(_Position(tensors, how))
        return len(self.positions) - 1

    def combine(self) -> list[torch.Tensor]:
        return [self._combine(p) for p in self.positions]

    def _combine(self, position: _Position) -> torch.Tensor:
        moved = [t.to(self.device) for t in position.tensors]
        if position.how == "cat":
            return torch.cat(moved, self.dim)
        if position.how == "stack":
            return torch.stack(moved)
        # a replica without examples has a loss of nothing (often nan): weight 0, left out
        parts = [t if w == 1 else t * w for t, w in zip(moved, self.weights) if w > 0]
        return torch.stack(parts).sum(0)

    def backward(self, grads: tuple) -> None:
        count = len(self.counts)
        tensors, pieces = [[] for _ in range(count)], [[] for _ in range(count)]
        for position, grad in zip(self.positions, grads):
            if grad is None or not position.differentiable:
                continue
            for r, piece in enumerate(self._split_grad(position, grad)):
                if position.tensors[r].requires_grad:
                    tensors[r].append(position.tensors[r])
                    pieces[r].append(piece.to(position.tensors[r].device))
        self.positions = []  # the replicas' graphs are freed by their backward
        self.run_backward(list(zip(tensors, pieces)))

    def _split_grad(self, position: _Position, grad: torch.Tensor) -> list:
        if position.how == "cat":
            return grad.split([t.shape[self.dim] for t in position.tensors], self.dim)
        if position.how == "stack":
            return list(grad.unbind(0))
        # every replica backpropagates (synchronized BatchNorm meets in all of them)
        return [grad * w for w in self.weights]


class _Gather(torch.autograd.Function):
    """The gathered tensors; backward: each replica's part, backpropagated on the replica
    executor (see the module docstring)."""

    @staticmethod
    def forward(ctx, plan: _Plan, anchor: torch.Tensor):
        ctx.set_materialize_grads(False)
        ctx.plan = plan
        values = plan.combine()
        ctx.mark_non_differentiable(*[v for v, p in zip(values, plan.positions)
                                      if not p.differentiable])
        return tuple(values)

    @staticmethod
    def backward(ctx, *grads):
        plan, ctx.plan = ctx.plan, None
        if plan is None:
            raise RuntimeError(
                "DataParallel's output was backpropagated a second time; the replicas' "
                "graphs are freed by the first backward (retain_graph=True does not keep "
                "them): run the forward again")
        plan.backward(grads)
        return None, None


def gather(outputs: list, counts: list[int], device: torch.device, dim: int,
           run_backward: Callable[[list], None], loss_sum: bool = False) -> Any:
    """The replicas' ``outputs`` (same structure each) as one, on ``device``.

    ``run_backward(pairs)`` backpropagates ``pairs[r] = (tensors, grads)`` on replica r.
    ``loss_sum``: each replica's ``loss`` is its part of the batch's (summed over its
    examples, divided by the whole batch's count): they are added, not averaged.

    Raises:
      TypeError: an output it cannot gather (a generator or iterator, replicas' outputs
        of different kinds, an object whose plain attributes differ), naming its type.
    """
    plan = _Plan(counts, device, dim, run_backward, loss_sum)
    skeleton = _collect(outputs, plan, None)
    if not plan.positions:
        return skeleton(())
    if any(p.how == "stack" for p in plan.positions):
        warnings.warn("DataParallel was asked to gather 0-dim tensors (other than a "
                      "'loss'); each becomes a vector of the replicas' values, as in "
                      "torch.nn.DataParallel", UserWarning, stacklevel=3)
    if torch.is_grad_enabled() and any(p.differentiable for p in plan.positions):
        values = _Gather.apply(plan, _ANCHOR)
    else:
        values = plan.combine()
    return skeleton(values)


# Values returned once when every replica returned an equal one, else as the list of
# theirs (at the top of an output; inside an object they must agree, see _collect_plain).
_PLAIN = (type(None), bool, numbers.Number, str, bytes, enum.Enum, torch.dtype,
          torch.device)
# How deep objects nest inside objects before gathering gives up (a cycle, say).
_OBJECT_DEPTH = 8


def _collect(outputs: list, plan: _Plan, name: Any, within: str | None = None,
             depth: int = 0) -> Callable[[tuple], Any]:
    """Register the tensors of ``outputs`` (one per replica) with ``plan``; return the
    function that builds the gathered structure from the gathered tensors. ``within``:
    the object attribute being gathered (then plain values must agree)."""
    first = outputs[0]
    _check_same_kind(outputs)
    if isinstance(first, torch.Tensor):
        index = plan.add(outputs, name)
        return lambda values: values[index]
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        fields = [f.name for f in dataclasses.fields(first) if f.init]
        parts = {f: _collect([getattr(o, f) for o in outputs], plan, f, within, depth)
                 for f in fields}
        return lambda values: dataclasses.replace(
            first, **{f: build(values) for f, build in parts.items()})
    if isinstance(first, Mapping):
        parts = {k: _collect([o[k] for o in outputs], plan, k, within, depth) for k in first}
        return lambda values: _rebuild_mapping(
            first, {k: build(values) for k, build in parts.items()})
    if isinstance(first, (tuple, list)):
        parts = [_collect([o[i] for o in outputs], plan, None, within, depth)
                 for i in range(len(first))]
        return lambda values: _rebuild_sequence(first, [build(values) for build in parts])
    if isinstance(first, _PLAIN):
        return _collect_plain(outputs, plan, within)
    return _collect_object(outputs, plan, within, depth)


def _collect_plain(outputs: list, plan: _Plan, within: str | None) -> Callable:
    """A plain value: once when the replicas agree; else their list (a device inside
    an object: the output device, where its tensors are gathered)."""
    first = outputs[0]
    if all(_same(o, first) for o in outputs):
        return lambda values: first
    if within is None:
        value = list(outputs)
        return lambda values: value
    if all(isinstance(o, torch.device) for o in outputs):
        return lambda values: plan.device
    raise TypeError(f"DataParallel gathers an object's attributes, but {within} differs "
                    f"between replicas ({', '.join(repr(o) for o in outputs)}); return "
                    "tensors, or values that every replica agrees on")


def _collect_object(outputs: list, plan: _Plan, within: str | None,
                    depth: int) -> Callable:
    """An object of another class: a generator refused (its tensors would be made on
    the caller, after the run, outside the gather and the backward); a class torch's
    pytree knows, or one with attributes (Hugging Face's caches: ``DynamicCache`` and
    its layers), gathered as its type; one equal in every replica returned once."""
    first, kind = outputs[0], type(outputs[0]).__name__
    if isinstance(first, (Iterator, AsyncIterator, Awaitable)):
        raise TypeError(f"DataParallel cannot gather the {kind} the module returned: its "
                        "values would be made after the replicas' run, outside the gather "
                        "and the backward; return a tuple or list (e.g. tuple(...) of it)")
    if all(o is first for o in outputs):
        return lambda values: first
    if depth >= _OBJECT_DEPTH:
        raise TypeError(f"DataParallel cannot gather {within or kind}: objects nest more "
                        f"than {_OBJECT_DEPTH} deep in it (a cycle?)")
    if torch_internals.pytree_node(type(first)):
        return _collect_pytree(outputs, plan, within, depth)
    if hasattr(first, "__dict__"):
        return _collect_attributes(outputs, plan, within, depth)
    if all(_same(o, first) for o in outputs):
        return lambda values: first
    raise TypeError(f"DataParallel cannot gather the {kind} the module returned (no "
                    "tensors, tuples, lists, dicts, dataclasses or attributes to gather "
                    "through, and the replicas' differ); return tensors, or register "
                    "the class with torch.utils._pytree.register_pytree_node")


def _collect_pytree(outputs: list, plan: _Plan, within: str | None,
                    depth: int) -> Callable:
    flat = [torch_internals.pytree_flatten(o) for o in outputs]
    spec = flat[0][1]
    if any(s != spec for _, s in flat):
        raise TypeError(f"DataParallel's replicas returned {type(outputs[0]).__name__}s of "
                        "different structures; every replica must return the same")
    label = within or type(outputs[0]).__name__
    parts = [_collect([leaves[i] for leaves, _ in flat], plan, None, f"{label} leaf {i}",
                      depth + 1) for i in range(len(flat[0][0]))]
    return lambda values: torch_internals.pytree_unflatten(
        [build(values) for build in parts], spec)


def _collect_attributes(outputs: list, plan: _Plan, within: str | None,
                        depth: int) -> Callable:
    """Replica 0's object, copied, each attribute gathered (tensors concatenated along
    ``dim``, containers and objects through, plain values agreed on)."""
    first, kind = outputs[0], type(outputs[0]).__name__
    names = list(vars(first))
    if any(list(vars(o)) != names for o in outputs):
        raise TypeError(f"DataParallel's replicas returned {kind}s with different "
                        "attributes; every replica must return the same structure")
    parts = {n: _collect([vars(o)[n] for o in outputs], plan, n,
                         f"{within or kind}.{n}", depth + 1) for n in names}

    def build(values):
        gathered = copy.copy(first)
        vars(gathered).update({n: part(values) for n, part in parts.items()})
        return gathered
    return build


def _same(a: Any, b: Any) -> bool:
    """Whether two replicas returned the same plain value (then it is returned once)."""
    try:
        return a is b or bool(a == b)
    except Exception:  # noqa: BLE001 - arrays and the like: no single truth value
        return False


def _check_same_kind(outputs: list) -> None:
    kinds = {type(o) for o in outputs}
    if len(kinds) > 1:
        raise TypeError(f"DataParallel's replicas returned different kinds of output "
                        f"({', '.join(sorted(k.__name__ for k in kinds))}); every replica "
                        "must return the same structure")
    first = outputs[0]
    if isinstance(first, Mapping) and any(o.keys() != first.keys() for o in outputs):
        raise TypeError("DataParallel's replicas returned dicts with different keys")
    if isinstance(first, (tuple, list)) and any(len(o) != len(first) for o in outputs):
        raise TypeError("DataParallel's replicas returned sequences of different lengths")
