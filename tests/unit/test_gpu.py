"""CUDA and mixed CPU+GPU paths. They skip without CUDA (no GPU in CI)."""

import pytest
import torch
import torch.nn.functional as F

import csrun.core as cs

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _gpus(n: int):
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _data(steps=10, batch=12):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, 8, generator=g), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(steps)]


def _plain(data, device):
    torch.manual_seed(0)
    model = _mlp().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        F.cross_entropy(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


def _csrun(data, compute, parameter, **options):
    strategy = cs.CentralStorageStrategy(compute, parameter,
                                         options=cs.StrategyOptions(**options))
    torch.manual_seed(0)
    with strategy.scope():
        model = _mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for p in model.parameters():
        assert p.device == strategy.extended.parameter_device.torch_device

    def step(x, y, n):
        loss = F.cross_entropy(model(x), y, reduction="sum") / n
        loss.backward()
        return loss

    for x, y in strategy.experimental_distribute_dataset(data):
        opt.zero_grad()
        strategy.run(step, args=(x, y, data[0][0].shape[0]))
        opt.step()
    torch.cuda.synchronize()
    return [p.detach().cpu() for p in model.parameters()]


def _close(a, b, tol=1e-5):
    assert max((x - y).abs().max().item() for x, y in zip(a, b)) <= tol


def test_one_gpu_replica_with_parameters_on_it():
    data = _data()
    _close(_csrun(data, ["GPU:0"], "GPU:0"), _plain(data, "cuda:0"))


def test_gpu_replica_with_parameters_on_the_cpu():
    data = _data()
    _close(_csrun(data, ["GPU:0"], "CPU:0"), _plain(data, "cpu"))


def test_mixed_cpu_and_gpu_replicas_train_like_one_device():
    data = _data()
    strategy = cs.CentralStorageStrategy(["CPU:0", "GPU:0"], "CPU:0")
    assert strategy.extended.execution == "concurrent"  # one CPU replica: no probe
    _close(_csrun(data, ["CPU:0", "GPU:0"], "CPU:0"), _plain(data, "cpu"))


def test_mixed_replicas_in_ordered_mode_too():
    data = _data()
    _close(_csrun(data, ["CPU:0", "GPU:0"], "CPU:0", execution="ordered"), _plain(data, "cpu"))


def test_two_gpus():
    _gpus(2)
    data = _data()
    _close(_csrun(data, ["GPU:0", "GPU:1"], "CPU:0"), _plain(data, "cpu"))
    _close(_csrun(data, ["GPU:0", "GPU:1"], "GPU:0"), _plain(data, "cuda:0"))


def test_input_lands_on_each_replica_device_from_pinned_memory():
    strategy = cs.CentralStorageStrategy(["CPU:0", "GPU:0"], "CPU:0")
    batch = torch.arange(8.0).reshape(4, 2)
    (x,) = list(strategy.experimental_distribute_dataset([batch]))
    first, second = strategy.experimental_local_results(x)
    assert first.device.type == "cpu" and second.device == torch.device("cuda", 0)
    assert second.cpu().tolist() == [[4.0, 5.0], [6.0, 7.0]]
    options = cs.InputOptions(experimental_fetch_to_device=False)
    (x,) = list(strategy.experimental_distribute_dataset([batch], options))
    assert all(t.device.type == "cpu" for t in strategy.experimental_local_results(x))


def test_all_reduce_and_sync_batch_norm_across_cpu_and_gpu():
    strategy = cs.CentralStorageStrategy(["CPU:0", "GPU:0"], "CPU:0")

    def fn():
        ctx = cs.get_replica_context()
        value = torch.tensor([1.0 + ctx.replica_id_in_sync_group], device=ctx.device)
        return ctx.all_reduce("SUM", value)

    results = strategy.experimental_local_results(strategy.run(fn))
    assert [r.item() for r in results] == [3.0, 3.0]
    assert results[1].device.type == "cuda"
    torch.manual_seed(0)
    with strategy.scope():
        bn = torch.nn.BatchNorm1d(3)
    reference = torch.nn.BatchNorm1d(3)
    x = torch.randn(8, 3)
    dist = strategy.experimental_distribute_values_from_function(
        lambda ctx: x[4 * ctx.replica_id_in_sync_group:4 * ctx.replica_id_in_sync_group + 4]
        .to(strategy.extended.torch_devices[ctx.replica_id_in_sync_group]))
    out = strategy.gather(strategy.run(lambda v: bn(v), args=(dist,)), axis=0)
    assert torch.allclose(out.cpu(), reference(x), atol=1e-5)
    assert torch.allclose(bn.running_mean, reference.running_mean, atol=1e-6)


def test_gpu_that_is_not_there_is_refused():
    missing = f"GPU:{torch.cuda.device_count()}"
    with pytest.raises(cs.DeviceError, match=missing):
        cs.CentralStorageStrategy([missing], "CPU:0")
