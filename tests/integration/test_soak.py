"""Soak: thousands of steps through the whole library loop leak nothing and slow down not.

The loop re-iterates a distributed dataset (a reader thread per pass), runs a model with
synchronized BatchNorm (worker threads and collectives every step), reduces, and steps
Adam. After a warm-up, resident memory may grow by less than 5 %, threads and open file
descriptors must come back to the same count, and the step time must stay steady.
"""

import gc
import os
import statistics
import threading
import time

import psutil
import pytest
import torch
import torch.nn.functional as F

import csrun.core as cs

STEPS = int(os.environ.get("CSRUN_SOAK_STEPS", "3000"))
WARMUP = STEPS // 5


@pytest.mark.timeout(900)
def test_soak_memory_threads_handles_and_step_time_stay_flat():
    process = psutil.Process()
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                    torch.nn.ReLU(), torch.nn.Linear(32, 4))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g))
               for _ in range(50)]
    dist = strategy.experimental_distribute_dataset(batches)

    def step(x, y):
        loss = F.cross_entropy(model(x), y, reduction="sum") / 32
        loss.backward()
        return loss.detach()

    times, samples = [], {}
    done = 0
    while done < STEPS:
        for x, y in dist:
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            loss = strategy.reduce("SUM", strategy.run(step, args=(x, y)))
            optimizer.step()
            times.append(time.perf_counter() - start)
            done += 1
            assert torch.isfinite(loss)
            if done in (WARMUP, STEPS):
                gc.collect()
                samples[done] = (process.memory_info().rss, threading.active_count(),
                                 process.num_fds())
            if done == STEPS:
                break
        time.sleep(0)  # let the finished pass's reader thread exit
    gc.collect()
    time.sleep(0.5)
    (rss0, threads0, fds0), (rss1, threads1, fds1) = samples[WARMUP], samples[STEPS]
    growth = (rss1 - rss0) / rss0
    early = statistics.median(times[WARMUP:2 * WARMUP])
    late = statistics.median(times[-WARMUP:])
    print(f"\nsoak: {STEPS} steps, RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB "
          f"({growth:+.2%}), threads {threads0} -> {threads1}, fds {fds0} -> {fds1}, "
          f"median step {early * 1e3:.2f} -> {late * 1e3:.2f} ms")
    assert growth < 0.05
    assert threads1 <= threads0 + 1  # at most the reader thread of the pass in flight
    assert fds1 <= fds0
    assert late < 1.5 * early
