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
"""

from __future__ import annotations

import inspect
import threading
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode, resolve_name

from . import torch_internals
from .torch_internals import OpOverload, op_takes_generator

__all__ = ["ReplicaRandom", "RunSeed", "replica_seed", "global_state"]

_MASK64 = (1 << 64) - 1


# The global CPU generator's state, as bytes to compare (twice a watched run): bound, so
# a run pays no call of its own for it.
global_state = torch_internals.generator_state_bytes


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

    def moved(self, snapshot: bytes, now: bytes) -> bool:
        """Whether anything but this draw moved the global generator between
        ``snapshot`` and ``now`` (the global state, as the caller has just read it)."""
        if self.around is None:
            return now != snapshot
        return self.around[0] != snapshot or now != self.around[1]


def replica_seed(seed: int, replica_id: int) -> int:
    """splitmix64 of (run seed, replica): unrelated streams for neighbouring ids."""
    z = (seed + 0x9E3779B97F4A7C15 * (replica_id + 1)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)  # manual_seed takes a non-negative int64


def _is_cpu(device: Any) -> bool:
    if device is None:
        return torch.get_default_device().type == "cpu"
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

    def start(self, diagnose: bool = False) -> None:
        """Before each run (the run's :class:`RunSeed` is reset by its owner)."""
        self.seeded, self.diagnose, self.culprit = False, diagnose, None

    def _own(self) -> torch.Generator:
        if not self.seeded:
            self.generator.manual_seed(replica_seed(self.run_seed.get(), self.replica_id))
            self.seeded = True
        return self.generator

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # not while dynamo traces: the state checks would break its graphs into fragments
        if self.diagnose and not torch.compiler.is_compiling():
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
        if self.diagnose and self.culprit is None and not torch.equal(
                torch.default_generator.get_state(), self._last):
            self.culprit = "an op outside torch's function overrides (TorchScript, C++)"
        return result

    def __enter__(self):
        if self.diagnose:
            self._last = torch.default_generator.get_state()
        return super().__enter__()
