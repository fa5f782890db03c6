"""What a soak run measures and the limits it must stay within (shared by the engine's
soak, tests/integration/test_soak.py, and the runner's, tests/reliability/)."""

import gc
import os
import statistics
import threading

import psutil

STEPS = int(os.environ.get("CSRUN_SOAK_STEPS", "3000"))
WARMUP = STEPS // 5  # measured from here: allocator, caches and threads have settled


def sample(process: psutil.Process) -> tuple[int, int, int]:
    """Resident memory, live threads and open file descriptors, after a collection."""
    gc.collect()
    return process.memory_info().rss, threading.active_count(), process.num_fds()


def check_flat(name: str, samples: dict, times: list[float]) -> None:
    """Memory grew < 5% after warm-up, no thread or fd leaked, step time steady (x1.5)."""
    (rss0, threads0, fds0), (rss1, threads1, fds1) = samples[WARMUP], samples[STEPS]
    growth = (rss1 - rss0) / rss0
    early = statistics.median(times[WARMUP:2 * WARMUP])
    late = statistics.median(times[-WARMUP:])
    print(f"\n{name}: {STEPS} steps, RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB "
          f"({growth:+.2%}), threads {threads0} -> {threads1}, fds {fds0} -> {fds1}, "
          f"median step {early * 1e3:.2f} -> {late * 1e3:.2f} ms")
    assert growth < 0.05
    assert threads1 <= threads0 + 1  # at most the reader thread of the pass in flight
    assert fds1 <= fds0
    assert late < 1.5 * early
