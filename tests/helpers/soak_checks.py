"""What a soak run measures and the limits it must stay within (shared by the engine's
soak, tests/integration/test_soak.py, and the runner's, tests/reliability/)."""

import gc
import os
import statistics
import threading
import time

import psutil
import torch

STEPS = int(os.environ.get("CSRUN_SOAK_STEPS", "3000"))
WARMUP = STEPS // 5  # measured from here: allocator, caches and threads have settled


def sample(process: psutil.Process) -> tuple[int, int, int]:
    """Resident memory, live threads and open file descriptors, after a collection."""
    gc.collect()
    return process.memory_info().rss, threading.active_count(), process.num_fds()


class Reference:
    """A fixed plain-PyTorch step (no csrun), timed beside every soak step.

    This VM's speed switches between states ~1.6x apart; a step time compared with the
    reference's of the same moment measures csrun slowing down, not the machine."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                         torch.nn.Linear(128, 4))
        self.x, self.y = torch.randn(64, 64, generator=g), torch.randint(0, 4, (64,), generator=g)
        self.times: list[float] = []

    def step(self) -> None:
        start = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(self.model(self.x), self.y).backward()
        self.times.append(time.perf_counter() - start)


def check_flat(name: str, samples: dict, times: list[float], reference: list[float]) -> None:
    """Memory grew < 5% after warm-up, no thread or fd leaked, step time steady (x1.5)
    relative to the reference step timed beside each step."""
    (rss0, threads0, fds0), (rss1, threads1, fds1) = samples[WARMUP], samples[STEPS]
    growth = (rss1 - rss0) / rss0
    relative = [t / r for t, r in zip(times, reference)]
    early, late = _windows(times)
    early_relative, late_relative = _windows(relative)
    print(f"\n{name}: {STEPS} steps, RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB "
          f"({growth:+.2%}), threads {threads0} -> {threads1}, fds {fds0} -> {fds1}, "
          f"median step {early * 1e3:.2f} -> {late * 1e3:.2f} ms, "
          f"{early_relative:.2f} -> {late_relative:.2f} reference steps")
    assert growth < 0.05
    assert threads1 <= threads0 + 1  # at most the reader thread of the pass in flight
    assert fds1 <= fds0
    assert late_relative < 1.5 * early_relative


def _windows(values: list[float]) -> tuple[float, float]:
    """Medians of the first window after warm-up and of the last one."""
    return statistics.median(values[WARMUP:2 * WARMUP]), statistics.median(values[-WARMUP:])
