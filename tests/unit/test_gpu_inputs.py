"""A GPU beside the CPU: inputs already on the GPU reach the CPU replica on the host, and
the balanced split gives the GPU the larger share. They skip without CUDA."""

import time

import pytest
import torch
import torch.nn.functional as F

import csrun.core as cs
from csrun.core.distribute.batch_split import RunTiming

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


def _mixed(**options):
    return cs.CentralStorageStrategy(["GPU:0", "CPU:0"], "CPU:0",
                                     options=cs.StrategyOptions(**options))


def _train(strategy, model, batches):
    """One SGD step per batch; the summed loss of each (the global-batch mean)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []

    def step(x, y):
        loss = cs.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        return loss

    for x, y in batches:
        opt.zero_grad()
        losses.append(float(strategy.reduce("sum", strategy.run(step, args=(x, y)))))
        opt.step()
    return losses


def _data(device, steps=4, batch=16):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 8, generator=g).to(device),
             torch.randint(0, 3, (batch,), generator=g).to(device)) for _ in range(steps)]


def _plain_losses(data):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for x, y in data:
        opt.zero_grad()
        loss = F.cross_entropy(model(x.cpu()), y.cpu())
        loss.backward()
        opt.step()
        out.append(float(loss))
    return out


@pytest.mark.parametrize("batch_split", ["even", "balanced"])
def test_a_batch_on_the_gpu_trains_on_gpu_and_cpu_replicas(batch_split):
    # the crash: the CPU replica's slice stayed on cuda:0
    data = _data(CUDA)
    s = _mixed(batch_split=batch_split)
    torch.manual_seed(0)
    with s.scope():
        model = torch.nn.Linear(8, 3)
    dist = list(s.experimental_distribute_dataset(data))
    devices = [[v.device for v in s.experimental_local_results(x)] for x, _ in dist]
    assert devices == [[CUDA, CPU]] * len(data)
    losses = _train(s, model, dist)
    assert losses == pytest.approx(_plain_losses(data), abs=1e-5)


def test_every_input_path_places_a_gpu_batch_on_each_replicas_device():
    s = _mixed()
    x = torch.arange(8.0, device=CUDA).reshape(4, 2)
    from_fn = s.distribute_datasets_from_function(lambda ctx: [x[:2], x[2:]])
    values = s.experimental_distribute_values_from_function(lambda ctx: x)
    for value in (next(iter(from_fn)), values):
        local = s.experimental_local_results(value)
        assert [v.device for v in local] == [CUDA, CPU]
    assert s.experimental_local_results(next(iter(from_fn)))[1].tolist() == [[4.0, 5.0],
                                                                             [6.0, 7.0]]


def test_dataparallel_takes_a_batch_on_the_gpu_with_a_cpu_replica():
    torch.manual_seed(0)
    model = cs.DataParallel(torch.nn.Linear(8, 3), ["GPU:0", "CPU:0"], parameter_device="CPU:0")
    x = torch.randn(64, 8, device=CUDA) * 100  # copies read unfinished would show
    for _ in range(3):
        out = model(x)
        assert torch.allclose(out.cpu(), model.module(x.cpu()), atol=1e-3)


def test_balanced_gives_the_gpu_the_larger_share():
    s = _mixed()
    assert s.extended.batch_balancer.mode == "balanced"  # auto: GPU + CPU
    torch.manual_seed(0)
    with s.scope():
        model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(),
                                    torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
                                    torch.nn.Linear(2048, 10))
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(512, 512, generator=g), torch.randint(0, 10, (512,), generator=g))
            for _ in range(40)]
    sizes = []
    dist = s.experimental_distribute_dataset(data)

    def step(x, y):
        cs.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()

    for x, y in dist:
        sizes.append([len(v) for v in s.experimental_local_results(x)])
        s.run(step, args=(x, y))
    assert all(sum(n) == 512 for n in sizes)
    assert sizes[0] == [256, 256] and sizes[-1][0] > 3 * sizes[-1][1]


def test_timing_a_gpu_replica_never_waits_for_the_gpu():
    stream = torch.cuda.Stream()
    timing = RunTiming([stream], 1)
    a = torch.randn(2048, 2048, device=CUDA)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        def body(run, replica_id):
            with torch.cuda.stream(stream):
                for _ in range(20):
                    a @ a
        timing.wrap(body)(None, 0)
        deadline = time.monotonic() + 60
        while not timing.ready():  # polled, as the engine does a run later
            assert time.monotonic() < deadline, "the GPU never finished 20 products"
        seconds = timing.seconds()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert seconds[0] > 0


def test_a_plain_gpu_tensor_reaches_a_cpu_replica_on_the_host():
    strategy = _mixed(batch_split="even")
    x = torch.arange(4.0, device=CUDA)
    seen = strategy.run(lambda v: (v.device, v * 2), args=(x,))
    results = strategy.experimental_local_results(seen)
    assert [d.type for d, _ in results] == ["cuda", "cpu"]
    assert results[0][1].device == CUDA and results[1][1].tolist() == [0.0, 2.0, 4.0, 6.0]
