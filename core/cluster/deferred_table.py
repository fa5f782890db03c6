"""An embedding table's weight on a worker of a parameter-server job, before the table
exists: it records how the table is initialized, and the ps tasks make it, each its rows.

A worker builds its model in ``strategy.scope()`` as always. When an ``nn.Embedding`` or
``nn.EmbeddingBag`` that will be served by rows (:mod:`.embedding_lookup`) registers its
weight, the weight becomes a :class:`DeferredTable`: a ``Parameter`` of the table's shape
and dtype holding one element. What the module's ``reset_parameters`` (and the user's own
init) then does to it is recorded, not run (:class:`.initializers.TableInitializer`):

* ``normal_`` and ``uniform_`` (also through ``nn.init``: ``normal_``, ``uniform_``,
  ``xavier_*``, ``kaiming_normal_``, ``constant_``, ``zeros_``, ``ones_``), with the
  generator's state; the generator is advanced as the call would have advanced it (its
  draws made in chunks and dropped), so the layers built next draw what they would have;
* fills of the whole table or of rows (``padding_idx``; ``weight[i] = 0``), scalar
  ``mul_``/``div_``/``add_``/``sub_``/``clamp_``, and ``copy_`` of given values.

At registration each ps runs the steps over its own shards: the same values as
``torch.manual_seed(s); Net()``, and no worker holds the table at any time. Anything
else done to the weight before then (reading it, an init csrun cannot replay by shard:
``orthogonal_``, ``trunc_normal_``, ``kaiming_uniform_``) builds it whole at once, with
exactly the values it would have had, and says so once (a warning; ``csrun train``
shows it as a notice): correct, only not memory-free. A table given its values
(``_weight=``, ``from_pretrained``) is sent with them, as before.
"""

from __future__ import annotations

import inspect
import math
import warnings

import torch

from ..distribute import torch_internals
from .initializers import SCALAR_STEPS, TableInitializer, chunking_holds

__all__ = ["DeferredTable", "deferred_tables"]

_Tensor = torch.Tensor
_LEAF = "a leaf Variable that requires grad is being used in an in-place operation."
# what can be asked of a table that does not exist yet: its shape and kind, no value
_METADATA = frozenset({
    "shape", "dtype", "device", "requires_grad", "is_leaf", "grad", "grad_fn", "layout",
    "ndim", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn",
    "is_nested", "names", "itemsize", "output_nr", "is_xpu", "is_mps", "__hash__", "size",
    "dim", "numel", "nelement", "ndimension", "element_size", "is_floating_point",
    "is_complex", "is_signed", "get_device", "__len__", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook"}) | torch_internals.TENSOR_PRIVATE_DESCRIPTION
# methods that return the tensor itself when they change nothing
_SAME_OR_COPY = frozenset({"to", "cpu", "float", "double", "half", "bfloat16"})
_UNKNOWN = object()


def _name(func) -> str:
    """What ``__torch_function__`` was called for: a method's or property's name."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _called(name: str) -> str:
    """What the user called: ``nn.init.orthogonal_ (new_empty)`` when torch's init
    function made the call, else the call itself."""
    frame, init = inspect.currentframe(), None
    while frame is not None:
        if frame.f_globals.get("__name__") == "torch.nn.init" and \
                not frame.f_code.co_name.startswith("_"):
            init = frame.f_code.co_name
        frame = frame.f_back
    return f"nn.init.{init} ({name})" if init else name


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, torch.Tensor)


class _Table:
    """What a deferred table's stand-in and its views share: the initializer, and
    whether the table is still recorded, built here, or served by the ps tasks."""

    def __init__(self, root: "DeferredTable", initializer: TableInitializer, label: str):
        self.root, self.initializer, self.label = root, initializer, label
        self.state = "recording"  # then "materialized" (built here) or "served"

    def materialize(self, why: str | None = None) -> None:
        """Build the table here, whole, with the values its recorded steps give."""
        if self.state != "recording":
            return
        values = self.initializer.whole()
        root = self.root
        root.__class__ = torch.nn.Parameter  # a plain parameter from now on
        with torch.no_grad():
            root.data = values
        self.state = "materialized"
        del root.csrun_table
        if why is not None:
            warnings.warn(
                f"{self.label} is built whole on this worker: its initialization calls "
                f"{why}, which csrun cannot run by shard on the ps tasks (they run "
                "normal_, uniform_, fills, scalar arithmetic and copies of given values); "
                "its values are the same, but this worker holds the whole table until it "
                "registers", stacklevel=4)

    def served(self) -> None:
        """The ps tasks hold the table now: the stand-in is a plain parameter of one
        element (:mod:`.embedding_lookup` reads it by rows)."""
        root = self.root
        root.__class__ = torch.nn.Parameter
        self.state = "served"
        del root.csrun_table
        self.initializer.given = None


class _Recorder:
    """The ``__torch_function__`` of a stand-in and its views: record what can be run by
    shard, answer questions about the shape, build the table for anything else."""

    __slots__ = ()  # a mixin: a stand-in's class can become Parameter again

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ours = [a for a in (*args, *kwargs.values()) if isinstance(a, _Recorder)]
        table = ours[0].csrun_table if ours else None
        name = _name(func)
        if table is None or name in _METADATA:
            return torch.nn.Parameter.__torch_function__(func, types, args, kwargs)
        if table.state == "recording":
            answer = _UNKNOWN
            if all(o.csrun_table is table for o in ours):
                answer = _record(func, name, ours[0], table, args, kwargs)
            if answer is not _UNKNOWN:
                return answer
            why = _called(name)
            for other in {id(o.csrun_table): o.csrun_table for o in ours}.values():
                other.materialize(why)
        elif table.state == "served":
            raise RuntimeError(f"this tensor is a view of {table.label}'s weight, which the "
                               "ps tasks hold (a worker has none of it); read the table "
                               "through its module, or model.state_dict()")
        args = tuple(a.real() if isinstance(a, _TableView) else a for a in args)
        kwargs = {k: v.real() if isinstance(v, _TableView) else v for k, v in kwargs.items()}
        return torch.nn.Parameter.__torch_function__(func, types, args, kwargs)


class DeferredTable(_Recorder, torch.nn.Parameter):
    """A table's weight on a worker before the ps tasks make it (module docstring)."""

    @classmethod
    def standing_for(cls, param: torch.Tensor, label: str) -> "DeferredTable":
        """The stand-in for ``param`` (a module's new table weight; its values, if they
        were given, are kept until something overwrites them all)."""
        stand = cls(_placeholder(param.shape, param.dtype), param.requires_grad)
        stand.csrun_table = _Table(stand, TableInitializer(param.shape, param.dtype,
                                                            param.detach()), label)
        return stand

    @property
    def initializer(self) -> TableInitializer:
        return self.csrun_table.initializer

    def materialize(self, why: str | None = None) -> None:
        self.csrun_table.materialize(why)

    def served(self) -> None:
        self.csrun_table.served()


class _TableView(_Recorder, torch.Tensor):
    """``weight.data``, ``weight.detach()`` or rows ``weight[i]``/``weight[a:b]`` of a
    deferred table (``rows``: None for all of it, else ``(index or slice)``)."""

    @staticmethod
    def of(table: _Table, rows, leaf: bool = False) -> "_TableView":
        """``leaf``: rows of the weight itself taken with gradients on, which refuse
        in-place writes, as torch refuses them on a view of a leaf that requires grad."""
        shape = table.initializer.shape
        if rows is not None:
            shape = torch.empty(shape[0], device="meta")[rows].shape + shape[1:]
        view = _placeholder(shape, table.initializer.dtype).as_subclass(_TableView)
        view.csrun_table, view.csrun_rows, view.csrun_leaf = table, rows, leaf
        return view

    def real(self) -> torch.Tensor:
        """This view of the table built here."""
        base = self.csrun_table.root.detach()
        return base if self.csrun_rows is None else base[self.csrun_rows]


def _placeholder(shape, dtype) -> torch.Tensor:
    """One element standing for a tensor of ``shape``: NaN, so that a read that escapes
    shows (a write to it fails: its elements overlap)."""
    fill = float("nan") if dtype.is_floating_point else 0
    return torch.full((1,), fill, dtype=dtype).as_strided(tuple(shape), [0] * len(shape))


def _rows_of(table: _Table, key) -> slice | int | None:
    """``key`` as rows of the table (an int, or a slice of step 1), else None."""
    rows = table.initializer.shape[0] if table.initializer.shape else 0
    if isinstance(key, int) and not isinstance(key, bool) and -rows <= key < rows:
        return key % rows
    if isinstance(key, slice) and key.step in (None, 1):
        return key
    return None


def _span(table: _Table, rows) -> list[int]:
    """Rows (an int or a slice) as ``[first, end)``."""
    if isinstance(rows, int):
        return [rows, rows + 1]
    first, end, _ = rows.indices(table.initializer.shape[0])
    return [first, max(first, end)]


def _record(func, name: str, subject, table: _Table, args, kwargs):
    """Record ``func`` on ``subject`` if it can be run by shard; its result, or _UNKNOWN."""
    whole = isinstance(subject, DeferredTable) or subject.csrun_rows is None
    if func in _INIT:  # nn.init's own entry points: the method each one runs, no_grad
        method, arguments, keywords = _INIT[func](*args, **kwargs)
        with torch.no_grad():
            return _record(method, method.__name__, subject, table, (subject, *arguments),
                           keywords)
    alone = len(args) == 1 and args[0] is subject and not kwargs
    if name == "data" and whole:
        if getattr(func, "__name__", "") == "__get__":
            return _TableView.of(table, None)
        return _set_data(table, args[1] if len(args) == 2 else None)
    if name == "detach" and whole and alone:
        return _TableView.of(table, None)
    if name in ("is_contiguous", "contiguous") and whole and alone:
        return True if name == "is_contiguous" else subject
    if name == "stride" and whole and alone:
        shape = table.initializer.shape
        return tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    if name == "type" and alone:
        return torch.nn.Parameter.__torch_function__(func, (), args, kwargs)
    if name in _SAME_OR_COPY:
        out = torch.nn.Parameter.__torch_function__(func, (), args, kwargs)
        return subject if out is subject else _UNKNOWN
    if name in _LIKE and whole and args and args[0] is subject:
        return _constant_like(name, table, args[1:], kwargs)
    if name == "__getitem__" and whole and len(args) == 2:
        rows = _rows_of(table, args[1])
        leaf = isinstance(subject, DeferredTable) and subject.requires_grad and \
            torch.is_grad_enabled()
        return _UNKNOWN if rows is None else _TableView.of(table, rows, leaf)
    if name not in _STEPS or not args or args[0] is not subject:
        return _UNKNOWN
    if torch.is_grad_enabled():
        if isinstance(subject, DeferredTable) and subject.requires_grad:
            raise RuntimeError(_LEAF)
        if isinstance(subject, _TableView) and subject.csrun_leaf:
            raise RuntimeError(f"a view of {_LEAF}")
    step = _STEPS[name](table, subject, whole, args[1:], kwargs)
    return _UNKNOWN if step is _UNKNOWN else (None if name == "__setitem__" else subject)


_LIKE = frozenset({"zeros_like", "ones_like", "full_like", "empty_like"})


def _constant_like(name: str, table: _Table, args, kwargs):
    """``torch.zeros_like(weight)`` and its kin (Adagrad's sums, made when it is built):
    the constant as one element standing for the shape, no table's memory. Read, it is
    the constant; written in place, torch refuses it (its elements overlap). A worker's
    optimizer keeps no state of a table the ps tasks serve, so none is ever written."""
    value = {"zeros_like": 0, "ones_like": 1, "empty_like": 0}.get(name)
    if name == "full_like":
        value = args[0] if len(args) == 1 else kwargs.pop("fill_value", None)
    elif args:
        return _UNKNOWN
    dtype = kwargs.pop("dtype", None) or table.initializer.dtype
    kwargs.pop("memory_format", None)
    if not _number(value) or kwargs.pop("requires_grad", False) or \
            kwargs.pop("layout", torch.strided) != torch.strided or \
            torch.device(kwargs.pop("device", None) or "cpu").type != "cpu" or kwargs:
        return _UNKNOWN
    shape = table.initializer.shape
    return torch.full((1,), value, dtype=dtype).as_strided(shape, [0] * len(shape))


def _set_data(table: _Table, values):
    """``weight.data = values``: the table's values are those (shared, as torch does)."""
    init = table.initializer
    if not isinstance(values, torch.Tensor) or isinstance(values, _Recorder) or \
            tuple(values.shape) != init.shape or values.dtype != init.dtype or \
            values.device.type != "cpu":
        return _UNKNOWN
    init.given, init.steps = values, []
    return None


_INIT = {  # nn.init function -> (the Tensor method it runs, its arguments, keywords)
    torch.nn.init.normal_: lambda tensor, mean=0.0, std=1.0, generator=None:
        (_Tensor.normal_, (mean, std), {"generator": generator}),
    torch.nn.init.uniform_: lambda tensor, a=0.0, b=1.0, generator=None:
        (_Tensor.uniform_, (a, b), {"generator": generator}),
    torch.nn.init.constant_: lambda tensor, val: (_Tensor.fill_, (val,), {}),
}


def _random(op: str):
    def record(table: _Table, subject, whole: bool, args, kwargs):
        names = ("mean", "std") if op == "normal" else ("low", "high")
        defaults = (0.0, 1.0)
        if not whole or len(args) > 2 or set(kwargs) - {"generator", "mean", "std",
                                                         "from", "to"}:
            return _UNKNOWN
        given = dict(zip(names, args))
        for key, target in (("mean", "mean"), ("std", "std"), ("from", "low"),
                            ("to", "high")):
            if key in kwargs:
                given[target] = kwargs[key]
        values = [given.get(n, d) for n, d in zip(names, defaults)]
        generator = kwargs.get("generator") or torch.default_generator
        dtype = table.initializer.dtype
        if not all(_number(v) for v in values) or generator.device.type != "cpu" \
                or not chunking_holds(op, dtype):
            return _UNKNOWN
        table.initializer.record({"op": op, **dict(zip(names, map(float, values)))},
                                 whole=True, generator=generator)
        return None
    return record


def _fill(table: _Table, subject, whole: bool, args, kwargs, zero: bool = False):
    value = 0 if zero else (args[0] if len(args) == 1 and not kwargs else None)
    if not _number(value):
        return _UNKNOWN
    rows = None if whole else _span(table, subject.csrun_rows)
    table.initializer.record({"op": "fill", "value": value, "rows": rows}, whole=whole)
    return None


def _set_rows(table: _Table, subject, whole: bool, args, kwargs):
    if not whole or len(args) != 2 or kwargs:
        return _UNKNOWN
    rows = _rows_of(table, args[0])
    if rows is None or not _number(args[1]):
        return _UNKNOWN
    table.initializer.record({"op": "fill", "value": args[1], "rows": _span(table, rows)},
                             whole=False)
    return None


def _scalar(op: str):
    def record(table: _Table, subject, whole: bool, args, kwargs):
        if not whole or len(args) != 1 or kwargs or not _number(args[0]):
            return _UNKNOWN
        table.initializer.record({"op": op, "value": args[0]}, whole=False)
        return None
    return record


def _clamp(table: _Table, subject, whole: bool, args, kwargs):
    bounds = dict(zip(("min", "max"), args), **kwargs)
    if not whole or set(bounds) - {"min", "max"} or not all(
            v is None or _number(v) for v in bounds.values()) or not bounds:
        return _UNKNOWN
    table.initializer.record({"op": "clamp", "min": bounds.get("min"),
                              "max": bounds.get("max")}, whole=False)
    return None


def _copy(table: _Table, subject, whole: bool, args, kwargs):
    source = args[0] if len(args) == 1 else None
    init = table.initializer
    if not whole or not isinstance(source, torch.Tensor) or isinstance(source, _Recorder) \
            or set(kwargs) - {"non_blocking"} or tuple(source.shape) != init.shape:
        return _UNKNOWN
    # copied now, as copy_ does: later changes to the source do not reach the table
    init.given, init.steps = source.detach().to("cpu", init.dtype, copy=True), []
    return None


_STEPS = {"normal_": _random("normal"), "uniform_": _random("uniform"), "fill_": _fill,
          "zero_": lambda *a: _fill(*a, zero=True), "__setitem__": _set_rows,
          "clamp_": _clamp, "copy_": _copy,
          **{f"{op}_": _scalar(op) for op in SCALAR_STEPS}}


def deferred_tables(tensors) -> list[DeferredTable]:
    """The stand-ins among ``tensors`` whose tables are still recorded."""
    return [t for t in tensors if isinstance(t, DeferredTable)]
