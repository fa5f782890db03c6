"""Soak: thousands of steps through the whole library loop leak nothing.

The loop re-iterates a distributed dataset (a reader thread per pass), runs a model with
synchronized BatchNorm (worker threads and collectives every step), reduces, and steps
Adam. After a warm-up, resident memory may grow by less than 5 %, threads and open file
descriptors must come back to the same count, and fewer objects than steps may be left
behind. How long the steps take is measured by benchmarks/soak.py (the same loop).
"""

import gc
import time

import psutil
import pytest
import torch
import torch.nn.functional as F

import csrun.core as cs
from tests.helpers.soak_checks import STEPS, WARMUP, check_flat, sample


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_soak_memory_threads_handles_and_objects_stay_flat():
    process = psutil.Process()
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                    torch.nn.ReLU(), torch.nn.Linear(32, 4))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    # a DataLoader, not a list: lists for CPU replicas are split without a reader thread,
    # and the soak must see one start and end with every pass
    data = torch.utils.data.TensorDataset(torch.randn(50 * 32, 16, generator=g),
                                          torch.randint(0, 4, (50 * 32,), generator=g))
    dist = strategy.experimental_distribute_dataset(
        torch.utils.data.DataLoader(data, batch_size=32))

    def step(x, y):
        loss = F.cross_entropy(model(x), y, reduction="sum") / 32
        loss.backward()
        return loss.detach()

    samples = {}
    done = 0
    while done < STEPS:
        for x, y in dist:
            optimizer.zero_grad(set_to_none=True)
            loss = strategy.reduce("SUM", strategy.run(step, args=(x, y)))
            optimizer.step()
            done += 1
            assert torch.isfinite(loss)
            if done in (WARMUP, STEPS):
                samples[done] = sample(process)
            if done == STEPS:
                break
        time.sleep(0)  # let the finished pass's reader thread exit
    gc.collect()
    time.sleep(0.5)
    check_flat("soak", samples)
