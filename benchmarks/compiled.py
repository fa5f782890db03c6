"""csrun-compiled vs plain-compiled: the 784-512-512-10 MLP at batch 256, 2 logical CPU
replicas, one training step per sample, the two interleaved in one process.

Prints the median paired ratio (csrun step time / plain step time): each sample times a
block of csrun steps and a block of plain steps back to back, alternating which goes
first, so drifts in the machine's load hit both. ``python benchmarks/compiled.py [pairs]``.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F

import csrun.core as cs

BATCH, STEPS = 256, 5


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(784, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 10))


def _plain_step(x, y, backend):
    model = _mlp()
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step():
        F.cross_entropy(compiled(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step


def _csrun_step(x, y, backend):
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
    with strategy.scope():
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
    compiled = torch.compile(model, backend=backend)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))

    def replica(a, b):
        (F.cross_entropy(compiled(a), b, reduction="sum") / BATCH).backward()

    def step():
        strategy.run(replica, args=batch)
        opt.step()
        opt.zero_grad()
    return step


def _block(step) -> float:
    begin = time.perf_counter()
    for _ in range(STEPS):
        step()
    return (time.perf_counter() - begin) / STEPS


def main(pairs: int = 15, backend: str = "inductor") -> None:
    x, y = torch.randn(BATCH, 784), torch.randint(0, 10, (BATCH,))
    steps = {"plain": _plain_step(x, y, backend), "csrun": _csrun_step(x, y, backend)}
    for step in steps.values():  # compile, warm up
        _block(step)
    ratios, times = [], {name: [] for name in steps}
    for i in range(pairs):
        order = ("plain", "csrun") if i % 2 else ("csrun", "plain")
        got = {name: _block(steps[name]) for name in order}
        for name, seconds in got.items():
            times[name].append(seconds)
        ratios.append(got["csrun"] / got["plain"])
    print(f"compiled ({backend}) MLP 784-512-512-10, batch {BATCH}, 2 CPU replicas: "
          f"plain {statistics.median(times['plain']) * 1e3:.2f} ms, csrun "
          f"{statistics.median(times['csrun']) * 1e3:.2f} ms a step; median paired ratio "
          f"csrun-compiled / plain-compiled {statistics.median(ratios):.3f} ({pairs} pairs)")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 15)
