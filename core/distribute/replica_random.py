"""Each CPU replica's own random stream, so replicas that draw can still run at once.

torch's CPU default generator is one per process: replicas drawing from it concurrently
(dropout, say) interleave their draws in no fixed order. :class:`ReplicaRandom` is a torch
function mode (mode stacks are per thread) that a replica enters around its body. It hands
the replica's own :class:`torch.Generator` to every CPU random op that takes
``generator=`` and implements the dropout functions, which take none, with a mask drawn
from it. Each run draws one number from the global generator and derives every replica's
seed from it, so ``torch.manual_seed(s)`` makes training repeat bit for bit whether the
replicas overlapped or not.

Ops it cannot see (TorchScript, C++ extensions, Python functions that draw internally but
are intercepted whole, such as ``F.gumbel_softmax``) still draw from the global generator;
``ExecutionPolicy`` watches for that and, in a diagnosing run, names the op.

Inside a replica, ``torch.get_rng_state()`` / ``torch.set_rng_state()`` save and restore
the replica's stream too (:func:`get_rng_state`), so gradient checkpointing
(``torch.utils.checkpoint``) recomputes with the masks of the forward, as it does with the
global generator in a plain loop; ``torch.random.fork_rng`` leaves the stream as it found it.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, resolve_name

from . import torch_internals
from .torch_internals import OpOverload, op_takes_generator

__all__ = ["ReplicaRandom", "RunSeed", "replica_seed", "global_state", "Fingerprint",
           "get_rng_state", "set_rng_state"]

_MASK64 = (1 << 64) - 1


# The global CPU generator's fingerprint (torch_internals.generator_fingerprint): equal
# while nothing draws from it or reseeds it; only ever compared with another. Bound, so a
# run pays no call of its own for it.
global_state = torch_internals.generator_fingerprint
Fingerprint = object  # what global_state() gives: a tuple or bytes, compared with ==
_dynamo_tracing = torch_internals.dynamo_tracing


class RunSeed:
    """One run's seed: one draw from the global CPU generator, made by the first replica
    that draws (a run that draws nothing costs nothing). Every replica sees the same
    global state then, whichever comes first, so the seed does not depend on timing.

    In a watched run the global state is kept around the draw, so the watch can tell the
    draw from a replica's own use of the global generator."""

    def __init__(self):
        self._lock = threading.Lock()
        self._scratch = torch.empty((), dtype=torch.int64)  # random_ ~7 µs, randint ~13
        self.reset()

    def reset(self) -> None:
        self.seed = None
        self.watch = False
        self.around = None  # (state before, state after) the draw, when watched

    def get(self) -> int:
        if self.seed is None:
            with self._lock:
                if self.seed is None:
                    before = global_state() if self.watch else None
                    seed = int(self._scratch.random_())
                    if self.watch:
                        self.around = (before, global_state())
                    self.seed = seed
        return self.seed

    def moved(self, snapshot: Fingerprint, now: Fingerprint) -> bool:
        """Whether anything but this draw moved the global generator between
        ``snapshot`` and ``now`` (the global state, as the caller has just read it)."""
        if self.around is None:
            return now != snapshot
        return self.around[0] != snapshot or now != self.around[1]


# -- torch's CPU RNG state functions, seen from a replica -------------------------------
class _Entered(threading.local):
    """The stream entered on this thread (None outside replicas with streams)."""

    stream: "ReplicaRandom | None" = None


_entered = _Entered()
_torch_get_rng_state = torch.get_rng_state  # torch's own (ours stand there while streams live)
_torch_set_rng_state = torch.set_rng_state


def _in_force(stream: "ReplicaRandom") -> bool:
    return any(mode is stream for mode in torch_internals.function_modes())


class _SavedStream:
    """A replica stream's state as ``torch.get_rng_state()`` saw it in the replica:
    where the generator was, and whether the stream was in force (a backward runs without
    torch function modes: a checkpoint's recomputation gets the stream back from the
    forward's state, and loses it again with ``fork_rng``'s restore).

    ``state`` None: the stream had not drawn in that run; it is filled when the stream
    is seeded later in the run (a backward after the run may replay what follows)."""

    __slots__ = ("stream", "state", "in_force")

    def __init__(self, stream: "ReplicaRandom"):
        self.stream = stream
        self.state = stream.generator.get_state() if stream.seeded else None
        if self.state is None:
            stream.pending.append(self)
        self.in_force = _in_force(stream)

    def restore(self, global_state: torch.Tensor) -> None:
        stream, entered = self.stream, _entered.stream
        if entered is stream:  # in its replica: the stream goes back, the global stays
            if self.state is None:
                stream.seeded = False  # reseeded from the same run seed on its next draw
            else:
                stream.generator.set_state(self.state)
                stream.seeded = True
            self._force(stream)
        elif entered is None and self.state is not None:
            # Recomputed outside the replica (a backward through run's outputs): torch's
            # own dropout draws there, and the replica's is op for op torch's, so the
            # global generator set to the stream's state draws the forward's masks
            # (checkpoint's fork_rng puts the global state back afterwards).
            _torch_set_rng_state(self.state)
        else:
            _torch_set_rng_state(global_state)


    def _force(self, stream: "ReplicaRandom") -> None:
        modes = torch_internals.function_modes()
        now = any(mode is stream for mode in modes)
        if self.in_force and not now:  # the base class's: pushed, the replica stays entered
            TorchFunctionMode.__enter__(stream)
        elif now and not self.in_force and modes[-1] is stream:
            TorchFunctionMode.__exit__(stream, None, None, None)


def get_rng_state() -> torch.Tensor:
    """``torch.get_rng_state`` while replica streams exist: inside a replica, the global
    state carries the replica stream's too, which :func:`set_rng_state` restores."""
    state = _torch_get_rng_state()
    stream = _entered.stream
    if stream is not None:
        state.csrun_replica_stream = _SavedStream(stream)
    return state


def set_rng_state(new_state: torch.Tensor) -> None:
    """``torch.set_rng_state`` while replica streams exist: a state saved inside a replica
    restores that replica's stream (and leaves the global generator, which other replicas
    share, alone)."""
    saved = getattr(new_state, "csrun_replica_stream", None)
    if saved is None:
        return _torch_set_rng_state(new_state)
    saved.restore(new_state)


class _RngStateFunctions:
    """Ours stand in torch's place while any :class:`ReplicaRandom` lives."""

    def __init__(self):
        self._lock = threading.RLock()  # reentrant: a collection may release on this thread
        self._users = 0
        self._replaced = None

    def acquire(self) -> None:
        with self._lock:
            if self._users == 0:
                self._replaced = torch_internals.replace_rng_state_functions(
                    get_rng_state, set_rng_state)
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                torch_internals.restore_rng_state_functions(
                    self._replaced, (get_rng_state, set_rng_state))


_rng_state_functions = _RngStateFunctions()


def replica_seed(seed: int, replica_id: int) -> int:
    """splitmix64 of (run seed, replica): unrelated streams for neighbouring ids."""
    z = (seed + 0x9E3779B97F4A7C15 * (replica_id + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)  # manual_seed takes a non-negative int64


def _is_cpu(device: Any) -> bool:
    if device is None:
        return torch_internals.default_device().type == "cpu"
    return torch.device(device).type == "cpu"


def _first_tensor(args: tuple) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
    return None


def _on_cpu(args: tuple, kwargs: dict) -> bool:
    """Whether a random op runs on the CPU: its ``device=``, ``out=``, first tensor
    argument, or the default device, in that order."""
    if kwargs.get("device") is not None:
        return _is_cpu(kwargs["device"])
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        return out.is_cpu
    tensor = _first_tensor(args)
    if tensor is None:  # e.g. torch.normal(mean=..., std=...)
        tensor = _first_tensor(tuple(kwargs.values()))
    return tensor.is_cpu if tensor is not None else _is_cpu(None)


# -- dropout with a mask from the replica's generator (ATen's _dropout_impl, op for op) ---
# ``g`` is a function that returns the generator: it is called only for a mask, so that
# dropout at p=0 or in eval mode draws nothing (not even the run's seed), as in torch.
def _dropout(g: Callable[[], torch.Generator], input: torch.Tensor, p: float, train: bool,
             feature: bool = False, alpha: bool = False, inplace: bool = False):
    if p < 0 or p > 1:
        raise RuntimeError(f"dropout probability has to be between 0 and 1, but got {p}")
    if p == 0 or not train or input.numel() == 0:
        return input
    if p == 1:
        zero = torch.zeros((), dtype=input.dtype, device=input.device)
        return input.mul_(zero) if inplace else input.mul(zero)
    if feature:
        if input.dim() < 2:
            raise RuntimeError("Feature dropout requires at least 2 dimensions in the input")
        shape = list(input.shape[:2]) + [1] * (input.dim() - 2)
        noise = torch.empty(shape, dtype=input.dtype, device=input.device)
    else:
        noise = torch.empty_like(input)
    noise.bernoulli_(1 - p, generator=g())
    if alpha:
        a_ = 1.7580993408473766
        a = 1.0 / ((a_ * a_ * p + 1) * (1 - p)) ** 0.5
        b = noise.add(-1).mul_(a_ * a).add_(a_ * a * p)
        noise.mul_(a)
        return (input.mul_(noise) if inplace else input.mul(noise)).add_(b)
    noise.div_(1 - p)
    return input.mul_(noise) if inplace else input.mul(noise)


def _aten_dropout(feature: bool, alpha: bool, inplace: bool) -> Callable:
    def impl(g, args, kwargs):
        bound = dict(zip(("input", "p", "train"), args), **kwargs)
        return _dropout(g, bound["input"], bound["p"], bound["train"], feature, alpha, inplace)
    return impl


def _functional_dropout(func: Callable, feature: bool, alpha: bool,
                        unbatched_dim: int | None = None) -> Callable:
    """F.dropout & co.: the function itself validates (and warns) with training off, so
    its checks stay torch's; the mask is then ours."""
    signature = inspect.signature(func)

    def impl(g, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        x, p, training, inplace = (bound.arguments[k] for k in ("input", "p", "training",
                                                                  "inplace"))
        func(x, p, False, False)  # torch's own checks and warnings; returns x unchanged
        if not training:
            return x
        if unbatched_dim is not None and x.dim() == unbatched_dim:
            x = x.unsqueeze_(0) if inplace else x.unsqueeze(0)
            out = _dropout(g, x, p, True, feature, alpha, inplace)
            return out.squeeze_(0) if inplace else out.squeeze(0)
        return _dropout(g, x, p, True, feature, alpha, inplace)
    return impl


def _rrelu(g, args, kwargs):
    bound = inspect.signature(F.rrelu).bind(*args, **kwargs)
    bound.apply_defaults()
    x, lower, upper, training, inplace = bound.arguments.values()
    op = torch.rrelu_ if inplace else torch.rrelu
    return op(x, lower, upper, training, generator=g() if training else None)


def _dropouts() -> dict:
    table = {}
    for name, feature, alpha in (("dropout", False, False), ("feature_dropout", True, False),
                                 ("alpha_dropout", False, True),
                                 ("feature_alpha_dropout", True, True)):
        table[getattr(torch, name)] = _aten_dropout(feature, alpha, False)
        table[getattr(torch, name + "_")] = _aten_dropout(feature, alpha, True)
    table[F.dropout] = _functional_dropout(F.dropout, False, False)
    table[F.alpha_dropout] = _functional_dropout(F.alpha_dropout, False, True)
    table[F.feature_alpha_dropout] = _functional_dropout(F.feature_alpha_dropout, True, True)
    table[F.dropout1d] = _functional_dropout(F.dropout1d, True, False, unbatched_dim=2)
    table[F.dropout2d] = _functional_dropout(F.dropout2d, True, False)
    table[F.dropout3d] = _functional_dropout(F.dropout3d, True, False, unbatched_dim=4)
    table[F.rrelu] = _rrelu
    return table


# Ops that take ``generator=`` (torch.*, Tensor methods); torch.ops overloads are found by
# their schema on first use.
_TAKES_GENERATOR = {getattr(torch, n) for n in (
    "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like",
    "bernoulli", "multinomial", "normal", "poisson", "binomial", "rrelu", "rrelu_")
    if hasattr(torch, n)} | set(torch_internals.PRIVATE_SAMPLERS)
_TAKES_GENERATOR |= {getattr(torch.Tensor, n) for n in (
    "bernoulli", "bernoulli_", "uniform_", "normal_", "random_", "exponential_",
    "geometric_", "log_normal_", "cauchy_", "multinomial") if hasattr(torch.Tensor, n)}
_IMPLEMENTED = _dropouts()
_SCHEMA: dict = {}  # OpOverload -> whether it takes a generator


def _op_takes_generator(func) -> bool:
    known = _SCHEMA.get(func)
    if known is None:
        known = _SCHEMA[func] = op_takes_generator(func)
    return known


class ReplicaRandom(TorchFunctionMode):
    """One replica's random stream (see the module docstring). One instance per replica,
    entered only on the thread running that replica's body."""

    def __init__(self, replica_id: int = 0, run_seed: RunSeed | None = None):
        super().__init__()
        self.generator = torch.Generator()
        self.replica_id = replica_id
        self.run_seed = run_seed if run_seed is not None else RunSeed()
        self.seeded = False     # the generator is seeded lazily, on the run's first draw
        self.diagnose = False   # name the op that draws from the global generator
        self.culprit: str | None = None
        self.pending: list = []  # states saved before this run's first draw (_SavedStream)
        self._outer = None       # the stream entered on this thread before this one
        _rng_state_functions.acquire()
        weakref.finalize(self, _rng_state_functions.release).atexit = False

    def start(self, diagnose: bool = False) -> None:
        """Before each run (the run's :class:`RunSeed` is reset by its owner)."""
        self.seeded, self.diagnose, self.culprit = False, diagnose, None
        if self.pending:
            self.pending = []

    def _own(self) -> torch.Generator:
        if not self.seeded:
            self.generator.manual_seed(replica_seed(self.run_seed.get(), self.replica_id))
            self.seeded = True
            if self.pending:  # a state saved before: it is this one (see _SavedStream)
                for saved in self.pending:
                    saved.state = self.generator.get_state()
                self.pending = []
        return self.generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # not while dynamo traces: the state checks would break its graphs into fragments
        # (and compare real tensors inside its fake-tensor mode, an error)
        if self.diagnose and not _dynamo_tracing():
            return self._watched(func, args, kwargs)
        return self._call(func, args, kwargs)

    def _call(self, func, args, kwargs):
        impl = _IMPLEMENTED.get(func)
        if impl is not None:
            tensor = _first_tensor(args) if args else kwargs.get("input")
            if tensor is None or tensor.is_cpu:
                return impl(self._own, args, kwargs)
        elif ((func in _TAKES_GENERATOR or (isinstance(func, OpOverload)
                                            and _op_takes_generator(func)))
              and kwargs.get("generator") is None and _on_cpu(args, kwargs)):
            kwargs = dict(kwargs, generator=self._own())
        return func(*args, **kwargs)

    def _watched(self, func, args, kwargs):
        """A diagnosing run's op: the first that moves the global generator is named
        (or the gap before it: an op this mode never saw)."""
        before = torch.default_generator.get_state()
        if self.culprit is None and not torch.equal(before, self._last):
            self.culprit = "an op outside torch's function overrides (TorchScript, C++)"
        result = self._call(func, args, kwargs)
        self._last = torch.default_generator.get_state()
        if self.culprit is None and not torch.equal(before, self._last):
            self.culprit = resolve_name(func) or repr(func)
        return result

    def __exit__(self, *exc):
        result = super().__exit__(*exc)  # popped first: torch.equal must not come here
        _entered.stream = self._outer
        if self.diagnose and self.culprit is None and not torch.equal(
                torch.default_generator.get_state(), self._last):
            self.culprit = "an op outside torch's function overrides (TorchScript, C++)"
        return result

    def __enter__(self):
        if self.diagnose:
            self._last = torch.default_generator.get_state()
        self._outer, _entered.stream = _entered.stream, self
        return super().__enter__()
