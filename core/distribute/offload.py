"""Offload: the CPU optimizer steps while a GPU's gradients are still arriving.

With parameters on the CPU and replicas on GPUs (TF's default with two GPUs or more, and
the way to train a model larger than a GPU), each replica's gradients cross PCIe in
buckets as its backward makes them (:mod:`.buckets`). The host queues a GPU's backward
faster than the GPU runs it, so when ``run`` returns the last buckets are often still on
their way. Waiting for all of them there would leave the CPU idle through the rest of the
backward, and the GPU idle through the whole optimizer step. Instead:

* **``.grad`` holds an arriving gradient.** When a run ends with every copy of its
  gradients still in flight and the central tensors hold no gradient yet (the step after
  ``zero_grad()``), each ``.grad`` is an :class:`ArrivingGrad`: a tensor of the
  gradient's shape, dtype and device whose every use through torch (any op: ``print``,
  ``clip_grad_norm_``, ``GradScaler.unscale_``, the optimizer's kernels) first waits for
  its bucket and adds the replicas' copies in replica order, as the synchronous path
  does, so every result is the same; ``.numpy()``, ``.tolist()``, ``data_ptr()``,
  pickling and ``repr`` answer for the landed gradient too. A use that reaches around
  both (a C extension reading it) fails loudly: the tensor has no storage to read
  early. The next ``run``, ``optimizer.step()`` or backward lands whatever is left
  first. ``run`` still waits until the parameters have been copied to the GPUs (early
  in the forward): code before the step may change them.
* **``optimizer.step()`` steps bucket by bucket.** For torch's optimizers that update
  each parameter from its own gradient and state (:data:`PER_PARAMETER`), the
  ``optimizer.step()`` that follows ``run`` sees its parameter groups split by bucket,
  in the order the buckets left the GPU (each piece a copy of its group, the same
  hyperparameters): the optimizer's own loop then waits for the first bucket, steps it,
  waits for the next while the GPU still sends -- one call of the user's optimizer, one
  update, its state, schedulers and ``state_dict`` untouched; the groups are put back
  when the step ends. Any other step (another class or a ``step`` of its own, a closure
  or arguments, step hooks, ``differentiable=True``) waits for every gradient first,
  with one warning per optimizer class and reason.

A step that must see every gradient first does so: ``clip_grad_norm_`` or
``GradScaler.unscale_`` between ``run`` and ``step`` waits for all of them (after it,
the optimizer steps what has arrived); gradients accumulated over several runs, hooks on
central tensors and gradients collected in ``merge_call`` or after a backward outside
``run`` arrive before ``run``/``backward`` returns, as on the synchronous path.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from typing import Any

import torch

from . import torch_internals

__all__ = ["Arrival", "ArrivingGrad", "PER_PARAMETER", "why_not_by_bucket", "step_by_bucket",
           "rejoin", "warn_not_by_bucket"]

# torch's optimizers whose update of a parameter reads only its gradient, its state and
# its group's hyperparameters: stepping their groups piece by piece is one step
PER_PARAMETER = tuple(getattr(torch.optim, name) for name in (
    "SGD", "Adam", "AdamW", "Adamax", "Adagrad", "Adadelta", "RMSprop", "Rprop", "NAdam",
    "RAdam", "ASGD") if hasattr(torch.optim, name))


class Arrival:
    """One run's gradients on their way: per central tensor, each replica's copy (a
    view of a flat buffer a copy fills, and the event that says it is full).

    Args:
      started: per replica, in replica order, its transfers ``(pairs of (central,
        offset), flat, event)`` (:meth:`.broadcast.DeviceMirror.start_grads`).
    """

    def __init__(self, started: list):
        # id(central) -> [central, [(flat, event, offset), ...] in replica order, bucket]
        self._parts: dict = {}
        for transfers in started:
            for position, (pairs, flat, event) in enumerate(transfers):
                for central, offset in pairs:
                    entry = self._parts.setdefault(id(central), [central, [], position])
                    entry[1].append((flat, event, offset))
        self._waiting: dict = {}  # id(central) -> its ArrivingGrad, until it lands
        self._lock = threading.Lock()  # an op on any thread may land a gradient

    def place(self) -> None:
        """Put an :class:`ArrivingGrad` in each central tensor's ``.grad``."""
        for key, (central, _, _) in self._parts.items():
            waiting = ArrivingGrad(self, key, central)
            self._waiting[key] = waiting
            central.grad = waiting

    def owns(self, central: torch.Tensor) -> bool:
        """Whether ``central.grad`` is a gradient of this arrival still on its way."""
        waiting = self._waiting.get(id(central))
        return waiting is not None and central.grad is waiting

    def position(self, central: torch.Tensor) -> int:
        """The bucket that brings ``central``'s gradient (its order of leaving); -1 for a
        tensor whose ``.grad`` is not on its way."""
        return self._parts[id(central)][2] if self.owns(central) else -1

    def land(self, key: int) -> None:
        """Wait for the gradient of the tensor ``id`` ``key`` and add the replicas' copies
        in replica order (as :func:`.parameters.accumulate` adds them) into its
        :class:`ArrivingGrad`; ``.grad`` gets it unless the user put something else
        there meanwhile. Once: a landed one is the ArrivingGrad's alone to keep."""
        with self._lock:
            waiting = self._waiting.pop(key, None)
            if waiting is None:  # landed by another op, maybe on another thread
                return
            central, parts, _ = self._parts[key]
            grad = None
            with torch.no_grad():
                for flat, event, offset in parts:
                    if event is not None:
                        event.synchronize()
                    view = flat[offset:offset + central.numel()].view(central.shape)
                    if grad is None:
                        grad = view
                    else:
                        torch_internals.foreach_add_([grad], [view])
            self._parts[key][1] = None  # the replicas' buffers: held by ``grad`` if needed
            waiting.grad_landed = grad
            if central.grad is waiting:
                central.grad = grad

    def land_all(self) -> None:
        for key in list(self._waiting):
            self.land(key)


def _unwrapped(value: Any) -> Any:
    """``value`` with every :class:`ArrivingGrad` in it (lists and tuples of ops like
    ``_foreach_mul_``, dicts of keyword arguments) replaced by its landed gradient."""
    if isinstance(value, ArrivingGrad):
        return value.landed()
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrapped(v) for v in value)
    if isinstance(value, dict):
        return {k: _unwrapped(v) for k, v in value.items()}
    return value


class ArrivingGrad(torch.Tensor):
    """A central tensor's gradient on its way from a GPU: every torch op on it waits for
    it to land first (:class:`Arrival`). Shape, dtype and device are known at once."""

    __torch_function__ = torch_internals.disabled_torch_function

    @staticmethod
    def __new__(cls, arrival: Arrival, key: int, central: torch.Tensor):
        return torch_internals.make_wrapper_tensor(cls, central.shape, dtype=central.dtype,
                                                   device=central.device)

    def __init__(self, arrival: Arrival, key: int, central: torch.Tensor):
        self._arrival = arrival
        self._key = key
        self.grad_landed = None  # set by Arrival.land

    def landed(self) -> torch.Tensor:
        """The gradient, once it has arrived (waits for it)."""
        if self.grad_landed is None:
            self._arrival.land(self._key)
        return self.grad_landed

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*_unwrapped(args), **_unwrapped(kwargs or {}))

    # what torch answers outside its dispatcher, for the landed gradient: a subclass with
    # no storage of its own would refuse
    def __repr__(self) -> str:
        return repr(self.landed())

    def __reduce_ex__(self, protocol):
        return self.landed().__reduce_ex__(protocol)

    def __array__(self, *args, **kwargs):
        return self.landed().__array__(*args, **kwargs)

    def tolist(self):
        return self.landed().tolist()

    def numpy(self, *args, **kwargs):
        return self.landed().numpy(*args, **kwargs)

    def data_ptr(self) -> int:
        return self.landed().data_ptr()

    def untyped_storage(self):
        return self.landed().untyped_storage()


def why_not_by_bucket(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> str | None:
    """Why ``optimizer.step(*args[1:], **kwargs)`` cannot step bucket by bucket (None: it
    can). ``args[0]`` is the optimizer, as torch passes it to step hooks."""
    step = type(optimizer).step
    if not any(step is cls.step for cls in PER_PARAMETER):
        return (f"{type(optimizer).__name__}.step is not one of torch's per-parameter "
                "optimizers (" + ", ".join(c.__name__ for c in PER_PARAMETER) + ")")
    if len(args) > 1 or kwargs:
        return "step was given a closure or arguments"
    if optimizer.defaults.get("differentiable"):
        return "it is differentiable"
    if torch_internals.optimizer_step_hooks(optimizer) > 1:  # csrun's pre hook
        return "it has step hooks, which see its parameter groups"
    return None


def split_groups(optimizer: torch.optim.Optimizer, arrival: Arrival) -> list | None:
    """``optimizer.param_groups`` cut by bucket in the order they arrive (parameters not
    on their way first), each piece a copy of its group; None when one piece would do."""
    pieces: dict = {}
    for number, group in enumerate(optimizer.param_groups):
        for param in group["params"]:
            pieces.setdefault((arrival.position(param), number), []).append(param)
    if len({position for position, _ in pieces}) < 2:
        return None
    groups = optimizer.param_groups
    return [dict(groups[number], params=params)
            for (_, number), params in sorted(pieces.items(), key=lambda item: item[0])]


# optimizer -> (its groups, the pieces it steps, its state's size, the hook that joins)
_split: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def step_by_bucket(optimizer: torch.optim.Optimizer, arrival: Arrival) -> bool:
    """Give ``optimizer`` its groups split by bucket for the step under way (False: one
    piece would do). A step post-hook of its own puts them back: it outlives the
    strategy, which a garbage collection during the step may end."""
    pieces = split_groups(optimizer, arrival)
    if pieces is None:
        return False
    handle = optimizer.register_step_post_hook(lambda opt, args, kwargs: rejoin(opt))
    _split[optimizer] = (optimizer.param_groups, pieces, len(optimizer.state), handle)
    optimizer.param_groups = pieces
    return True


def rejoin(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer``'s own groups back, if split (after its step, or before its next one
    when the last raised)."""
    entry = _split.pop(optimizer, None)
    if entry is not None:
        groups, pieces, states, handle = entry
        handle.remove()
        _join_groups(optimizer, groups, pieces, states)


def _join_groups(optimizer: torch.optim.Optimizer, groups: list, pieces: list,
                 states: int) -> None:
    """Put ``groups`` back as ``optimizer.param_groups``, keeping any setting the step
    changed in a piece (none of torch's do; a value set differently in two pieces of a
    group keeps the last). ``states``: how many parameters had state before the step;
    state made by it is put in the groups' order, as a whole step makes it (the order
    ``state_dict()`` lists it in)."""
    if len(optimizer.state) != states:
        state = optimizer.state
        ordered = {p: state[p] for group in groups for p in group["params"] if p in state}
        ordered.update((k, v) for k, v in list(state.items()) if k not in ordered)
        state.clear()
        state.update(ordered)
    by_params: dict = {}
    for group in groups:
        for param in group["params"]:
            by_params[id(param)] = group
    for piece in pieces:
        group = by_params[id(piece["params"][0])]
        for key, value in piece.items():
            if key != "params" and group.get(key) is not value:
                group[key] = value
    optimizer.param_groups = groups


_warned: set = set()


def warn_not_by_bucket(optimizer: torch.optim.Optimizer, reason: str) -> None:
    """Once per optimizer class and reason: this step waited for every gradient."""
    key = (type(optimizer), reason)
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"csrun: {type(optimizer).__name__}.step() waits for every gradient to arrive "
            f"from the GPU before it starts, not bucket by bucket: {reason}. Results are "
            "the same; see docs/performance.md, 'Parameters on the CPU'", stacklevel=4)
