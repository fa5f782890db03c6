"""How each global batch is split over the replicas: evenly (TF's rule) or by speed.

``even`` is TensorFlow's split: every replica the same share (``ceil(n / R)`` consecutive
examples for a distributed dataset; DataParallel's ``n // R``, the first ``n % R`` one
more). Replicas of unequal speed then wait for the slowest every step: a CPU replica
beside a GPU makes the GPU idle most of the step.

``balanced`` splits each global batch in proportion to each replica's measured
throughput, so that every replica finishes its share at about the same time. It is the
default (``auto``) for replicas on different kinds of device (a GPU and the CPU); replicas
of one kind (logical CPUs, identical GPUs) keep TF's even split. A global batch is still
one batch: the loss is divided by the whole batch's example count and synchronized
BatchNorm weighs each replica by its examples, whatever the shares.

How a replica's speed is measured: the time its body (forward and backward) keeps its
own device busy, minus the time it waited at rendezvous (all-reduce, synchronized
BatchNorm, merge_call) for slower replicas. A CPU replica is timed by the host clock; a
GPU replica by CUDA events on its stream, read a run later and only once they completed
(``Event.query``), so measuring never makes the host wait for the GPU. Not every run is
measured: after the first few, one run in :attr:`BatchBalancer.STRIDE`.

The policy (:class:`SpeedShares`) gives each replica a share in proportion to its rate
(examples per busy second), which is its old share divided by its busy time: a replica
that took longer than the others loses examples, one that finished early gains. At the
fixed point all finish together, also when a replica has a fixed cost per step (a
kernel-launch-bound GPU, a CPU replica's empty step), where a rate alone would mislead.
Rates are smoothed over windows of runs; new shares are adopted only when they promise a
step at least :attr:`SpeedShares.GAIN` faster (so shapes stay put for torch.compile and
cudnn once balanced). A replica whose proportional share rounds to zero gets no examples:
one example would take it longer than the others need for the whole batch.

Shares depend on timing, so two runs with the same seed may split their batches
differently and their results differ in the last bits (the sums are the same math in
another order). ``even`` is exactly reproducible.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from .values import flatten

__all__ = ["MODES", "resolve_mode", "even_sizes", "proportional_sizes", "SpeedShares",
           "BatchBalancer", "RunTiming"]

MODES = ("auto", "even", "balanced")
# what replicas are timed by on the host (tests give them exact work: a WorkClock)
_clock = time.perf_counter


def resolve_mode(mode: str, devices: Sequence) -> str:
    """``even`` or ``balanced``: ``auto`` is balanced for replicas on different kinds of
    device (GPU and CPU), else even.

    Raises:
      ValueError: ``mode`` is not one of :data:`MODES`.
    """
    if mode not in MODES:
        raise ValueError(f"batch_split must be one of {', '.join(MODES)}, got {mode!r}")
    if mode != "auto":
        return mode
    kinds = {d.kind for d in devices}
    return "balanced" if len(kinds) > 1 else "even"


def even_sizes(size: int, count: int) -> list[int]:
    """TF's split of ``size`` examples over ``count`` replicas: ``ceil(size / count)``
    each in replica order, so the last ones may get fewer or none."""
    per = -(-size // count)
    return [min(per, max(0, size - r * per)) for r in range(count)]


def proportional_sizes(size: int, weights: Sequence[float]) -> list[int]:
    """``size`` examples in proportion to ``weights``, summing to ``size`` exactly.

    Largest remainders get the examples left over by rounding down, ties to the lower
    replica id: the same weights always give the same sizes.
    """
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"split weights must have a positive sum, got {list(weights)}")
    exact = [size * w / total for w in weights]
    sizes = [int(x) for x in exact]
    order = sorted(range(len(exact)), key=lambda r: (sizes[r] - exact[r], r))
    for r in order[:size - sum(sizes)]:
        sizes[r] += 1
    return sizes


class SpeedShares:
    """The balanced policy: examples per second of each replica in, shares out.

    Pure arithmetic (no clock): tests feed it measured examples and seconds.
    """

    WINDOW = 3       # measured runs per update of the rates
    SMOOTHING = 0.5  # weight of a new window's rates against the old estimate
    GAIN = 0.05      # new shares must promise a step at least this much faster

    def __init__(self, count: int):
        self.count = count
        self.rates: list[float] | None = None  # examples per second, smoothed
        self.weights: tuple[float, ...] = (1.0,) * count  # the shares in force
        self.updates = 0  # windows seen
        self._examples = [0] * count
        self._seconds = [0.0] * count
        self._runs = 0
        self._total = 0  # a measured run's global batch, for predicting step times

    def observe(self, examples: Sequence[int], seconds: Sequence[float]) -> bool:
        """Add one measured run; True when the shares changed (a window closed)."""
        for r in range(self.count):
            self._examples[r] += examples[r]
            self._seconds[r] += seconds[r]
        self._runs += 1
        self._total = sum(examples)
        if self._runs < self.WINDOW:
            return False
        window = [(n / s if n and s > 0 else None)
                  for n, s in zip(self._examples, self._seconds)]
        self._examples, self._seconds, self._runs = [0] * self.count, [0.0] * self.count, 0
        self.updates += 1
        return self._update(window)

    def _update(self, window: list) -> bool:
        if self.rates is None:  # nothing yet: a replica without examples is assumed even
            known = [w for w in window if w is not None]
            if not known:
                return False
            self.rates = [w if w is not None else min(known) for w in window]
        else:  # a replica that had no examples keeps its estimate (it cannot be timed)
            a = self.SMOOTHING
            self.rates = [old if new is None else (1 - a) * old + a * new
                          for old, new in zip(self.rates, window)]
        candidate = tuple(self.rates)
        size = self._total or self.count
        now = self.step_time(proportional_sizes(size, self.weights))
        then = self.step_time(proportional_sizes(size, candidate))
        if then <= now * (1 - self.GAIN):
            self.weights = candidate
            return True
        return False

    def step_time(self, sizes: Sequence[int]) -> float:
        """The predicted seconds of a step split as ``sizes``: its slowest replica's."""
        return max((n / r for n, r in zip(sizes, self.rates) if n), default=0.0)


class RunTiming:
    """The busy time of each replica in one run: its body minus its waits at rendezvous.

    Host clock for CPU replicas; CUDA events on the replica's stream for GPU replicas,
    read later, once complete (:meth:`ready`), never waited for.
    """

    def __init__(self, streams: Sequence | None, count: int,
                 examples: Sequence[int] | None = None):
        self._streams = streams if streams is not None else (None,) * count
        self.examples = examples  # each replica's, when the caller said (else counted)
        self._marks: list[list] = [[] for _ in range(count)]  # start, (arrive, depart)*, end

    def _mark(self, replica_id: int) -> None:
        stream = self._streams[replica_id]
        if stream is None:
            self._marks[replica_id].append(_clock())
        else:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            self._marks[replica_id].append(event)

    def wrap(self, body):
        """``body(run, replica_id)`` timed from start to end."""
        def timed(run, replica_id):
            self._mark(replica_id)
            try:
                return body(run, replica_id)
            finally:
                self._mark(replica_id)
        return timed

    def arrive(self, replica_id: int) -> None:
        """The replica reached a rendezvous (its waiting starts)."""
        self._mark(replica_id)

    def depart(self, replica_id: int) -> None:
        """The replica left the rendezvous (its own work resumes)."""
        self._mark(replica_id)

    def ready(self) -> bool:
        """Whether every mark can be read without waiting."""
        return all(m.query() for marks in self._marks for m in marks
                   if isinstance(m, torch.cuda.Event))

    def seconds(self) -> list[float] | None:
        """Each replica's busy seconds; None when a replica left no complete timing
        (it failed or was skipped)."""
        out = []
        for marks in self._marks:
            if len(marks) < 2 or len(marks) % 2:
                return None
            span = _between(marks[0], marks[-1])
            waits = sum(_between(marks[i], marks[i + 1]) for i in range(1, len(marks) - 1, 2))
            out.append(max(span - waits, 0.0))
        return out


def _between(a: Any, b: Any) -> float:
    if isinstance(a, torch.cuda.Event):
        return a.elapsed_time(b) / 1000.0
    return b - a


def _examples(nest: Any) -> int | None:
    """A replica's examples in a run: the leading size of its first batched tensor."""
    for leaf in flatten(nest):
        if isinstance(leaf, torch.Tensor) and leaf.dim():
            return int(leaf.shape[0])
    return None


class BatchBalancer:
    """One strategy's split of global batches: TF's even split, or by measured speed.

    ``sizes`` may be called from the input's prefetch thread while runs are measured on
    the caller's: the shares it reads are replaced whole, never changed in place.

    Example::

        balancer = BatchBalancer("auto", strategy.extended.compute_devices)
        balancer.sizes(256)  # [128, 128] until the replicas have been timed
    """

    WARMUP = 2   # runs not measured at first (one-off costs: allocations, autotuning)
    SETTLE = 3   # runs not measured after the shares change (input read ahead, new shapes)
    STRIDE = 5   # once balanced, one run in STRIDE is measured (odd: DataParallel's
    #              forward and backward runs alternate, and both should be seen)
    CACHE = 8    # global batch sizes whose split is kept (the batch and a short last one)

    def __init__(self, mode: str, devices: Sequence):
        self.mode = resolve_mode(mode, devices)
        self.balanced = self.mode == "balanced" and len(devices) > 1
        self.count = len(devices)
        self.policy = SpeedShares(self.count)
        self._state: tuple[tuple, dict] = (self.policy.weights, {})
        self._quiet = self.WARMUP  # runs left before measuring again
        self._runs = 0
        self._pending: tuple | None = None  # a measured run whose events may be running
        self._told: list | None = None  # the next run's examples, when its caller knows
        self.active: RunTiming | None = None  # the run being measured, for collectives

    @property
    def weights(self) -> tuple[float, ...]:
        """The relative shares in force (all 1.0 until the replicas are timed)."""
        return self._state[0]

    def sizes(self, size: int) -> list[int]:
        """Each replica's examples of a global batch of ``size`` (balanced mode)."""
        weights, cache = self._state
        sizes = cache.get(size)
        if sizes is None:
            sizes = proportional_sizes(size, weights)
            if len(cache) >= self.CACHE:
                cache.clear()
            cache[size] = sizes
        return sizes

    # -- measuring (the engine calls these around each run) ------------------------------
    def begin_run(self, streams: Sequence | None) -> RunTiming | None:
        """The timing of the run about to start, or None when it is not measured."""
        self._collect()
        told, self._told = self._told, None  # said of this run only
        self._runs += 1
        if self._quiet > 0:
            self._quiet -= 1
            return None
        stride = 1 if self.policy.updates < 2 else self.STRIDE
        if self._pending is not None or self._runs % stride:
            return None
        self.active = RunTiming(streams, self.count, told)
        return self.active

    def examples_of_next_run(self, counts: Sequence[int]) -> None:
        """Each replica's examples in the next run, from a caller that split them along
        another dimension than the first (DataParallel's ``dim``)."""
        self._told = list(counts)

    def end_run(self, timing: RunTiming, replica_args: Sequence,
                replica_kwargs: Sequence | None) -> None:
        """Keep the run's timing with each replica's example count; read it when ready."""
        self.active = None
        examples = timing.examples
        if examples is None:
            examples = [_examples((a, replica_kwargs[r] if replica_kwargs else None))
                        for r, a in enumerate(replica_args)]
        if None not in examples:
            self._pending = (timing, examples)
            self._collect()

    def discard_run(self) -> None:
        """The measured run failed: its timing counts for nothing."""
        self.active = None

    def _collect(self) -> None:
        if self._pending is None or not self._pending[0].ready():
            return
        timing, examples = self._pending
        self._pending = None
        seconds = timing.seconds()
        if seconds is not None:
            self.measured(examples, seconds)

    def measured(self, examples: Sequence[int], seconds: Sequence[float]) -> None:
        """One measured run: each replica's examples and busy seconds."""
        if self.policy.observe(examples, seconds):
            self._state = (self.policy.weights, {})
            self._quiet = self.SETTLE
