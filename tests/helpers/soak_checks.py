"""What a soak run samples and the limits it must stay within (shared by the engine's
soak, tests/integration/test_soak.py, and the runner's, tests/reliability/).

Nothing here is timed: whether the step time stays steady is measured by
benchmarks/soak.py. A step that slows down over a run is one that leaves something behind
(a hook, a graph, a list entry), and that shows here as objects that the collector still
tracks at the end.
"""

import gc
import os
import threading

import psutil

STEPS = int(os.environ.get("CSRUN_SOAK_STEPS", "3000"))
WARMUP = STEPS // 5  # measured from here: allocator, caches and threads have settled


def sample(process: psutil.Process) -> tuple[int, int, int, int]:
    """Resident memory, live threads, open file descriptors and the objects the garbage
    collector tracks, after a collection."""
    gc.collect()
    return (process.memory_info().rss, threading.active_count(), process.num_fds(),
            len(gc.get_objects()))


def check_flat(name: str, samples: dict) -> None:
    """After the warm-up: memory grew < 5%, no thread or fd leaked, and fewer objects
    were left behind than steps were taken (a leak of one a step would reach that)."""
    (rss0, threads0, fds0, objects0), (rss1, threads1, fds1, objects1) = \
        samples[WARMUP], samples[STEPS]
    growth = (rss1 - rss0) / rss0
    print(f"\n{name}: {STEPS} steps, RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB "
          f"({growth:+.2%}), threads {threads0} -> {threads1}, fds {fds0} -> {fds1}, "
          f"objects {objects0} -> {objects1}")
    assert growth < 0.05
    assert threads1 <= threads0 + 1  # at most the reader thread of the pass in flight
    assert fds1 <= fds0
    assert objects1 - objects0 < STEPS - WARMUP
