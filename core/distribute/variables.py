"""Variables: state on the parameter device with TF's aggregation of replica updates.

Module parameters and buffers created in ``strategy.scope()`` are csrun's main variables
(see ``parameters.py``). :class:`Variable` is TF's ``tf.Variable`` for state you keep
outside modules: created in scope it lives on the parameter device, replicas read it on
their own device, and an ``assign*`` inside ``strategy.run`` is combined across replicas
by its :class:`VariableAggregation` and applied once, exactly as TF does:

* ``NONE``: updating in replica context is an error (TF's rule: say how to combine).
* ``SUM``: the replicas' values are summed (``assign_add(x)`` adds the sum of the xs).
* ``MEAN``: the replicas' values are averaged.
* ``ONLY_FIRST_REPLICA``: replica 0's value is used.

A value that is the very same object on every replica (a Python constant) is not a
per-replica value; summing it is ambiguous and raises, as in TF.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from . import context
from .devices import canonical_name
from .reduce import ReduceOp, as_tensor, reduce_values
from .values import map_structure

__all__ = ["VariableAggregation", "VariableSynchronization", "Variable"]


class VariableAggregation(enum.Enum):
    """How updates made inside replicas are combined (TF's enum, same members)."""

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3

    @classmethod
    def resolve(cls, value: Any) -> "VariableAggregation":
        """An aggregation from the enum, its number (as TF takes it) or its name (any
        case: csrun's, for configs)."""
        return _member(cls, value, "aggregation")


class VariableSynchronization(enum.Enum):
    """When replicas' copies are synchronized (TF's enum; csrun's updates are ON_WRITE)."""

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3

    @classmethod
    def resolve(cls, value: Any) -> "VariableSynchronization":
        """A synchronization from the enum, its number (TF takes ``synchronization=3``:
        ON_READ) or its name (any case: csrun's)."""
        return _member(cls, value, "synchronization")


def _member(cls: type[enum.Enum], value: Any, what: str) -> Any:
    if isinstance(value, cls):
        return value
    if isinstance(value, str) and value.upper() in cls.__members__:
        return cls[value.upper()]
    if isinstance(value, int) and not isinstance(value, bool):
        for member in cls:
            if member.value == value:
                return member
    names = ", ".join(f"{name} ({member.value})" for name, member in cls.__members__.items())
    raise ValueError(f"Invalid variable {what} mode: {value!r:.80}; {what} must be a "
                     f"{cls.__name__}: {names}")


def _apply(tensor: torch.Tensor, op: str, value: torch.Tensor) -> None:
    with torch.no_grad():
        if op == "assign":
            tensor.copy_(value)
        elif op == "assign_add":
            tensor.add_(value)
        else:
            tensor.sub_(value)


def combine_updates(values: list, aggregation: VariableAggregation, name: str,
                    dtype: torch.dtype | None = None) -> Any:
    """Combine one update value per replica (TF's replica-context aggregation) for a
    variable of ``dtype``."""
    if aggregation is VariableAggregation.NONE:
        raise ValueError(
            f"cannot update {name} inside replicas: its aggregation is NONE. Create it with "
            "an aggregation (csrun.core.Variable(..., aggregation=VariableAggregation.SUM)), "
            "or update it in cross-replica context (merge_call + extended.update)")
    first = values[0]
    if all(v is first for v in values):  # the same object everywhere: not per-replica
        if aggregation is VariableAggregation.SUM:
            raise ValueError(
                f"cannot SUM the update {first!r} of {name}: every replica passed the same "
                "object, so it is not a per-replica value; compute it per replica or use MEAN")
        return as_tensor(first)
    if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
        return as_tensor(first)
    if aggregation is VariableAggregation.MEAN and dtype is not None and not (
            dtype.is_floating_point or dtype.is_complex):
        raise ValueError(
            f"Cannot update {name} ({dtype}) with MEAN aggregation in replica context: the "
            "mean of integers is not one (TF refuses it too). Make the variable floating, "
            "or update it in cross-replica context")
    op = ReduceOp.SUM if aggregation is VariableAggregation.SUM else ReduceOp.MEAN
    return reduce_values(op, values, None, None)


class Variable:
    """TF's ``tf.Variable``: a tensor on the parameter device with an aggregation.

    Args:
      initial_value: anything ``torch.as_tensor`` takes.
      trainable: whether gradients flow to it (default True, False for ON_READ).
      name: a name for messages and ``repr`` (TF appends ``:0``).
      dtype: the torch dtype (default: the initial value's).
      aggregation: how replica updates combine (:class:`VariableAggregation`).
      synchronization: TF's synchronization setting, recorded.

    Example::

        with strategy.scope():
            seen = csrun.core.Variable(0.0, aggregation="SUM", trainable=False)
        strategy.run(lambda x: seen.assign_add(torch.tensor(float(len(x)))), args=(batch,))
    """

    def __init__(self, initial_value: Any, trainable: bool | None = None, name: str | None = None,
                 dtype: torch.dtype | None = None, aggregation: Any = VariableAggregation.NONE,
                 synchronization: Any = VariableSynchronization.AUTO):
        self.aggregation = VariableAggregation.resolve(aggregation)
        self.synchronization = VariableSynchronization.resolve(synchronization)
        if trainable is None:
            trainable = self.synchronization is not VariableSynchronization.ON_READ
        self.trainable = bool(trainable)
        self.name = f"{name or 'Variable'}:0"
        strategy = context.current_entry().strategy
        value = torch.as_tensor(initial_value, dtype=dtype).detach().clone()
        if strategy is not None:
            value = value.to(strategy.extended.parameter_device.torch_device)
        if self.trainable and (value.is_floating_point() or value.is_complex()):
            value.requires_grad_(True)
        self._tensor = value
        self._strategy = strategy
        if strategy is not None:
            strategy.extended.store.register_tensor(value)

    # -- reading -------------------------------------------------------------------------
    @property
    def tensor(self) -> torch.Tensor:
        """The central tensor (give it to an optimizer to train the variable)."""
        return self._tensor

    @property
    def device(self) -> str:
        """The canonical name of the device the variable lives on."""
        if self._strategy is not None:
            return self._strategy.extended.parameter_device.name
        return canonical_name(self._tensor.device)

    @property
    def distribute_strategy(self):
        return self._strategy

    @property
    def shape(self) -> torch.Size:
        return self._tensor.shape

    @property
    def dtype(self) -> torch.dtype:
        return self._tensor.dtype

    def value(self) -> torch.Tensor:
        """The value: inside a replica, that replica's copy on its device."""
        serving = context.current_serving()
        if serving is not None and serving.store is self._store_or_none():
            return serving.serve_tensor(self._tensor)
        return self._tensor

    read_value = value

    def numpy(self):
        return self._tensor.detach().cpu().numpy()

    def __float__(self) -> float:
        return float(self._tensor.detach())

    def __int__(self) -> int:
        return int(self._tensor.detach())

    def __repr__(self) -> str:
        return (f"<csrun.core.Variable '{self.name}' shape={tuple(self.shape)} "
                f"dtype={self.dtype} aggregation={self.aggregation.name} "
                f"value={self._tensor.detach().cpu().tolist()}>")

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        unwrap = (lambda v: v.value() if isinstance(v, Variable) else v)
        return func(*map_structure(unwrap, tuple(args)), **map_structure(unwrap, kwargs or {}))

    def _store_or_none(self):
        return self._strategy.extended.store if self._strategy is not None else None

    # -- writing -------------------------------------------------------------------------
    def assign(self, value: Any) -> "Variable":
        """Set the value (combined across replicas inside ``run``)."""
        return self._update("assign", value)

    def assign_add(self, delta: Any) -> "Variable":
        """Add to the value (combined across replicas inside ``run``)."""
        return self._update("assign_add", delta)

    def assign_sub(self, delta: Any) -> "Variable":
        """Subtract from the value (combined across replicas inside ``run``)."""
        return self._update("assign_sub", delta)

    def _update(self, op: str, value: Any) -> Any:
        entry = context.current_entry()
        replica = entry.replica
        if replica is None or not replica.has_peers:
            _apply(self._tensor, op, self._as_update(value))
            return self if replica is None else self.value()

        def merge(values):
            combined = combine_updates(values, self.aggregation, self.name, self.dtype)
            _apply(self._tensor, op, self._as_update(combined))
            return [None] * len(values)

        replica.rendezvous(f"{op} of {self.name}", value, merge)
        return self.value()

    def _as_update(self, value: Any) -> torch.Tensor:
        if isinstance(value, Variable):
            value = value.tensor
        value = as_tensor(value).detach()
        dtype = self._tensor.dtype
        lossy = value.is_complex() or (value.is_floating_point()
                                        and not torch.equal(value, value.round()))
        if lossy and not (dtype.is_floating_point or dtype.is_complex):
            raise TypeError(f"cannot update {self.name} ({dtype}) with {value.tolist()!r:.60}:"
                            " the value is not a whole number, and TF refuses to cast it; "
                            "round it, or make the variable floating")
        return value.to(self._tensor.device, dtype)
