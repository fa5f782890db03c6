"""A parameter-server worker's share of the input: its part of every global step.

TF gives each worker of a multi-worker job its own dataset (``InputContext``: input
pipeline ``w`` of ``W``). Here every worker computes the same seeded index plan of a pass
(indices only: cheap) and keeps its part of each global step, so the workers' shares are
disjoint, together cover the pass, and no worker loads, transforms or collates an
example of another's:

* ``distribute: global`` -- a global batch of ``n`` examples is split as TF splits a batch
  over replicas: ``ceil(n / W)`` consecutive examples per worker (the last ones get
  fewer, or none); the worker's part is split over its ``L`` local replicas the same way;
* ``distribute: per_replica`` (one pipeline per worker) -- a global step is a *round* of
  ``R = W * L`` per-replica batches, and the worker keeps its ``L`` consecutive ones; an
  incomplete last round is dropped by every worker alike, so all run the same steps.

Either way a worker yields ``L`` per-replica batches (lists of indices, or of examples for
a streamed dataset) per global step, one for each of its replicas, in replica order.

Example::

    share = WorkerShare(workers=2, index=1, replicas=1)
    list(share.parts(iter([[0, 1, 2, 3, 4]])))   # [[3, 4]]: worker 1's part
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Iterator, Sequence

__all__ = ["WorkerShare", "rounds", "split"]


def split(items: Sequence, parts: int) -> list[Sequence]:
    """``items`` in ``parts`` consecutive slices, TF's rule: ``ceil(len / parts)`` each."""
    per = -(-len(items) // parts)
    return [items[k * per:(k + 1) * per] for k in range(parts)]


def rounds(plan: Iterator[list], size: int) -> Iterator[list[list]]:
    """The complete rounds of ``size`` consecutive batches of ``plan`` (an incomplete
    last one is dropped: by every worker alike)."""
    plan = iter(plan)
    while True:
        batches = list(itertools.islice(plan, size))
        if len(batches) < size:
            return
        yield batches


@dataclasses.dataclass(frozen=True)
class WorkerShare:
    """Worker ``index`` of ``workers``, with ``replicas`` local replicas.

    Attributes:
      rounds: the plan holds per-replica batches, ``workers * replicas`` to a global step
        (``distribute: per_replica``); else global batches (``distribute: global``).
    """

    workers: int
    index: int
    replicas: int = 1
    rounds: bool = False

    def parts(self, plan: Iterator[list]) -> Iterator[list]:
        """This worker's per-replica batches of ``plan``, ``replicas`` per global step."""
        if self.rounds:
            return self._of_rounds(plan)
        return itertools.chain.from_iterable(
            split(split(batch, self.workers)[self.index], self.replicas) for batch in plan)

    def _of_rounds(self, plan: Iterator[list]) -> Iterator[list]:
        first = self.index * self.replicas
        for batches in rounds(plan, self.workers * self.replicas):
            yield from batches[first:first + self.replicas]

    def count(self, batches: int) -> int:
        """How many per-replica batches this worker yields from a plan of ``batches``."""
        steps = batches // (self.workers * self.replicas) if self.rounds else batches
        return steps * self.replicas
