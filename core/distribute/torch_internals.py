"""Every private torch API csrun uses, each behind one name that says why.

csrun is a distribution engine laid over eager PyTorch: it serves parameters to replicas,
collects their gradients at the end of a backward and runs replicas as torch's own OpenMP
team. Some of that has no public torch API, or only one too slow for a path taken on every
op or every parameter read. Those uses live here, and nowhere else in csrun (a test reads
the rest of the code and fails naming the file and line of any private use outside this
module), so that a torch upgrade has one place to look at: ``test_torch_internals.py``
fails naming the name and the torch version when torch renamed or changed what it stands
for. docs/torch-internals.md lists them.

Hot paths bind a name from here at import (``_depth = torch_internals.function_mode_depth``):
most of these are torch's own objects under a csrun name, so a call costs what calling
torch's private one directly did.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import os
import struct
import sys
import warnings
from typing import Callable

import torch
import torch.utils._pytree as _pytree
from torch.nn.modules.batchnorm import _BatchNorm
from torch.utils._device import DeviceContext as _DeviceContext

__all__ = [
    "any_autocast_enabled", "InferenceMode", "set_grad_enabled", "function_mode_depth",
    "tensor_dict", "set_tensor_dict", "plain_tensor_dict", "tensor_dicts", "tensor_version",
    "route_module_calls", "restore_module_calls", "compiled_module_type", "compiled_original",
    "has_post_accumulate_grad_hook", "grad_hooks", "TENSOR_PRIVATE_DESCRIPTION",
    "route_hook_registration",
    "restore_hook_registration", "current_backward_id", "queue_backward_callback",
    "foreach_add_", "pytree_leaves", "pytree_node", "pytree_flatten", "pytree_unflatten",
    "COMPILER", "compiler_in_use", "dynamo_tracing", "compiler_inlines_modules",
    "compiled_function_original", "COMPILED_REPLICAS_SINCE", "compiles_in_replicas",
    "is_batch_norm",
    "check_batch_norm_input", "generator_state_bytes", "generator_fingerprint", "OpOverload",
    "op_takes_generator",
    "PRIVATE_SAMPLERS", "replace_rng_state_functions", "restore_rng_state_functions",
    "function_modes", "default_device", "register_state_dict_hooks", "make_wrapper_tensor",
    "disabled_torch_function", "optimizer_step_hooks",
    "uses_openmp", "GnuOpenMP", "torch_gnu_openmp", "gloo_group",
]


# -- thread state (every run, on every replica thread) ------------------------------------
# One C call answers "is any autocast on" for every device type; the public
# torch.is_autocast_enabled(device) needs one call per device type (~2 µs a run).
any_autocast_enabled: Callable[[], bool] = torch._C._is_any_autocast_enabled

# torch's own inference-mode guard and grad-mode setter, without their Python wrappers:
# ~1 µs instead of ~4 on every replica's thread (torch.inference_mode builds a context
# manager object and a decorator wrapper each time).
InferenceMode = torch._C._InferenceMode
set_grad_enabled: Callable[[bool], None] = torch._C._set_grad_enabled

# How many torch function modes are active on this thread. A default device
# (torch.set_default_device, ``with torch.device(...)``) is always one, so 0 means none:
# torch.get_default_device() costs ~10 µs and is asked on every reduce.
function_mode_depth: Callable[[], int] = torch._C._len_torch_function_stack


def default_device() -> torch.device:
    """The device factory functions allocate on when none is given: the innermost
    ``with torch.device(...)``, else ``torch.set_default_device``'s, else the CPU.

    ``torch.get_default_device()`` does not say so on every release csrun supports: it
    raises ``AttributeError`` after ``set_default_device(x)`` then
    ``set_default_device(None)`` (2.4 to 2.9 seen) and ignores ``with torch.device(...)``
    (2.4 and 2.6 seen; 2.11 and up answer right).
    Both are torch function modes (``DeviceContext``) on this thread's mode stack, the
    one thing every release agrees on; the global one is also kept in a thread-local
    that other threads read (torch's own later logic, done here for every release)."""
    for mode in reversed(function_modes()):
        if isinstance(mode, _DeviceContext):
            return _with_index(mode.device)
    held = getattr(getattr(torch, "_GLOBAL_DEVICE_CONTEXT", None), "device_context", None)
    if held is not None:
        return _with_index(held.device)
    return torch.device("cpu")


def _with_index(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``, as torch answers (CPU and meta have no index)."""
    if device.index is not None or device.type in ("cpu", "meta"):
        return device
    return torch.empty(0, device=device).device


def register_state_dict_hooks(module: torch.nn.Module, save: Callable,
                              load_pre: Callable) -> None:
    """``save(module, state_dict, prefix, local_metadata)`` after ``module.state_dict()``
    fills its entries, ``load_pre(module, state_dict, prefix, local_metadata, strict,
    missing_keys, unexpected_keys, error_msgs)`` before ``load_state_dict`` reads them.
    torch made both public in 2.5 (``register_state_dict_post_hook``,
    ``register_load_state_dict_pre_hook``); before, the same hooks are private."""
    if hasattr(module, "register_state_dict_post_hook"):
        module.register_state_dict_post_hook(save)
    else:  # torch < 2.5: same call, same signature
        module._register_state_dict_hook(save)
    if hasattr(module, "register_load_state_dict_pre_hook"):
        module.register_load_state_dict_pre_hook(load_pre)
    else:  # with_module=True: called with the module first, as the public one is
        module._register_load_state_dict_pre_hook(load_pre, with_module=True)


# -- a module's parameter and buffer dicts --------------------------------------------------
# csrun serves each replica its own view of a parameter when a module reads it. torch's
# only read path is Module.__getattr__, which looks the name up in the dicts
# ``module._parameters`` / ``module._buffers``; replacing those dicts (with
# parameters.ServedDict) is the one interception that costs nothing outside replicas.
# torch.func.functional_call swaps every parameter on every call, and parametrizations
# add a module and a Python call per parameter.
_DICTS = {"parameter": "_parameters", "buffer": "_buffers"}


def tensor_dict(module: torch.nn.Module, kind: str) -> dict | None:
    """``module``'s own dict of ``kind`` ("parameter" or "buffer"): the object itself,
    which ``Module.__getattr__``, ``__setattr__``, ``register_*`` and ``named_*`` use."""
    return module.__dict__.get(_DICTS[kind])


def set_tensor_dict(module: torch.nn.Module, kind: str, mapping: dict) -> None:
    """Make ``mapping`` (a dict, or a dict subclass) ``module``'s dict of ``kind``."""
    module.__dict__[_DICTS[kind]] = mapping


def plain_tensor_dict(items) -> dict:
    """``items`` (a dict or its items) in the kind of dict torch's own modules hold
    (``dict``; an ``OrderedDict`` in older torch, 2.3 included): a module released by
    csrun gets back what torch made."""
    return type(torch.nn.Module().__dict__["_parameters"])(items)


def tensor_dicts(module: torch.nn.Module) -> tuple:
    """``module``'s own parameter and buffer dicts, in one call (asked on every module
    call inside a replica, see :func:`route_module_calls`). Plain Python on purpose:
    dynamo traces it (an ``operator.attrgetter`` broke compiled graphs into fragments)."""
    own = module.__dict__
    return own.get("_parameters"), own.get("_buffers")


# -- module calls -------------------------------------------------------------------------
# A module built outside a strategy's scope keeps torch's plain dicts: nothing tells csrun
# that a replica reads it. While a run is going, every module call passes csrun's function
# first, which serves such a module from then on as the ones built in scope are. Replacing
# ``Module.__call__`` costs ~0.4 µs a call; torch's public global forward pre-hook sends
# every module call of the process down its slow path (~1.6 µs a call).
def route_module_calls(call: Callable) -> Callable:
    """Make ``call(module, *args, **kwargs)`` what calling any module runs; returns torch's
    own ``Module.__call__``, which ``call`` must end in."""
    torchs = torch.nn.Module.__call__
    torch.nn.Module.__call__ = call
    return torchs


def restore_module_calls(torchs: Callable, ours: Callable) -> None:
    """Put torch's ``Module.__call__`` back if ``ours`` still stands there."""
    if torch.nn.Module.__call__ is ours:
        torch.nn.Module.__call__ = torchs


def compiled_module_type() -> type | None:
    """The class of ``torch.compile(module)``'s result, None while the compiler is not
    loaded: its submodules run inside compiled code, without a module call to see."""
    if not compiler_in_use():
        return None
    from torch._dynamo.eval_frame import OptimizedModule
    return OptimizedModule


def compiled_original(module: torch.nn.Module) -> torch.nn.Module:
    """The module that ``torch.compile`` wrapped into ``module``."""
    return module._orig_mod


# -- autograd -------------------------------------------------------------------------------
# A tensor's version counter (bumped by every in-place write): how csrun tells that a
# buffer or a mirrored parameter changed without comparing values. No public accessor;
# an attrgetter is a C call, so reading it adds no Python frame per tensor.
tensor_version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")


# The private attributes of a tensor that describe it without reading its values (its
# hooks, version counter, view base): a ps job's table that does not exist yet on a
# worker answers them from its one-element stand-in (core/cluster/deferred_table.py), as
# grad_hooks and tensor_version above read them.
TENSOR_PRIVATE_DESCRIPTION = frozenset({"_backward_hooks", "_post_accumulate_grad_hooks",
                                        "_base", "_version", "_is_view"})


def has_post_accumulate_grad_hook(tensor: torch.Tensor, hook: Callable) -> bool:
    """Whether ``hook`` is already registered on ``tensor`` by
    ``register_post_accumulate_grad_hook`` (which has no public way to list hooks): a run
    output that is a leaf is watched once, however many runs return it."""
    hooks = tensor._post_accumulate_grad_hooks
    return bool(hooks) and any(h is hook for h in hooks.values())


def grad_hooks(tensor: torch.Tensor) -> tuple[list, list]:
    """``tensor``'s gradient hooks (``register_hook``) and post-accumulate-grad hooks, in
    the order torch runs them. A replica's leaf does not carry its central tensor's: csrun
    runs them on the replicas' summed gradient (no public way to list them)."""
    pre, post = tensor._backward_hooks, tensor._post_accumulate_grad_hooks
    return (list(pre.values()) if pre else [], list(post.values()) if post else [])


# Which central tensors carry hooks, without asking each at every step (~55 ns a
# parameter): while a strategy lives, the two ways to register one on a tensor tell csrun.
_HOOK_METHODS = ("register_hook", "register_post_accumulate_grad_hook")


def route_hook_registration(noted: Callable[[torch.Tensor], None]) -> dict:
    """Make ``Tensor.register_hook`` and ``Tensor.register_post_accumulate_grad_hook``
    call ``noted(tensor)`` after torch's own; returns torch's, for
    :func:`restore_hook_registration`."""
    torchs = {name: getattr(torch.Tensor, name) for name in _HOOK_METHODS}

    def routed(original: Callable) -> Callable:
        def register(self, hook):
            handle = original(self, hook)
            noted(self)
            return handle
        register.__wrapped__ = original
        register.__doc__ = original.__doc__
        return register
    for name, original in torchs.items():
        setattr(torch.Tensor, name, routed(original))
    return torchs


def restore_hook_registration(torchs: dict) -> None:
    """Put torch's methods back where csrun's still stand."""
    for name, original in torchs.items():
        if getattr(getattr(torch.Tensor, name), "__wrapped__", None) is original:
            setattr(torch.Tensor, name, original)


def current_backward_id() -> int:
    """The id of the backward running on this thread (-1 outside any): a hook reached
    many times in one backward queues its end-of-backward callback once. No public API;
    DDP uses the same one."""
    return torch._C._current_graph_task_id()


def queue_backward_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward has finished (the way DDP collects its
    gradients); torch has no public form of the engine's ``queue_callback``."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


# ``others[i]`` added into ``tensors[i]`` in one kernel per dtype and device, as
# torch.optim does; the foreach ops have no public name.
foreach_add_: Callable[[list, list], None] = torch._foreach_add_

# The leaves of any container torch's pytree knows (torch.return_types, registered
# classes), where a run's outputs may hide tensors to watch. torch 2.13 has no public
# pytree module.
pytree_leaves: Callable = _pytree.tree_leaves


def pytree_node(cls: type) -> bool:
    """Whether torch's pytree knows how to take ``cls`` apart and put it back
    (``register_pytree_node``): DataParallel gathers such an output as its type."""
    return cls in _pytree.SUPPORTED_NODES


# ``tree_flatten(value) -> (leaves, spec)`` and ``tree_unflatten(leaves, spec)``: the
# same pytree, its leaves replaced (specs compare equal when the structures are).
pytree_flatten: Callable = _pytree.tree_flatten
pytree_unflatten: Callable = _pytree.tree_unflatten


# torch's compiler, as sys.modules names it once loaded (see compiler_in_use)
COMPILER = "torch._dynamo"


def compiler_in_use() -> bool:
    """Whether torch's compiler (torch._dynamo) is loaded: ``torch.compile`` loads it
    (so does torch.optim's first optimizer). csrun wraps its compiled-read fallback in
    ``torch.compiler.disable`` only then: importing the compiler costs ~1.7 s and sets
    process-wide state (an environment variable, warning filters), which importing csrun
    must not take. (Every run asks: its hot path reads ``COMPILER in sys.modules``.)"""
    return COMPILER in sys.modules


def dynamo_tracing() -> bool:
    """Whether this thread is inside ``torch.compile``'s tracing: in the code it traces
    (``torch.compiler.is_compiling()``) or in its runs of that code on fake tensors,
    which is_compiling() does not report (torch 2.4 runs built-in modules on fake
    copies there). csrun's checks that compare real tensors must not run then."""
    if torch.compiler.is_compiling():
        return True
    return compiler_in_use() and torch._guards.TracingContext.try_get() is not None


def compiler_inlines_modules() -> bool:
    """Whether ``torch.compile`` traces into ``nn.Module`` calls, reading parameters
    where the module's code reads them (``torch._dynamo.config.inline_inbuilt_nn_modules``:
    the default from torch 2.5, always on from 2.13, which warns when it is read). Only
    then do compiled replicas read csrun's served parameters: otherwise dynamo keeps
    built-in modules as opaque calls and AOT autograd lifts the parameters it found when
    compiling into the graph, one replica's leaves of one run, for good."""
    config = sys.modules.get("torch._dynamo.config")
    if config is None:
        return True  # nothing compiled yet: the question does not arise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return bool(getattr(config, "inline_inbuilt_nn_modules", True))


# The first torch release whose compiled replicas read csrun's served parameters into
# their graphs with a bounded number of graphs, results equal to eager (test_compile.py
# and benchmarks/torch_versions.py, on 2.11 and up): before, dynamo guards on the
# parameters read, and every run recompiles (2.4 through 2.9 seen) until the limit.
COMPILED_REPLICAS_SINCE = (2, 11)


def compiles_in_replicas() -> bool:
    """Whether ``torch.compile``'d code can run in csrun's replicas on this torch."""
    release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    return release >= COMPILED_REPLICAS_SINCE and compiler_inlines_modules()


def compiled_function_original(fn: Callable) -> Callable | None:
    """The function that ``torch.compile(fn)`` wrapped, None for any other callable."""
    return getattr(fn, "_torchdynamo_orig_callable", None)


# -- BatchNorm --------------------------------------------------------------------------
def is_batch_norm(module: torch.nn.Module) -> bool:
    """Whether ``module`` is one of torch's BatchNorm layers (1d/2d/3d, lazy, Sync, or a
    user subclass of their base). The public classes share no public base, and listing
    them would miss the lazy ones and subclasses of ``_BatchNorm``."""
    return isinstance(module, _BatchNorm)


def check_batch_norm_input(module: torch.nn.Module, input: torch.Tensor) -> None:
    """The layer's own input check (BatchNorm2d wants 4-D input, ...), with torch's
    error, for the synchronized forward that replaces the layer's."""
    module._check_input_dim(input)


# -- random numbers ---------------------------------------------------------------------
def generator_state_bytes(generator: torch.Generator = torch.default_generator) -> bytes:
    """``generator``'s state (the global CPU generator's by default) as bytes to compare,
    copied straight from the state tensor's memory by a ctypes array of its size laid
    over it: ``.numpy().tobytes()`` took 1.5 µs, ``ctypes.string_at`` 1.1, this 0.6 (the
    watch's last resort, and the reference its faster reads are checked against). Relies
    on the state being a contiguous uint8 tensor."""
    state = generator.get_state()  # held: its memory is read below
    size = state.numel()
    array = _STATE_ARRAYS.get(size)
    if array is None:  # one size per kind of generator: a handful at most
        array = _STATE_ARRAYS[size] = ctypes.c_char * size
    return array.from_address(state.data_ptr()).raw


_STATE_ARRAYS: dict = {}  # state size -> the ctypes array type read over it

# torch's CPU generator state (CPUGeneratorImplState, 5056 bytes) is its seed, the
# mt19937 position (left, seeded, next), the 624 state words, then the cached normal
# samples. A draw moves the position or uses up a cached sample; where the position comes
# round again (624 words on) every word has been regenerated, the first among them. So
# the seed, position, first word and cache flags change with every draw (but for a
# 1-in-2**32 repeat of that first word at exactly a wrap): what the replicas' watch
# compares, once a run. They can miss one change of the whole state, not made by draws
# alone: a reseed or restore, then draws in another order, that lands on the same
# position with another double sample cached (seed; rand(4); randn() against seed;
# randn(); rand(4)).
_CPU_STATE_SIZE, _HEAD_SIZE, _TAIL_AT = 5056, 32, 5016
# in the state's tail: the double sample, its valid flag (an int), the float sample
_DOUBLE_AT, _DOUBLE_VALID_AT, _FLOAT_AT = 5024, 5040, 5048


def _state_fingerprint(generator: torch.Generator = torch.default_generator) -> bytes:
    """Those fields, cut from the whole state (the fallback of the read below)."""
    state = generator_state_bytes(generator)
    return state[:_HEAD_SIZE] + state[_TAIL_AT:]


# The same fields read where the C++ generator keeps them: get_state() allocates and
# copies 5 KB, ~5 of an empty 2-replica step's ~25 µs; this reads ~26 bytes in place
# (~0.2 µs). The layout is found on a probe generator set to known values and checked
# against get_state() before it is used; torch's own get_state() stands in where it is
# not found. Padding is skipped (a reseed copies it from a temporary), and so are the
# cached samples' values: only their flags are read. A sample is cached by drawing (the
# position moves), while a value left behind by a used or dropped sample stays in the
# C++ object after get_state() reports it gone: a draw that a restore undid (as
# torch.compile's tracing does) would read as moved.
_PROBE = (0x5EED_CAFE_F00D_1234, 123, 1, 456, 0xDEADBEEF, 1.75, 3.25)
_ENGINE_FIELDS = struct.Struct("<QiB3xII2492x4x4xB3x8xB")  # seed .. double sample's flag
_SAMPLES_AT = 2520  # the float sample's value, then the double's at +8 (skipped above)


def _probe_generator() -> torch.Generator:
    g = torch.Generator(device="cpu")
    seed, left, seeded, at, word, single, double = _PROBE
    state = bytearray(generator_state_bytes(g))
    struct.pack_into("<QiiQQ", state, 0, seed, left, seeded, at, word)
    struct.pack_into("<d", state, _DOUBLE_AT, double)
    struct.pack_into("<i", state, _DOUBLE_VALID_AT, 1)
    struct.pack_into("<f?", state, _FLOAT_AT, single, True)
    g.set_state(torch.frombuffer(state, dtype=torch.uint8).clone())
    return g


def _engine_fields_at(generator: torch.Generator) -> int | None:
    """Where the fingerprint's fields start in ``generator``'s C++ object, or None."""
    seed, left, seeded, at, word, single, double = _PROBE
    start = (ctypes.c_char * 256).from_address(generator._cdata).raw.find(
        struct.pack("<QiB", seed, left, seeded))
    if start < 0:
        return None
    found = _ENGINE_FIELDS.unpack_from(
        (ctypes.c_char * _ENGINE_FIELDS.size).from_address(generator._cdata + start))
    values = (ctypes.c_char * 16).from_address(generator._cdata + start + _SAMPLES_AT).raw
    if values[:4] != struct.pack("<f", single) or values[8:] != struct.pack("<d", double):
        return None  # the samples are not where their flags are read
    return start if found == (seed, left, seeded, at, word, 1, 1) else None


def _memory_fingerprint(generator: torch.Generator, start: int) -> Callable[[], tuple]:
    fields = (ctypes.c_char * _ENGINE_FIELDS.size).from_address(generator._cdata + start)
    return functools.partial(_ENGINE_FIELDS.unpack_from, fields)  # a C call, no frame


def _tracks_the_state(read: Callable[[], object], g: torch.Generator) -> bool:
    """Whether ``read`` moves exactly when ``g``'s whole state does, through a reseed,
    draws, a cached normal sample made and then used, a wrap, a draw undone by a
    restore, and comes back with a restored state."""
    cpu, f64 = torch.device("cpu"), torch.float64  # (whatever the default device)

    def undone():
        state = g.get_state()
        torch.randn((), dtype=f64, generator=g, device=cpu)
        g.set_state(state)
    steps = [(True, lambda: g.manual_seed(7)), (False, lambda: None),
             (True, lambda: torch.empty(3, dtype=torch.int64, device=cpu).random_(
                 generator=g)),
             (True, lambda: torch.randn((), dtype=f64, generator=g, device=cpu)),
             (True, lambda: torch.randn((), dtype=f64, generator=g, device=cpu)),
             (False, undone),
             (True, lambda: torch.randint(0, 2 ** 31, (624,), generator=g, device=cpu))]
    saved, before = g.get_state(), (read(), generator_state_bytes(g))
    first = before[0]
    for moves, step in steps:
        step()
        now = (read(), generator_state_bytes(g))
        if (now[1] != before[1]) != moves or (now[0] != before[0]) != moves:
            return False  # (a step that did not do what it should proves nothing)
        before = now
    g.set_state(saved)
    return read() == first


def _watch_fingerprint() -> Callable[[], object]:
    """The cheapest read of the global generator that this torch passes the checks for:
    its C++ fields, those of get_state(), or the whole state."""
    if torch.default_generator.get_state().numel() != _CPU_STATE_SIZE:
        return generator_state_bytes  # a layout csrun does not know
    try:
        probe = _probe_generator()
        start = _engine_fields_at(probe)
        if start is not None and _tracks_the_state(_memory_fingerprint(probe, start), probe):
            read = _memory_fingerprint(torch.default_generator, start)
            if read()[:5] == struct.unpack_from("<QiiQQ", generator_state_bytes()):
                return read  # (the global generator is of the probe's kind)
        if _tracks_the_state(lambda: _state_fingerprint(probe), probe):
            return _state_fingerprint
    except Exception:  # noqa: BLE001 - a torch unlike the ones checked: the safe read
        pass
    return generator_state_bytes


# What the replicas' watch compares, run after run (only ever with itself)
generator_fingerprint: Callable[[], object] = _watch_fingerprint()


# What ``torch.ops.aten.<op>.<overload>`` objects are: replicas' random streams see
# them in ``__torch_function__`` and must tell them from Python functions.
OpOverload = torch._ops.OpOverload


def op_takes_generator(op: OpOverload) -> bool:
    """Whether an operator overload takes ``generator=`` (from its schema)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and any(a.name == "generator" for a in schema.arguments)


# Private torch functions that draw random numbers and take ``generator=`` (used by
# torch.distributions' Gamma, Beta and Dirichlet): a replica's stream must cover them.
PRIVATE_SAMPLERS: tuple = tuple(getattr(torch, name) for name in
                                ("_standard_gamma", "_sample_dirichlet") if hasattr(torch, name))


# torch.utils.checkpoint (reentrant or not) saves the CPU generator's state in the forward
# with ``torch.get_rng_state()`` and restores it with ``torch.set_rng_state()`` before it
# recomputes, inside ``torch.random.fork_rng``, which saves and restores the same way; each
# looks the function up on the ``torch`` module when called. A CPU replica draws from a
# generator of its own, which they do not know of: while replica streams exist, csrun's
# functions stand there (inside a replica they save and restore its stream as well), and
# torch's own come back with the last stream. torch has no hook for either.
_RNG_STATE_MODULES = (torch, torch.random)


def replace_rng_state_functions(get_state: Callable, set_state: Callable) -> tuple:
    """Make ``get_state``/``set_state`` what ``torch.get_rng_state``/``set_rng_state`` and
    ``torch.random``'s are; returns the functions they replaced (torch's, to call)."""
    replaced = (torch.get_rng_state, torch.set_rng_state)
    for module in _RNG_STATE_MODULES:
        module.get_rng_state, module.set_rng_state = get_state, set_state
    return replaced


def restore_rng_state_functions(replaced: tuple, ours: tuple) -> None:
    """Put ``replaced`` back wherever ``ours`` still stand (a later patch of someone else's
    stays)."""
    for module in _RNG_STATE_MODULES:
        for name, theirs, mine in zip(("get_rng_state", "set_rng_state"), replaced, ours):
            if getattr(module, name) is mine:
                setattr(module, name, theirs)


def function_modes() -> list:
    """This thread's torch function modes, outermost first. A backward runs without the
    modes of the code that called it (torch does not carry them into the autograd
    engine), so a checkpoint's recomputation needs a replica's random stream entered
    again; this says whether it is. torch has no public way to list them."""
    return torch.overrides._get_current_function_mode_stack()


# -- OpenMP -----------------------------------------------------------------------------
def uses_openmp() -> bool:
    """Whether ATen's CPU parallelism runs on OpenMP (torch reports it only as text)."""
    return "ATen parallel backend: OpenMP" in torch.__config__.parallel_info()


_GOMP_MEMBER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class GnuOpenMP:
    """The GNU OpenMP runtime (libgomp) that torch's CPU kernels run on: the entry points
    csrun calls to run replicas as torch's own team (torch has no way to run Python on
    it). ``thread_num``, ``num_threads`` and ``in_parallel`` are libgomp's own functions
    (``omp_get_thread_num`` ...), called with no Python in between."""

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.path = path
        self._parallel = lib.GOMP_parallel
        self._parallel.argtypes = [_GOMP_MEMBER, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        self._parallel.restype = None
        self.thread_num = lib.omp_get_thread_num
        self.num_threads = lib.omp_get_num_threads
        self.in_parallel = lib.omp_in_parallel
        for function in (self.thread_num, self.num_threads, self.in_parallel):
            function.argtypes, function.restype = [], ctypes.c_int

    def parallel(self, member: Callable[[object], None], size: int) -> None:
        """One parallel region of ``size`` threads, each calling ``member(None)``
        (``GOMP_parallel``, what GCC emits for ``#pragma omp parallel``); returns when
        all have. An exception ``member`` raises goes to ``sys.unraisablehook`` with
        ``member`` as its object (ctypes cannot unwind into C)."""
        callback = _GOMP_MEMBER(member)  # kept alive until the region has ended
        self._parallel(callback, None, size, 0)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def torch_gnu_openmp() -> GnuOpenMP | None:
    """The libgomp that torch's CPU library was bound to, None where torch runs on no
    GNU OpenMP (LLVM's libomp, macOS, Windows) or it cannot be found.

    Found through ``libtorch_cpu`` itself: a symbol looked up in a library's handle is
    searched in that library and its dependencies as the loader bound them, so
    ``GOMP_parallel`` resolves in torch's libgomp even when another copy (another
    wheel's, loaded before or after torch) is in the process; ``dladdr`` names its file,
    which is then opened with ``RTLD_NOLOAD``: the copy torch uses, never a second
    runtime.
    """
    if not uses_openmp():
        return None
    torch_cpu = _mapped_library("libtorch_cpu")
    if torch_cpu is None:
        return None
    try:
        entry = ctypes.CDLL(torch_cpu, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).GOMP_parallel
        path = _defining_file(ctypes.cast(entry, ctypes.c_void_p))
        if path is None or not os.path.basename(path).startswith("libgomp"):
            return None  # (LLVM's libomp defines GOMP_* too)
        return GnuOpenMP(ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY), path)
    except (OSError, AttributeError):
        return None


def _defining_file(address: ctypes.c_void_p) -> str | None:
    """The file of the loaded library that ``address`` lies in (``dladdr``: in libc
    since glibc 2.34, in libdl before)."""
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except AttributeError:
        dladdr = ctypes.CDLL("libdl.so.2").dladdr
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    info = _DlInfo()
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def _mapped_library(prefix: str) -> str | None:
    """The path of the first mapped file whose name starts with ``prefix`` (Linux)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith(prefix):
                    return path
    except OSError:
        pass
    return None


# -- torch.distributed ------------------------------------------------------------------
def gloo_group(store, rank: int, size: int, timeout, device=None):
    """A gloo process group over ``store``; on ``device`` (a gloo device, from
    ``ProcessGroupGloo.create_device``) when given. Only the private ``_Options`` choose
    the device of a group made directly (``init_process_group`` would make it the
    process's default group, and its ``pg_options`` take the same ``_Options``)."""
    import torch.distributed as dist  # only the cluster needs it

    if device is None:
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    options = dist.ProcessGroupGloo._Options()
    options._devices, options._timeout = [device], timeout
    return dist.ProcessGroupGloo(store, rank, size, options)


# -- gradients still on their way (offload.py) ----------------------------------------------
# A central tensor's .grad may be a gradient a GPU is still sending: a tensor subclass with
# no storage of its own whose every op lands the gradient first (``__torch_dispatch__``).
# torch's recipe for such wrapper subclasses names these two privately.
make_wrapper_tensor: Callable = torch.Tensor._make_wrapper_subclass
# a subclass's __torch_function__ that adds nothing: ops go straight to __torch_dispatch__
# and return plain tensors (torch's own nn.Parameter uses it)
disabled_torch_function: Callable = torch._C._disabled_torch_function_impl


def optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> int:
    """How many step hooks ``optimizer.step()`` runs, before and after, its own and the
    global ones. Stepping bucket by bucket splits the optimizer's parameter groups for
    the step: a hook would see them split. torch offers no public count."""
    from torch.optim import optimizer as optimizer_module
    return (len(optimizer._optimizer_step_pre_hooks) + len(optimizer._optimizer_step_post_hooks)
            + len(optimizer_module._global_optimizer_pre_hooks)
            + len(optimizer_module._global_optimizer_post_hooks))
