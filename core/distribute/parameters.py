"""Central storage: parameters live once on the parameter device; replicas get views.

**Placement.** While a strategy's scope is active, torch's global registration hooks put
every parameter and buffer a module registers on the parameter device, whatever device the
code asked for, and swap the module's parameter and buffer dicts for :class:`ServedDict`.
Optimizer state is created next to its parameter, so it lands there too. The hooks are
installed with the first strategy and removed with the last; when a strategy is garbage
collected, the modules it adopted get their plain dicts (and BatchNorm its own forward)
back, and live on as plain torch modules (:func:`serve_while`).

**Serving.** Inside a replica, reading ``module.weight`` (through ``ServedDict``) returns
that replica's *leaf* for the central parameter:

* same physical device as the parameter device: a detached alias sharing its storage
  (no copy; one per replica, so each replica's backward fills its own ``.grad``);
* another device (a GPU replica, or any replica when ``copy_parameters=True``): a view
  into a flat buffer on the replica's device, refreshed with one coalesced copy per
  bucket (:mod:`.buckets`) at each run's first read (and after ``merge_call``): a write
  through ``.data`` changes no version, so every run copies, as ``DataParallel`` does on
  every forward.

An alias replica is served the parameters it read in the previous run before it starts
(:meth:`ParameterStore._serve_again`): a first read inside a concurrent replica costs
several times more than here, the replicas contending for the GIL.

**Gradients.** When the replicas have finished, each replica's leaf gradients are moved to
the parameter device (a copy replica's in one coalesced copy per bucket, most of them
started by its backward: :mod:`.buckets`) and added to the central ``.grad`` in replica
order, so the result is deterministic. Gradients produced later (a
backward through ``run``'s outputs in cross-replica context, also after other runs) are
collected when that backward ends (a pre-hook on each output's ``grad_fn`` queues one
callback per backward with the autograd engine, as DDP does), so ``clip_grad_norm_`` and
``GradScaler.unscale_`` see them; before ``optimizer.step()`` and each ``run`` as well.
Alias leaves carry no hook: a Python hook in every replica's backward takes the GIL once
per parameter, and two replicas contending for it ran 15-20% slower (the leaves of a copy
cut in several buckets do, where a transfer pays for it). Alias
leaves hold the central tensors weakly: a model deleted by the user is freed, not kept by
its replicas (device mirrors, for copies, still keep theirs: see
:meth:`ParameterStore.forget`).

**Modules built outside the scope** ("build, then wrap") are served the same way from
their first call inside a replica on (:meth:`ParameterStore.adopt_in_use`): while a
strategy lives every module call passes :func:`_module_call` first. One that cannot be
served (on another device, or another strategy's) is refused there, naming it.

**Hooks** on a central parameter (``register_hook``, ``register_post_accumulate_grad_hook``)
run on the replicas' summed gradient of each flush, as torch runs them on a plain loop's:
the store learns which tensors carry hooks when they are registered (nothing is asked per
parameter per step).

**Buffers** (BatchNorm statistics, user state) are copied per replica; after the run, the
copies that a replica wrote are combined by the buffer's :class:`VariableAggregation`
(default MEAN for floating buffers, ONLY_FIRST_REPLICA for integer ones).
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import warnings
import weakref
from typing import Any, Sequence

import torch
from torch.nn.modules import module as nn_module
from torch.nn.parameter import is_lazy
from torch.optim import optimizer as optim_module

from . import context, offload, sync_batch_norm, torch_internals
from .broadcast import BufferMirror, DeviceMirror, finish_grads
from .buckets import DEFAULT_BYTES_PER_PACK
from .torch_internals import plain_tensor_dict, set_tensor_dict, tensor_dict, tensor_version
from .values import flatten
from .variables import VariableAggregation

__all__ = ["ServedDict", "ParameterStore", "ReplicaServing", "set_aggregation",
           "get_aggregation", "serve_while"]

_KINDS = ("parameter", "buffer")
_PLAIN_DICT = type(plain_tensor_dict(()))  # the dict type torch's modules hold


class ServedDict(dict):
    """A module's parameter or buffer dict: central values, replica views on read.

    Outside replicas it behaves exactly like the dict it replaced.
    """

    __slots__ = ("store", "kind", "_module")

    def __init__(self, items: dict, store: "ParameterStore", module: torch.nn.Module, kind: str):
        super().__init__(items)
        self.store = store
        self.kind = kind  # "parameter" or "buffer"
        self._module = weakref.ref(module)

    def module(self) -> torch.nn.Module | None:
        """The module whose dict this is (None once it was freed)."""
        return self._module()

    def __getitem__(self, name: str):
        # Every parameter read of every replica's forward passes here, on threads that
        # contend for the GIL: the common case (a leaf served earlier in this run) is
        # answered inline.
        value = dict.__getitem__(self, name)
        serving = context.current_serving()
        if serving is None:
            if self.store._landing is not None and self.kind == "buffer":
                self.store.land_buffers()  # the last run's writes, still on their way
                return dict.__getitem__(self, name)
            return value
        if value is None or serving.store is not self.store:
            return value
        if torch.compiler.is_compiling():
            return _compiled_read(serving, self, name, value)
        if self.kind == "parameter" and not serving.slow:
            if serving.direct:  # one replica on the parameter device: the tensor itself
                if value.device == serving.device:
                    return value
            else:
                served = serving.served(id(value))
                if served is not None:
                    return served[1]
        return serving.serve(self, name, value)

    def get(self, name, default=None):
        return self[name] if dict.__contains__(self, name) else default

    def items(self):
        if context.current_serving() is None:
            self._landed()
            return dict.items(self)
        return [(name, self[name]) for name in dict.keys(self)]

    def values(self):
        if context.current_serving() is None:
            self._landed()
            return dict.values(self)
        return [self[name] for name in dict.keys(self)]

    def _landed(self) -> None:
        """A buffer dict read outside replicas: the last run's writes are in it."""
        if self.store._landing is not None and self.kind == "buffer":
            self.store.land_buffers()

    def __setitem__(self, name: str, value) -> None:
        serving = context.current_serving()
        if serving is not None and serving.store is self.store:
            serving.assign(self, name, value)
        else:
            dict.__setitem__(self, name, value)
            if self.kind == "parameter" and value is not None:
                self.store.register_tensor(value)

    def __reduce_ex__(self, protocol):  # pickle/deepcopy as the plain dict it stands for
        return (_PLAIN_DICT, (dict(dict.items(self)),))  # (torch's: OrderedDict before 2.5)

    def path(self, name: str) -> str:
        module = self.module()
        label = type(module).__name__ if module is not None else "module"
        return f"{label}.{name}"


def _compiled_read(serving: "ReplicaServing", owner: ServedDict, name: str, value):
    """A read that ``torch.compile`` traces. Tracing :meth:`ReplicaServing.serve` made
    its per-run state guards that failed on every run; this reads the store's stable
    per-replica leaves (guarded by replica id: one graph per replica), which
    :meth:`ParameterStore.begin_run` brings up to date once a compiled read was seen."""
    if owner.kind == "parameter":
        store = serving.store
        if store.direct:  # one replica, served the central tensors: read as a plain loop
            return value
        leaf = store.compiled_leaves[serving.replica_id].get(id(value))
        if leaf is not None:
            return leaf
    serve = _eager_serve
    if serve is None:  # torch.compile first used inside this run: disabled here
        serve = torch.compiler.disable(_serve_outside_graph)
    return serve(serving, owner, name, value)


def _serve_outside_graph(serving: "ReplicaServing", owner: ServedDict, name: str, value):
    """Serve eagerly (a graph break, see :data:`_eager_serve`): buffers, and a
    parameter's first compiled read."""
    served = serving.serve(owner, name, value)
    if owner.kind == "parameter":
        serving.store.compiled_leaves[serving.replica_id][id(value)] = served
    return served


# _serve_outside_graph wrapped by torch.compiler.disable, made by the first run after
# torch.compile was used (torch_internals.compiler_in_use says why not at import).
_eager_serve = None
# torch.compile's module class, known once the compiler is in use: its submodules run
# inside compiled code, so the wrapper itself is adopted with them (_module_call)
_compiled_type: type | None = None
# Whether compiled code may run in replicas on this torch (None: the compiler is not in
# use yet); where not, compiled modules and run functions run eagerly (_eager_original)
_compiles: bool | None = None
_WARNED_EAGER: list = []  # the one warning, once given


def _prepare_for_compile() -> None:
    """Once the compiler is loaded (the caller asks): the eager serve, torch.compile's module class, and
    whether this torch can run compiled code in replicas."""
    global _eager_serve, _compiled_type, _compiles
    _eager_serve = torch.compiler.disable(_serve_outside_graph)
    _compiled_type = torch_internals.compiled_module_type()
    _compiles = torch_internals.compiles_in_replicas()


def eager_if_uncompilable(fn):
    """``fn`` itself, or the function ``torch.compile`` wrapped into it where this torch
    cannot run compiled code in replicas (said once, in a warning): there a compiled
    replica would recompile on every run, or (torch 2.4) fail or read one run's
    parameters for good. Called with each run's function and each module call."""
    if _compiles is not False:
        return fn
    if _compiled_type is not None and type(fn) is _compiled_type:
        original = torch_internals.compiled_original(fn)
    else:
        original = torch_internals.compiled_function_original(fn)
    if original is None:
        return fn
    if not _WARNED_EAGER:
        _WARNED_EAGER.append(True)
        since = ".".join(map(str, torch_internals.COMPILED_REPLICAS_SINCE))
        warnings.warn(
            f"torch.compile'd code runs eagerly in csrun's replicas with torch "
            f"{torch.__version__}: compiled replicas need torch {since} or newer (with "
            "torch._dynamo.config.inline_inbuilt_nn_modules on, its default); results "
            "are eager mode's", RuntimeWarning, stacklevel=3)
    return original


def _refuse_nested_compile(module: torch.nn.Module) -> None:
    """torch.compile traces a module inside a replica where it cannot (a compiled
    function called by the run's function): refused, rather than a graph holding one
    run's parameters."""
    since = ".".join(map(str, torch_internals.COMPILED_REPLICAS_SINCE))
    raise RuntimeError(
        f"torch.compile traced {type(module).__name__} inside a replica, which needs "
        f"torch {since} or newer (this is {torch.__version__}); compile the model itself "
        "(torch.compile(model)) or the function given to run, which csrun then runs "
        "eagerly, or upgrade torch")


# -- aggregation of buffers -------------------------------------------------------------
_aggregations: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def set_aggregation(module: torch.nn.Module, buffer_name: str, aggregation: Any) -> None:
    """Choose how replicas' writes to ``module.<buffer_name>`` are combined.

    Example: ``set_aggregation(model.counter_owner, "seen", "SUM")``.
    """
    try:
        if "." in buffer_name:  # the module's own buffers only, as get_aggregation reads
            raise AttributeError(buffer_name)
        module.get_buffer(buffer_name)
    except AttributeError:
        names = [n for n, _ in module.named_buffers(recurse=False, remove_duplicate=False)]
        raise KeyError(f"{type(module).__name__} has no buffer {buffer_name!r}; "
                       f"its buffers are {names}") from None
    _aggregations.setdefault(module, {})[buffer_name] = VariableAggregation.resolve(aggregation)


def get_aggregation(module: torch.nn.Module | None, buffer_name: str,
                    tensor: torch.Tensor) -> VariableAggregation:
    """The aggregation of a buffer: the one set, else MEAN (floating) / ONLY_FIRST (other)."""
    if module is not None:
        chosen = _aggregations.get(module, {}).get(buffer_name)
        if chosen is not None:
            return chosen
    if tensor.is_floating_point() or tensor.is_complex():
        return VariableAggregation.MEAN
    return VariableAggregation.ONLY_FIRST_REPLICA


def _aggregated_none(owner: "ServedDict", name: str, tensor: torch.Tensor) -> bool:
    """Whether the buffer's aggregation is NONE (a write is refused after the run: a
    replica writing in place would already have changed it)."""
    if not _aggregations:  # the usual case: nobody chose one
        return False
    return get_aggregation(owner.module(), name, tensor) is VariableAggregation.NONE


# What BatchNorm's native kernels (native_batch_norm, cudnn's, ...) write in place in
# training mode without bumping the tensors' version counters (test_step_work checks
# that torch still does so), so no version tells that a replica wrote them.
_KERNEL_WRITTEN = frozenset({"running_mean", "running_var"})


def _written_by_kernel(owner: "ServedDict", name: str) -> bool:
    """Whether serving ``owner[name]`` now means it will be written unseen: a BatchNorm
    reads its running statistics in training mode to hand them to its kernel."""
    if name not in _KERNEL_WRITTEN:
        return False
    module = owner.module()
    return module is not None and module.training and torch_internals.is_batch_norm(module)


def _aggregate(central: torch.Tensor, copies: list, aggregation: VariableAggregation,
               path: str) -> torch.Tensor:
    """Combine the written replica copies of a buffer (``copies[r]`` or None)."""
    written = [c for c in copies if c is not None]
    if aggregation is VariableAggregation.NONE:
        raise ValueError(
            f"buffer {path} was written inside replicas but its aggregation is NONE; choose "
            "one with csrun.core.set_aggregation(module, name, 'MEAN'|'SUM'|"
            "'ONLY_FIRST_REPLICA')")
    if all(c is central for c in written):  # one replica wrote the buffer itself
        return central
    if aggregation is VariableAggregation.ONLY_FIRST_REPLICA:
        return copies[0] if copies[0] is not None else central
    device = central.device
    if aggregation is VariableAggregation.SUM:
        total = central.clone()
        for c in written:
            total += c.to(device) - central
        return total
    stacked = torch.stack([c.to(device, torch.float64) for c in written])
    mean = stacked.mean(0)
    if not (central.is_floating_point() or central.is_complex()):
        mean = mean.round()
    return mean.to(central.dtype)


class _BufferLanding:
    """A run's written buffers, combined into the central ones once their copies from the
    replicas have arrived (``events``)."""

    __slots__ = ("store", "writes", "events")

    def __init__(self, store: "ParameterStore", writes: list, events: list):
        self.store, self.writes, self.events = store, writes, events

    def land(self) -> None:
        for event in self.events:
            event.synchronize()
        with torch.no_grad():
            for owner, name, central, agg, copies in self.writes:
                new = _aggregate(central, copies, agg, owner.path(name))
                if new is central:
                    continue
                if central is not None and new.shape == central.shape:
                    central.copy_(new)
                else:
                    dict.__setitem__(owner, name, self.store.place(new))


# -- the store --------------------------------------------------------------------------
class ParameterStore:
    """Everything a strategy keeps about its central parameters and replica copies."""

    def __init__(self, parameter_device, compute_devices, copy_parameters: bool | None):
        self.parameter_device = parameter_device
        self.compute_devices = list(compute_devices)
        self._torch_param = parameter_device.torch_device
        self._tensors: "weakref.WeakValueDictionary[int, torch.Tensor]" = \
            weakref.WeakValueDictionary()
        self._order: dict[int, int] = {}  # id -> creation sequence number
        self._generation = 0
        # reentrant: a tensor freed by a garbage collection that runs while this thread
        # holds the lock calls forget, which takes it too
        self._lock = threading.RLock()
        self.torch_devices = [d.torch_device for d in self.compute_devices]
        self._replica_ids = range(len(self.compute_devices))
        self.copies = [self._needs_copy(d, copy_parameters) for d in self.compute_devices]
        # One replica on the parameter device is served the central tensors themselves:
        # its gradients accumulate straight into .grad, as in a plain loop, with no leaf
        # to keep in step and nothing to hand over (docs/performance.md).
        self.direct = self.copies == [False]
        # Per replica, the leaves it was ever served (the latest per central tensor),
        # id(central) -> (weakref to central, leaf): an alias cache, and what a flush
        # reads, since a backward through a run's outputs may come after later runs that
        # read other parameters. Weak, and pruned when a central tensor is freed, so a
        # deleted model does not live on in its replicas' aliases (:meth:`forget`).
        self._aliases: list[dict] = [{} for _ in self.compute_devices]
        self._mirrors: list = [None] * len(self.compute_devices)
        # whether an alias or a mirror was ever made: until then a run has no replica
        # leaf to hand a gradient over from, nor outputs to watch (asked three times a
        # run, and by the strategy before watch_outputs: one attribute, no call)
        self.has_leaves = False
        self._buffer_mirrors: list = [None] * len(self.compute_devices)
        # the last run's written buffers, on their way from GPUs (land_buffers)
        self._landing: _BufferLanding | None = None
        self._landing_lock = threading.Lock()
        # the most bytes a copy replica moves in one copy (StrategyOptions.bytes_per_pack)
        self.bytes_per_pack = DEFAULT_BYTES_PER_PACK
        # a run's gradients still on their way from GPUs (offload.py)
        self._arrival: offload.Arrival | None = None
        self._run_ended = False  # finish_run's flush, which may leave gradients arriving
        self._followed: set[int] = set()  # ids of the tensors whose end :meth:`forget` sees
        # In a run, finish_run collects the leaves' gradients; outside one, a hook on
        # the run's outputs has them collected at the end of the backward through them.
        self._running = False
        self._queued_task = None  # the backward whose end already flushes
        self._late_hook = _late_backward_hook(weakref.ref(self))  # weak: graphs outlive runs
        # id(central) -> this run's leaf, per replica: what compiled code reads (filled
        # by the first compiled read, then renewed by every begin_run)
        self.compiled_leaves: list[dict] = [{} for _ in self.compute_devices]
        # ids of the central tensors each alias replica read in the last run: served
        # again before the next run's replicas start (:meth:`_serve_again`)
        self._last_read: Sequence = [() for _ in self.compute_devices]
        self._read_nothing = tuple(self._last_read)  # a run's that read nothing
        # the last run's servings when it served its replicas nothing and they wrote
        # nothing: as good as new, so the next run takes them (finish_run / begin_run)
        self._spare: list | None = None
        # the modules whose dicts this store swapped (weakly: a deleted model is freed)
        self._adopted: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        # ids of the tracked tensors that carry gradient hooks (see note_hooks)
        self._hooked: set[int] = set()
        # ids of the tensors registered since the last run began: served before the next
        # (a first read inside torch.func.vmap cannot make a leaf there)
        self._fresh: list[int] = []
        # Built on the CPU, still there: what modules register in scope while the
        # parameter device is elsewhere (:meth:`defers`), moved by :meth:`place_pending`
        self._pending: list[torch.Tensor] = []

    def _needs_copy(self, device, copy_parameters: bool | None) -> bool:
        if copy_parameters:
            return True
        return device.torch_device != self._torch_param

    # -- registration --------------------------------------------------------------------
    def adopt(self, module: torch.nn.Module) -> None:
        """Serve ``module``'s parameters and buffers to replicas from now on.

        The served dicts come last: a replica that finds them skips
        :meth:`adopt_in_use` and reads the tensors at once, so they must be tracked."""
        for value in dict.values(tensor_dict(module, "parameter") or {}):
            if value is not None:
                self.register_tensor(value)
        for kind in _KINDS:
            current = tensor_dict(module, kind)
            if current is None or (isinstance(current, ServedDict) and current.store is self):
                continue
            set_tensor_dict(module, kind, ServedDict(dict(current), self, module, kind))
            self._adopted.add(module)

    def adopt_in_use(self, module: torch.nn.Module) -> None:
        """``module`` was called inside one of this store's replicas, but it (or a module
        in it) was built outside the strategy's scope: serve it from now on exactly as if
        it had been built there (parameters central, buffers per replica, BatchNorm
        synchronized). Its tensors stay the same objects (an optimizer made before keeps
        working). Every replica's first call of it comes here before the module runs, so
        none reads it unserved; the lock lets one adopt and the others find it done. A
        replica that finds the served dicts does not come here: they are set last.

        Raises:
          RuntimeError: naming the module, when it lives on another device than the
            parameter device, belongs to another strategy, or its dicts are not torch's.
        """
        if _compiled_type is not None and isinstance(module, _compiled_type):
            module = torch_internals.compiled_original(module)
        subs = list(module.named_modules())
        # a compiled model comes here on every call: once adopted, without the lock (the
        # served dicts are set last, so one found served is served whole)
        if all(self._serves(sub) for _, sub in subs):
            return
        with self._lock:
            top = type(module).__name__
            for path, sub in subs:
                name = f"{top}.{path} ({type(sub).__name__})" if path else \
                    f"{top}({module.extra_repr()})"
                self._adopt_built_outside(sub, name)

    def _serves(self, module: torch.nn.Module) -> bool:
        """``module`` has no tensors of its own, or this store serves them."""
        dicts = torch_internals.tensor_dicts(module)
        return not any(dicts) or all(isinstance(d, ServedDict) and d.store is self
                                     for d in dicts)

    def _adopt_built_outside(self, module: torch.nn.Module, what: str) -> None:
        if self._serves(module):
            return
        dicts = torch_internals.tensor_dicts(module)
        if any(isinstance(d, ServedDict) for d in dicts):
            raise RuntimeError(
                f"{what} was built in another strategy's scope; a module is served by one "
                "strategy: build it (or a copy) in this strategy's scope")
        if any(d is not None and type(d) is not type(plain_tensor_dict(())) for d in dicts):
            raise RuntimeError(f"{what} was built outside strategy.scope() and holds its "
                               "tensors in a dict csrun cannot serve; build it inside the scope")
        for tensor in [t for d in dicts for t in dict.values(d) if t is not None]:
            if tensor.device != self._torch_param:
                raise RuntimeError(
                    f"{what} was built outside strategy.scope() and lives on "
                    f"{tensor.device}, but the strategy keeps parameters on "
                    f"{self.parameter_device.short_name}; build (or load) it inside "
                    "`with strategy.scope():`, which places it there")
        sync_batch_norm.install(module)  # before adopt serves it: see adopt_in_use
        self.adopt(module)

    def release_modules(self) -> None:
        """Give the modules this store adopted their plain dicts and their class's
        BatchNorm forward back (its strategy is gone): those still alive and not adopted
        by another store since live on as plain torch modules, on the parameter device."""
        self.land_buffers()
        for module in list(self._adopted):
            owned = False
            for kind in _KINDS:
                current = tensor_dict(module, kind)
                if isinstance(current, ServedDict) and current.store is self:
                    set_tensor_dict(module, kind, plain_tensor_dict(dict.items(current)))
                    owned = True
            if owned:
                sync_batch_norm.uninstall(module)
        self._adopted.clear()

    def stand_in(self, module: torch.nn.Module, name: str,
                 param: torch.Tensor) -> torch.Tensor | None:
        """What ``module`` (built in scope) holds as its parameter ``name`` instead of
        ``param``, or None (``param``, placed on the parameter device). A parameter-server
        job's worker answers a stand-in for a table the ps tasks will make
        (:mod:`csrun.core.cluster.deferred_table`)."""
        return None

    def register_tensor(self, tensor: torch.Tensor) -> None:
        """Track a central trainable tensor (for coalesced copies to replica devices)."""
        with self._lock:
            if self._tensors.get(id(tensor)) is not tensor:
                self._tensors[id(tensor)] = tensor
                self._generation += 1
                self._order[id(tensor)] = self._generation
                self._follow(tensor)
                self._fresh.append(id(tensor))
                if any(torch_internals.grad_hooks(tensor)):
                    self._hooked.add(id(tensor))

    def note_hooks(self, tensor: torch.Tensor) -> None:
        """A hook was registered on ``tensor``: if tracked, its gradients from replicas
        are summed first and then run through its hooks (:meth:`flush_pending`)."""
        if self.owns(tensor):
            self._hooked.add(id(tensor))

    def _follow(self, tensor: torch.Tensor) -> None:
        """Call :meth:`forget` when ``tensor`` is freed (once per tensor)."""
        if id(tensor) not in self._followed:
            self._followed.add(id(tensor))
            weakref.finalize(tensor, _forget, weakref.ref(self), id(tensor)).atexit = False

    def adopted_modules(self) -> list[torch.nn.Module]:
        """The modules whose dicts this store swapped (alive now)."""
        return list(self._adopted)

    def serve_when_read(self, keys: set[int]) -> None:
        """Serve the tracked tensors of ids ``keys`` to replicas only when read, never
        ahead of a run (a ps job's embedding tables: a read of one is refused)."""
        self._fresh = [key for key in self._fresh if key not in keys]

    def drop_alias_grads(self, replica_id: int, keys: set[int]) -> None:
        """Forget the gradients replica ``replica_id``'s aliases of ``keys`` received."""
        aliases = self._aliases[replica_id]
        for key in keys:
            entry = aliases.get(key)
            if entry is not None:
                entry[1].grad = None

    def tensors(self) -> list[torch.Tensor]:
        """The tracked central tensors in creation order (TF places variables in it),
        on the parameter device (:meth:`place_pending` first)."""
        self.place_pending()
        with self._lock:
            alive = [(self._order[i], t) for i, t in self._tensors.items()]
        return [t for _, t in sorted(alive, key=lambda pair: pair[0])]

    def owns(self, tensor: torch.Tensor) -> bool:
        return self._tensors.get(id(tensor)) is tensor

    def name_of(self, tensor: torch.Tensor) -> str:
        """``Module.name`` of a tracked tensor, for messages (a scan: error paths only)."""
        for module in list(self._adopted):
            for name, value in dict.items(tensor_dict(module, "parameter") or {}):
                if value is tensor:
                    return f"{type(module).__name__}.{name}"
        return f"a tensor of shape {tuple(tensor.shape)}"

    def holds_buffer(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a buffer of a module this store serves (a scan: for
        cross-replica checks, not hot paths)."""
        for module in list(self._adopted):
            buffers = tensor_dict(module, "buffer")
            if isinstance(buffers, ServedDict) and buffers.store is self and any(
                    b is tensor for b in dict.values(buffers)):
                return True
        return False

    def before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called before any ``optimizer.step()``: tensors still on the CPU placed (the
        optimizer's state is made next to them), gradients still on replicas collected."""
        self.place_pending()
        self.flush_pending()

    def step_by_bucket(self, optimizer: torch.optim.Optimizer, args: tuple,
                       kwargs: dict) -> None:
        """Called next: gradients still on their way from GPUs are stepped bucket by
        bucket as they arrive, the optimizer's groups split for this step
        (:mod:`.offload`), or waited for here. ``args``, ``kwargs``: the step's."""
        arrival = self._arrival
        if arrival is None or not any(arrival.owns(p) for group in optimizer.param_groups
                                      for p in group["params"]):
            return
        reason = offload.why_not_by_bucket(optimizer, args, kwargs)
        if reason is not None:
            offload.warn_not_by_bucket(optimizer, reason)
        if reason is not None or not offload.step_by_bucket(optimizer, arrival):
            self._land_arrival()

    def _land_arrival(self) -> None:
        """Wait for the gradients still on their way (before any others are added)."""
        arrival, self._arrival = self._arrival, None
        if arrival is not None:
            arrival.land_all()

    @property
    def generation(self) -> int:
        return self._generation

    def defers(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``, registered by a module in scope, stays where it was built
        for now: on the CPU, for a parameter device elsewhere. The module's own
        initialization (``reset_parameters``) then draws from the CPU generator, as
        ``torch.manual_seed(s); Net().to(device)`` does, so the same seed gives the same
        model on any parameter device; :meth:`place_pending` moves it when the scope
        ends or the store is first used. Built under ``torch.device("meta")`` it is
        allocated on the parameter device at once and initialized there (the opt-out
        for models too big to build on the host: docs/performance.md)."""
        return (tensor.is_cpu and self._torch_param.type != "cpu"
                and context.current_entry().replica is None)  # not built inside a run

    def defer(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self._pending.append(tensor)
        _deferring.add(self)

    def place_pending(self) -> None:
        """Move the tensors built on the CPU in scope to the parameter device, in place
        (``tensor.data``: the same objects, which an optimizer made in scope holds)."""
        if not self._pending:
            return
        with self._lock:
            pending, self._pending = self._pending, []
            _deferring.discard(self)
        for tensor in pending:
            # not one the user moved there, nor a lazy module's (it has no data yet)
            if tensor.device != self._torch_param and not is_lazy(tensor):
                _move_in_place(tensor, self._torch_param)

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on the parameter device (the same object when already there).

        A ``meta`` tensor has no data to copy: it becomes uninitialized storage, which the
        module's own initialization fills right after registration.
        """
        if tensor.device == self._torch_param:
            return tensor
        if tensor.is_meta:
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=self._torch_param)
        return tensor.to(self._torch_param)

    # -- runs ----------------------------------------------------------------------------
    def begin_run(self, reads: bool = True) -> list["ReplicaServing"]:
        """Each replica's serving for a new run; ``reads=False``: a run that only
        backpropagates earlier outputs (nothing is served ahead of it)."""
        if _eager_serve is None and torch_internals.COMPILER in sys.modules:  # (in use)
            _prepare_for_compile()
        if self._pending:
            self.place_pending()
        if self._landing is not None:
            self.land_buffers()
        direct = self.direct  # no leaves to flush or serve ahead: the central tensors
        if not direct and self.has_leaves:  # (flush_pending's own check, without its call)
            self.flush_pending()
        self._running = True
        servings, self._spare = self._spare, None
        if servings is None:
            servings = [ReplicaServing(self, r) for r in self._replica_ids]
        else:  # kept without their store (finish_run): theirs again
            for serving in servings:
                serving.store = self
        if not reads:
            return servings
        if any(self.compiled_leaves):
            self._serve_compiled(servings)
        elif not direct and (self._fresh or any(self._last_read)):  # else nothing to serve
            self._serve_again(servings)
        return servings

    def _serve_again(self, servings: list["ReplicaServing"]) -> None:
        """Serve each alias replica, before it starts, the parameters it read in the
        last run (the same step again, as a training loop runs it).

        A first read inside a replica passes ``Module.__getattr__``, the served dict and
        :meth:`ReplicaServing.serve` while the other replicas want the GIL too: in
        timelines of the MLP each took ~13 µs there (75 µs of each replica's forward)
        against ~2 µs here. The leaves are the ones a read would give (the alias cache
        checks each against its central tensor); they count as read, and are recorded
        for the next run, only once read (:meth:`ReplicaServing.served`), and a merge
        drops the unread ones. Tensors registered since the last run are served too
        (their leaves are made here, not at a first read inside ``torch.func.vmap``, which
        refuses ``requires_grad_``). One that moved device (an error the read reports) is
        still served on read."""
        place = self._torch_param
        fresh, self._fresh = self._fresh, []
        for serving in servings:
            if serving.direct:
                continue
            if serving.copies:  # the flat copies laid out before any read (see _fresh)
                if fresh:
                    self.mirror(serving.replica_id).prepare(self)
                continue
            ready, aliases = serving.ready, self._aliases[serving.replica_id]
            for key in self._last_read[serving.replica_id]:
                entry = aliases.get(key)
                central = entry[0]() if entry is not None else None
                if central is not None and central.device == place:
                    ready[key] = (central, serving.alias_leaf(central))
            for key in fresh:  # never read yet: made now, outside any transform
                central = self._tensors.get(key)
                if central is not None and central.device == place and key not in ready:
                    ready[key] = (central, serving.alias_leaf(central))

    def _serve_compiled(self, servings: list["ReplicaServing"]) -> None:
        """Serve every tracked tensor now, as a read would (mirrors refreshed, leaves
        remade where the central tensor changed): compiled code reads them from
        :attr:`compiled_leaves` without running :meth:`ReplicaServing.serve`."""
        tensors = self.tensors()
        self._fresh = []  # every tensor is served here
        for serving, leaves in zip(servings, self.compiled_leaves):
            for central in tensors:
                leaves[id(central)] = serving._leaf(central)

    def finish_run(self, servings: list["ReplicaServing"], reads: bool = True) -> None:
        """Sum the replicas' gradients into the central ones; combine written buffers.
        ``reads=False``: a run that only backpropagated, whose reads (none) are not the
        next run's to serve ahead."""
        # untouched: nothing served or written, so nothing to check, combine or serve
        # ahead (and the servings are as good as new for the next run)
        untouched = ReplicaServing.untouched(servings)
        if not untouched:
            self._check_and_combine(servings, reads)
        elif reads:
            self._last_read = self._read_nothing
        self._running = False
        if not self.direct and self.has_leaves:  # (flush_pending's own check)
            self._run_ended = True  # this flush may leave gradients arriving (offload.py)
            try:
                self.flush_pending()
            finally:
                self._run_ended = False
        if untouched:  # kept for the next run without their store: a store that held
            for serving in servings:  # servings pointing back at it would be a cycle,
                serving.store = None  # freed only by the collector once dropped
            self._spare = servings

    def _check_and_combine(self, servings: list["ReplicaServing"], reads: bool) -> None:
        for serving in servings:
            if serving.overrides:
                serving.check_no_override()
            if serving.copies:
                serving.check_copies_unwritten()
        if reads:
            self._last_read = [tuple(s.params) for s in servings]
        for serving in servings:
            if serving.combine:
                self._aggregate_buffers(servings)
                break

    def watch_outputs(self, outputs: list) -> None:
        """A backward through these outputs of a run may come after it: have the end of
        that backward collect the leaves' gradients. One pre-hook per output's grad_fn;
        an output that is itself a leaf (a returned parameter) gets a post-accumulate
        hook instead, which stays on it (and takes the GIL in later runs' backwards)."""
        # No replica leaf exists (nothing served yet): no graph of these outputs can
        # reach one. The usual outputs, detached losses (tensors that need no grad): no
        # graph to walk.
        if self.direct or not self.has_leaves or all(
                [type(o) is torch.Tensor and not o.requires_grad for o in outputs]):
            return
        hook = self._late_hook
        for tensor in _graph_tensors(outputs, set()):
            node = tensor.grad_fn
            if node is None:  # a leaf that requires grad
                if not torch_internals.has_post_accumulate_grad_hook(tensor, hook):
                    tensor.register_post_accumulate_grad_hook(hook)
                continue
            marks = node.metadata
            if marks.get("csrun_late_hook") is not hook:  # once per node
                marks["csrun_late_hook"] = hook
                node.register_prehook(hook)

    def discard_run(self, servings: list["ReplicaServing"]) -> None:
        """Forget what a failed run's replicas produced (earlier runs' leaves stay
        watched: their outputs may still be backpropagated)."""
        self._running = False
        for serving in servings:
            serving.clear_grads()

    def flush_pending(self) -> None:
        """Add the gradients that any replica leaf received since the last flush: after
        a run, when its replicas meet in ``merge_call``, and a backward through any
        earlier run's outputs (gradient accumulation over several runs).

        Every replica's transfer starts before any is waited for (so copies from several
        devices overlap); they are added in replica order, so the sum is deterministic.
        At a run's end, gradients still on their way from GPUs may stay so, in ``.grad``
        as :class:`.offload.ArrivingGrad` (see :meth:`_may_arrive_later`).
        """
        if not self.has_leaves:  # no leaves (yet), or direct
            return
        # locked: a backward's callback may flush on an autograd thread, and two flushes
        # taking the same leaf gradient would add it twice
        with self._lock:
            started = [self._start_leaf_grads(r) for r in range(len(self.compute_devices))]
            if not any(started):  # nothing new since the last flush: the usual re-check
                return
            self._land_arrival()  # the earlier gradients first: added in order
            if self._run_ended and self._may_arrive_later(started):
                for mirror in self._mirrors:  # code after run may write the parameters
                    if mirror is not None:
                        mirror.copied_in()
                self._arrival = offload.Arrival(started)
                self._arrival.place()
                return
            with torch.no_grad():
                held = {} if self._hooked else None  # hooked tensors: summed, then hooked
                for replica_id, transfers in enumerate(started):
                    if transfers:
                        centrals, grads = self._finish_leaf_grads(replica_id, transfers)
                        if held is not None:
                            centrals, grads = _hold(centrals, grads, self._hooked, held)
                        accumulate(centrals, grads)
                if held:
                    _accumulate_hooked(held.values())

    def _may_arrive_later(self, started: list) -> bool:
        """Whether a run's gradients may land after it returns: every one is on its way
        from a GPU (a copy with an event), and lands as the synchronous path would add
        it -- into no earlier gradient, through no hook of the user's."""
        for replica_id, transfers in enumerate(started):
            if not transfers:
                continue
            if not self.copies[replica_id]:
                return False
            for pairs, _, event in transfers:
                if event is None:
                    return False
                for central, _ in pairs:
                    if central.grad is not None or id(central) in self._hooked:
                        return False
        return True

    def flush_after_backward(self) -> None:
        """A leaf got a gradient outside a run: flush when the current backward ends
        (once per backward, however many leaves it reaches)."""
        task = torch_internals.current_backward_id()
        if task != self._queued_task:
            self._queued_task = task
            torch_internals.queue_backward_callback(self._flush_queued)

    def _flush_queued(self) -> None:
        self._queued_task = None
        self.flush_pending()

    def _start_leaf_grads(self, replica_id: int) -> list:
        if self.copies[replica_id]:
            mirror = self._mirrors[replica_id]
            if mirror is None:
                return []
            with torch.no_grad():  # grads made with create_graph=True must not be traced
                return mirror.start_grads()
        pairs = []
        # a copy: a collection during the loop may free a tensor, and _forget prunes
        for ref, leaf in list(self._aliases[replica_id].values()):
            if leaf.grad is not None:
                central = ref()
                if central is not None:
                    pairs.append((central, leaf.grad))
                leaf.grad = None
        return pairs

    def _finish_leaf_grads(self, replica_id: int, transfers: list) -> tuple[list, list]:
        """The central tensors and their gradients (transfers from a replica's mirror
        arrive; an alias replica's pairs are already on the parameter device)."""
        if self.copies[replica_id]:
            return finish_grads(transfers)
        return [c for c, _ in transfers], [g for _, g in transfers]

    def _aggregate_buffers(self, servings: list["ReplicaServing"]) -> None:
        """Combine the buffers the replicas wrote into the central ones. A copy
        replica's written copies come to the parameter device in one copy per dtype
        (:meth:`ReplicaServing.send_buffers`); from a GPU to the CPU they land when the
        central buffers are next read (:meth:`land_buffers`), not now: waiting here would
        wait for the GPU's whole backward, which the CPU optimizer overlaps."""
        keys: dict = {}
        for serving in servings:
            for key, entry in serving.buffers.items():
                keys.setdefault(key, entry[3])
        if not keys:
            return
        writes = []  # (owner, name, central, aggregation, each replica's written copy)
        for key, owner in keys.items():
            name = key[1]
            copies = [s.written_buffer(key) for s in servings]
            if all(c is None for c in copies):
                continue
            central = dict.__getitem__(owner, name)
            agg = get_aggregation(owner.module(), name, central)
            if agg is VariableAggregation.NONE:  # refused now, not when it lands
                _aggregate(central, copies, agg, owner.path(name))
            writes.append((owner, name, central, agg, copies))
        if not writes:
            return
        events = []
        for r, serving in enumerate(servings):
            if serving.copies:
                arrived, waits = serving.send_buffers([w[4][r] for w in writes])
                events += waits
                for write in writes:
                    copy = write[4][r]
                    if copy is not None:
                        write[4][r] = arrived.get(id(copy), copy)
        landing = _BufferLanding(self, writes, events)
        if events:
            self._landing = landing
        else:
            landing.land()

    def land_buffers(self) -> None:
        """Combine the buffers written by the last run whose copies were still on their
        way from a GPU (before the central buffers are read: the next run, or a read of
        a served buffer dict outside replicas)."""
        with self._landing_lock:
            landing, self._landing = self._landing, None
            if landing is not None:
                landing.land()

    # -- replica views -------------------------------------------------------------------
    def alias(self, replica_id: int, central: torch.Tensor) -> torch.Tensor:
        """A leaf sharing ``central``'s storage, cached per replica.

        Remade when ``central`` got new data (``p.data = ...``), or was frozen or unfrozen
        (``requires_grad_``). Keyed by id, holding ``central``: a tensor's ``__hash__`` is
        Python code, and this runs for every parameter of every run.
        """
        cache = self._aliases[replica_id]
        entry = cache.get(id(central))
        if entry is not None and entry[0]() is central:
            leaf = entry[1]
            if (leaf.data_ptr() == central.data_ptr() and leaf.shape == central.shape
                    and leaf.dtype == central.dtype
                    and leaf.requires_grad == central.requires_grad):
                return leaf
        leaf = central.detach().requires_grad_(central.requires_grad)
        cache[id(central)] = (weakref.ref(central), leaf)
        self.has_leaves = True
        self._follow(central)
        return leaf

    def buffer_mirror(self, replica_id: int) -> BufferMirror:
        mirror = self._buffer_mirrors[replica_id]
        if mirror is None:
            mirror = BufferMirror(self.compute_devices[replica_id].torch_device,
                                  self._torch_param)
            self._buffer_mirrors[replica_id] = mirror
        return mirror

    def mirror(self, replica_id: int) -> DeviceMirror:
        mirror = self._mirrors[replica_id]
        if mirror is None:
            mirror = DeviceMirror(self.compute_devices[replica_id].torch_device,
                                  self._torch_param, self.bytes_per_pack)
            self._mirrors[replica_id] = mirror
            self.has_leaves = True
        return mirror

    def forget(self, key: int) -> None:
        """The tracked tensor ``id`` ``key`` was freed: drop its replicas' alias leaves.

        Device mirrors (copies) still hold their tensors: rebuilding a mirror when one is
        freed would orphan leaves that a run or a late backward still uses (found in
        review), so a model served through copies lives as long as its strategy."""
        self._followed.discard(key)
        self._hooked.discard(key)
        for cache in self._aliases:
            cache.pop(key, None)
        for leaves in self.compiled_leaves:
            leaves.pop(key, None)
        with self._lock:
            self._order.pop(key, None)

    def check_device(self, central: torch.Tensor, owner: "ServedDict", name: str) -> None:
        if central.device != self._torch_param:
            raise RuntimeError(
                f"{owner.path(name)} lives on {central.device}, but the strategy keeps "
                f"parameters on {self.parameter_device.short_name}; models created in "
                "strategy.scope() must not be moved with .to()/.cuda() -- the strategy "
                "places them")


class ReplicaServing:
    """What one replica of one run has been served, and what it wrote."""

    __slots__ = ("store", "replica_id", "device", "copies", "direct", "params", "ready",
                 "buffers", "combine", "overrides", "slow", "_mirror", "_stale", "_force",
                 "_buffers_mirror")

    def __init__(self, store: ParameterStore, replica_id: int):
        self.store = store
        self.replica_id = replica_id
        self.device = store.torch_devices[replica_id]
        self.copies = store.copies[replica_id]
        self.direct = store.direct
        # id(central) -> (central, leaf) read this run (ids: a tensor's hash is Python)
        self.params: dict = {}
        # the same, served before the run began and not read yet (ParameterStore.
        # _serve_again): moved to params by the first read, dropped by a merge
        self.ready: dict = {}
        # (id of owner dict, name) -> [served tensor, its version when served, written
        # for sure (assigned, or by a kernel that bumps no version), owner dict]
        self.buffers: dict = {}
        self.combine = False  # a buffer was copied or assigned: combine after the run
        self._mirror = None
        self._buffers_mirror = None  # a copy replica's BufferMirror, once it read a buffer
        # (id of owner dict, name) -> (tensor, owner dict) put in a parameter's place for a
        # while (torch.func.functional_call swaps them in and back); this replica's only
        self.overrides: dict = {}
        self.slow = False  # reads must take serve(): stale copies or overrides
        self._stale = False  # a merge may have changed central values since they were copied
        self._force = False  # ... user code (merge_call) did, maybe through .data: copy all

    def serve(self, owner: ServedDict, name: str, value: torch.Tensor) -> torch.Tensor:
        if owner.kind == "parameter":
            if self.overrides:
                override = self.overrides.get((id(owner), name))
                if override is not None:
                    return override[0]
            if self.direct:  # nothing to track: only the device can be wrong
                if value.device != self.device:
                    self.store.check_device(value, owner, name)
                return value
            served = self.served(id(value))
            if served is None:
                self.store.check_device(value, owner, name)
                return self._leaf(value)
            if self._stale:
                self._refresh_copies()
            return served[1]
        return self._buffer(owner, name, value)

    @staticmethod
    def untouched(servings: list["ReplicaServing"]) -> bool:
        """Whether these servings are still as :meth:`__init__` made them: their run
        served the replicas nothing and the replicas wrote nothing (a run that reads no
        parameters builds none: :meth:`ParameterStore.begin_run` takes them again). One
        frame for all: every run asks."""
        for s in servings:
            if (s.params or s.ready or s.buffers or s.overrides or s.combine or s.slow
                    or s._stale or s._force or s._mirror is not None
                    or s._buffers_mirror is not None):
                return False
        return True

    def served(self, key: int) -> tuple | None:
        """``(central, leaf)`` for the tracked tensor ``id`` ``key`` if this run has
        served it (a leaf served before the run counts as read from now on)."""
        served = self.params.get(key)
        if served is None and self.ready:
            served = self.ready.pop(key, None)
            if served is not None:
                self.params[key] = served
        return served

    def serve_tensor(self, central: torch.Tensor) -> torch.Tensor:
        """The replica's leaf for a tracked tensor that is not in a module (a Variable)."""
        served = self.served(id(central))
        if served is None:
            return self._leaf(central)
        if self._stale:
            self._refresh_copies()
        return served[1]

    def invalidate(self, by_user: bool = True) -> None:
        """Central values may have changed in cross-replica context (a merge_call):
        parameters not read yet are served on read again, checked against their central
        tensors as they are now (new data, frozen), as a run's first read is. Copies are
        refreshed before their next read: all of them after user code (``by_user``),
        else those whose tensors changed version (csrun's own variable updates)."""
        self.ready.clear()
        if self.copies and self._mirror is not None:
            self._stale = self.slow = True
            self._force = self._force or by_user

    def _refresh_copies(self) -> None:
        self._stale, force, self._force = False, self._force, False
        self.slow = bool(self.overrides)
        with torch.no_grad():
            self._mirror.refresh(self.store, reset_grads=False, force=force)

    def check_copies_unwritten(self) -> None:
        """A copy replica wrote a parameter in place (the write would be lost: the central
        tensor is another): say which, and where to do it instead."""
        written = self._mirror.written() if self._mirror is not None else []
        if written:
            names = ", ".join(self.store.name_of(t) for t in written)
            raise RuntimeError(
                f"replica {self.replica_id} wrote parameter(s) {names} in place; it computes "
                "on a copy, so the write would not reach the parameter (one on the "
                "parameter's own device would write it once per replica). Update "
                "parameters in cross-replica context (after run, or in merge_call), or "
                "keep such state in a buffer (combined by csrun.core.set_aggregation)")

    def _leaf(self, central: torch.Tensor) -> torch.Tensor:
        if self.copies:
            if self._mirror is None:  # the run's first read: everything is copied
                self._mirror = self.store.mirror(self.replica_id)
                self._mirror.refresh(self.store, force=True)
            elif self._stale:
                self._refresh_copies()
            try:
                leaf = self._mirror.leaf(central)
            except KeyError:  # registered after this run's first copy
                self._refresh_copies()
                leaf = self._mirror.leaf(central)
        elif self.direct:
            leaf = central
        else:
            leaf = self.alias_leaf(central)
        self.params[id(central)] = (central, leaf)
        return leaf

    def alias_leaf(self, central: torch.Tensor) -> torch.Tensor:
        """This replica's alias of ``central`` for a new run: no gradient yet (the last
        run's was flushed into the central ``.grad``)."""
        leaf = self.store.alias(self.replica_id, central)
        leaf.grad = None
        return leaf

    def _buffer(self, owner: ServedDict, name: str, value: torch.Tensor) -> torch.Tensor:
        key = (id(owner), name)  # dicts are unhashable; the entry keeps the owner alive
        entry = self.buffers.get(key)
        if entry is None:
            if self.direct and not _aggregated_none(owner, name, value):
                # one replica on the parameter device writes the buffer itself, as a
                # plain loop does: nothing to copy, nothing to combine
                served = value
            else:
                served = self._buffer_mirror().serve(value) if self.copies else None
                if served is None:  # an alias replica's, or one new to the mirror
                    # never an inference tensor, even inside torch.inference_mode: those
                    # keep no version, which tells whether the replica wrote its copy
                    with torch.inference_mode(False):
                        served = value.to(self.device, copy=True)
                self.combine = True
            entry = self.buffers[key] = [served, tensor_version(served),
                                         _written_by_kernel(owner, name), owner]
        return entry[0]

    def _buffer_mirror(self):
        """This replica's :class:`BufferMirror`, begun for this run on first use."""
        mirror = self._buffers_mirror
        if mirror is None:
            mirror = self._buffers_mirror = self.store.buffer_mirror(self.replica_id)
            mirror.new_run()
        return mirror

    def send_buffers(self, written: list) -> tuple[dict, list]:
        """This replica's written buffer copies on the parameter device (see
        :meth:`BufferMirror.send`); ``({}, [])`` without a mirror."""
        mirror = self._buffers_mirror
        return ({}, []) if mirror is None else mirror.send(written)

    def assign(self, owner: ServedDict, name: str, value) -> None:
        if owner.kind == "parameter":
            if not dict.__contains__(owner, name):  # a module created inside the replica
                dict.__setitem__(owner, name, value)
                return
            # In this replica only, and only for a while (torch.func.functional_call swaps
            # tensors in, then puts back what it read): one still there when the run ends
            # is refused then (finish_run)
            central = dict.__getitem__(owner, name)
            served = self.params.get(id(central))
            key = (id(owner), name)
            if value is central or (served is not None and value is served[1]):
                self.overrides.pop(key, None)
            else:
                self.overrides[key] = (value, owner)
            self.slow = self._stale or bool(self.overrides)
            return
        self.buffers[(id(owner), name)] = [value, None, True, owner]
        self.combine = True

    def check_no_override(self) -> None:
        """A parameter replaced in the replica and not put back: refused (the others
        would never see it; parameters are updated once, in cross-replica context)."""
        for (_, name), (_, owner) in self.overrides.items():
            raise RuntimeError(
                f"cannot replace parameter {owner.path(name)} inside a replica: parameters are "
                "updated once, in cross-replica context (optimizer.step() after run); "
                "torch.func.functional_call, which puts them back, is fine")

    def written_buffer(self, key) -> torch.Tensor | None:
        """This replica's copy of a buffer if the replica changed it, else None: it was
        assigned, its version counter moved (every in-place op, ``copy_``, ``+=``), or a
        kernel known to write it without a version bump was fed it
        (:func:`_written_by_kernel`). Never by comparing values: that waits for the
        device on every buffer of every step. A write through ``.data`` bumps no
        version and is not seen (docs/performance.md)."""
        entry = self.buffers.get(key)
        if entry is None:
            return None
        copy, version, flagged, _ = entry
        return copy if flagged or tensor_version(copy) != version else None

    def clear_grads(self) -> None:
        """Drop a failed run's gradients. A direct replica's are already in the central
        .grad, mixed with any accumulated before: they stay, as in a plain loop."""
        if self.direct:
            return
        for _, leaf in self.params.values():
            leaf.grad = None


def _late_backward_hook(store_ref: "weakref.ref[ParameterStore]"):
    """The hook on run outputs (a grad_fn pre-hook, or a post-accumulate hook on an
    output that is a leaf): a backward outside a run flushes at its end (inside one,
    the run's end collects)."""
    def hook(_) -> None:
        store = store_ref()
        if store is not None and not store._running:
            store.flush_after_backward()
    return hook


def _graph_tensors(outputs: Any, seen: set):
    """Every tensor that requires grad in a nest of run outputs: the tuples, lists and
    dicts :func:`flatten` walks, and inside its leaves, dataclasses and whatever torch's
    pytree knows (``seen``: such containers already walked)."""
    for leaf in flatten(outputs):
        if isinstance(leaf, torch.Tensor):
            if leaf.requires_grad:
                yield leaf
        elif leaf is not None and not isinstance(leaf, _SCALARS) and id(leaf) not in seen:
            seen.add(id(leaf))
            yield from _graph_tensors(_contents(leaf), seen)


_SCALARS = (int, float, complex, str, bytes, bool)


def _contents(value: Any) -> list:
    """A dataclass's fields or a pytree container's leaves; [] for anything else."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [getattr(value, f.name, None) for f in dataclasses.fields(value)]
    leaves = torch_internals.pytree_leaves(value)
    return [] if len(leaves) == 1 and leaves[0] is value else leaves


def _forget(store_ref: "weakref.ref[ParameterStore]", key: int) -> None:
    """A tracked tensor was freed: :meth:`ParameterStore.forget` it, if the store lives."""
    store = store_ref()
    if store is not None:
        store.forget(key)


def accumulate(centrals: list, grads: list) -> None:
    """``central.grad += grad`` for each pair; steals ``grad`` where there is none yet."""
    existing_p, existing_g = [], []
    for central, grad in zip(centrals, grads):
        if central.grad is None:
            central.grad = grad
        else:
            existing_p.append(central.grad)
            existing_g.append(grad)
    if existing_p:
        torch_internals.foreach_add_(existing_p, existing_g)


def _hold(centrals: list, grads: list, hooked: set, held: dict) -> tuple[list, list]:
    """Set aside the gradients of hooked tensors (summed in replica order into ``held``);
    the others are returned to be accumulated at once."""
    rest_c, rest_g = [], []
    for central, grad in zip(centrals, grads):
        if id(central) in hooked:
            before = held.get(id(central))
            held[id(central)] = (central, grad if before is None else before[1] + grad)
        else:
            rest_c.append(central)
            rest_g.append(grad)
    return rest_c, rest_g


def _accumulate_hooked(items) -> None:
    """As torch's backward does for a leaf: its hooks on the gradient, the accumulation,
    then its post-accumulate hooks (here on the sum of the replicas' gradients)."""
    for central, grad in items:
        pre, post = torch_internals.grad_hooks(central)
        for hook in pre:
            changed = hook(grad)
            if changed is not None:
                grad = changed
        accumulate([central], [grad])
        for hook in post:
            hook(central)


def _note_hooks(tensor: torch.Tensor) -> None:
    """A hook was registered on ``tensor`` (see torch_internals.route_hook_registration)."""
    if tensor.grad_fn is None:  # hooks on central tensors (leaves) only
        for store in list(_live_stores):
            store.note_hooks(tensor)


# -- module calls while runs go ---------------------------------------------------------
_torch_module_call = torch.nn.Module.__call__  # torch's own, which ours ends in


def _module_call(module: torch.nn.Module, *args, **kwargs):
    """``Module.__call__`` while a strategy lives: in a replica, a module whose own
    tensors its strategy does not serve (built outside the scope) is adopted first;
    elsewhere torch's runs at once (~0.4 µs a call more than torch's alone)."""
    serving = context.current_serving()
    if serving is None:
        if _deferring:  # a model built in scope, called before the scope ended
            _place_all_pending()
    else:
        if _compiles is False:  # this torch cannot run compiled code in replicas
            if torch_internals.dynamo_tracing():
                _refuse_nested_compile(module)
            module = eager_if_uncompilable(module)
        store = serving.store
        params, buffers = torch_internals.tensor_dicts(module)
        if ((params and (type(params) is not ServedDict or params.store is not store))
                or (buffers and (type(buffers) is not ServedDict or buffers.store is not store))
                or type(module) is _compiled_type) and not torch.compiler.is_compiling():
            store.adopt_in_use(module)
    return _torch_module_call(module, *args, **kwargs)


# -- placement hooks --------------------------------------------------------------------
def _placing_store() -> ParameterStore | None:
    strategy = context.current_entry().strategy
    return None if strategy is None else strategy.extended.store


def _move_in_place(tensor: torch.Tensor, device: torch.device) -> None:
    """``tensor``'s data (and gradient) to ``device``, the object kept, as
    ``Module.to`` moves parameters."""
    with torch.no_grad():
        tensor.data = tensor.data.to(device)
        if tensor.grad is not None:
            tensor.grad = tensor.grad.to(device)


def _place_all_pending() -> None:
    for store in list(_deferring):
        store.place_pending()


def _on_parameter(module: torch.nn.Module, name: str, param):
    store = _placing_store()
    if store is None or param is None:
        return None
    standing = store.stand_in(module, name, param)
    if standing is not None:  # made where it lives (a ps job's table): nothing to place
        store.adopt(module)
        store.register_tensor(standing)
        return standing
    placed = param
    if store.defers(param):
        store.defer(param)
    elif param.device != store.parameter_device.torch_device:
        placed = torch.nn.Parameter(store.place(param.detach()), requires_grad=param.requires_grad)
    store.adopt(module)
    store.register_tensor(placed)
    sync_batch_norm.install(module)
    return placed if placed is not param else None


def _on_buffer(module: torch.nn.Module, name: str, buffer):
    store = _placing_store()
    if store is None or buffer is None:
        return None
    store.adopt(module)
    sync_batch_norm.install(module)
    if store.defers(buffer):
        store.defer(buffer)
        return None
    placed = store.place(buffer)
    return placed if placed is not buffer else None


class _GlobalHooks:
    """torch's process-wide hooks, held while any strategy lives: the registration hooks
    that place what modules register in a scope, :func:`_module_call` in
    ``Module.__call__``, and the check before every ``optimizer.step()``. torch calls
    them for every module and optimizer of the process, so they are installed with the
    first strategy and removed with the last."""

    def __init__(self):
        # reentrant: a collection on the holding thread may free a strategy, whose
        # finalizer releases
        self._lock = threading.RLock()
        self._users = 0
        self._handles: list = []
        self._hook_methods = None  # torch's Tensor.register_hook & co, while ours stand
        # torch's Module.__call__, while ours stands. Held with the strategy, not swapped
        # per run: writing a class attribute of Module invalidates the method caches of
        # all its subclasses (~50 µs a swap and back, more than the rest of a run)
        self._module_call = None

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                self._handles = [
                    nn_module.register_module_parameter_registration_hook(_on_parameter),
                    nn_module.register_module_buffer_registration_hook(_on_buffer),
                    optim_module.register_optimizer_step_pre_hook(_before_optimizer_step)]
                self._hook_methods = torch_internals.route_hook_registration(_note_hooks)
                self._module_call = torch_internals.route_module_calls(_module_call)
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                handles, self._handles = self._handles, []
                for handle in handles:
                    handle.remove()
                torch_internals.restore_hook_registration(self._hook_methods)
                torch_internals.restore_module_calls(self._module_call, _module_call)


_hooks = _GlobalHooks()
_live_stores: "weakref.WeakSet[ParameterStore]" = weakref.WeakSet()
# the stores holding tensors built on the CPU in scope, not placed yet (a model called in
# cross-replica context places them first: _module_call)
_deferring: "weakref.WeakSet[ParameterStore]" = weakref.WeakSet()


def serve_while(strategy: object, store: ParameterStore) -> None:
    """Serve ``store``'s modules while ``strategy`` lives: torch's global hooks held and
    the store seen by every ``optimizer.step()``. When ``strategy`` is garbage collected
    its modules are released (:meth:`ParameterStore.release_modules`), and the hooks go
    with the last strategy."""
    _hooks.acquire()
    _live_stores.add(store)
    weakref.finalize(strategy, _strategy_gone, store).atexit = False


def _strategy_gone(store: ParameterStore) -> None:
    try:
        store.release_modules()
    finally:
        _hooks.release()


def _before_optimizer_step(optimizer, args, kwargs):
    if context.current_entry().replica is not None:
        raise RuntimeError(
            "optimizer.step() was called inside strategy.run; call it after run returns "
            "(cross-replica context), where the replicas' gradients have been summed -- or "
            "inside get_replica_context().merge_call(lambda strategy: optimizer.step())")
    offload.rejoin(optimizer)  # a step that raised left its groups split
    for store in list(_live_stores):
        store.before_optimizer_step(optimizer)
        store.step_by_bucket(optimizer, args, kwargs)
    return None
