"""Global batches split by replica speed (``batch_split: balanced``), TF's even split kept.

The policy is tested with injected measurements (no clock); the measuring with a clock
that only the replicas' own work moves (:class:`tests.helpers.work_clock.WorkClock`), so
nothing here depends on how loaded the machine is.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import csrun.core as cs
from csrun.core.distribute import batch_split
from csrun.core.distribute.batch_split import (BatchBalancer, SpeedShares, even_sizes,
                                               proportional_sizes, resolve_mode)
from csrun.core.distribute.devices import LogicalDevice
from tests.helpers.work_clock import WorkClock

CPU0, CPU1, GPU0 = LogicalDevice("CPU", 0), LogicalDevice("CPU", 1), LogicalDevice("GPU", 0)


def _strategy(n=2, **options):
    return cs.CentralStorageStrategy([f"CPU:{i}" for i in range(n)], "CPU:0",
                                     options=cs.StrategyOptions(**options))


def _rid() -> int:
    return cs.get_replica_context().replica_id_in_sync_group


# -- which split ---------------------------------------------------------------------------
def test_auto_balances_only_replicas_on_different_kinds_of_device():
    assert resolve_mode("auto", [GPU0, CPU0]) == "balanced"
    assert resolve_mode("auto", [CPU0, CPU1]) == "even"
    assert resolve_mode("auto", [GPU0]) == "even"
    assert resolve_mode("even", [GPU0, CPU0]) == "even"
    assert resolve_mode("balanced", [CPU0, CPU1]) == "balanced"
    assert BatchBalancer("auto", [GPU0, CPU0]).balanced
    assert not BatchBalancer("balanced", [CPU0]).balanced  # one replica: nothing to split


def test_a_bad_mode_is_refused_where_it_is_given():
    with pytest.raises(ValueError, match="batch_split must be"):
        cs.StrategyOptions(batch_split="fast")
    with pytest.raises(ValueError, match="batch_split must be"):
        cs.DataParallel(torch.nn.Linear(2, 2), ["CPU:0", "CPU:1"], batch_split="uneven")
    with pytest.raises(ValueError, match="batch_split must be"):
        resolve_mode("Balanced", [CPU0])
    with pytest.raises(ValueError, match="execution must be 'auto', 'ordered' or"):
        cs.DataParallel(torch.nn.Linear(2, 2), ["CPU:0", "CPU:1"], execution="serial")


def test_logical_cpu_replicas_keep_tfs_split_by_default():
    s = _strategy(3)
    assert s.extended.batch_balancer.mode == "even"
    steps = list(s.experimental_distribute_dataset([torch.arange(10.0)]))
    assert [len(v) for v in s.experimental_local_results(steps[0])] == [4, 4, 2]


@pytest.mark.parametrize("size", range(0, 12))
@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_even_sizes_are_tfs_ceil_rule(size, count):
    per = -(-size // count)
    assert even_sizes(size, count) == [len(range(size)[r * per:(r + 1) * per])
                                       for r in range(count)]


# -- the arithmetic of a balanced split -------------------------------------------------------
@pytest.mark.parametrize("size", [0, 1, 5, 64, 127, 1000])
@pytest.mark.parametrize("weights", [(1, 1), (3, 1), (1, 0), (0.2, 0.3, 0.5), (1e-6, 1, 1)])
def test_proportional_sizes_sum_to_the_batch_and_round_fairly(size, weights):
    sizes = proportional_sizes(size, weights)
    assert sum(sizes) == size and min(sizes) >= 0
    exact = [size * w / sum(weights) for w in weights]
    assert all(abs(n - x) < 1 for n, x in zip(sizes, exact))


def test_proportional_sizes_are_deterministic_with_ties_to_the_lower_replica():
    assert proportional_sizes(5, (1, 1)) == [3, 2]
    assert proportional_sizes(7, (1, 1, 1)) == [3, 2, 2]
    assert proportional_sizes(128, (3, 1)) == [96, 32]
    with pytest.raises(ValueError, match="positive sum"):
        proportional_sizes(4, (0, 0))


def _simulate(shares: SpeedShares, size: int, fixed: list, rate: list, runs: int,
              noise=None) -> list:
    """Feed ``shares`` the busy time ``fixed[r] + n / rate[r]`` of each replica for
    ``runs`` runs; the sizes of each run."""
    history = []
    for run in range(runs):
        sizes = proportional_sizes(size, shares.weights)
        seconds = [fixed[r] + n / rate[r] for r, n in enumerate(sizes)]
        if noise is not None:
            seconds = [s * noise(run, r) for r, s in enumerate(seconds)]
        shares.observe(sizes, seconds)
        history.append(sizes)
    return history


def _step(sizes, fixed, rate) -> float:
    return max(f + n / v for n, f, v in zip(sizes, fixed, rate))


def test_shares_follow_measured_throughput_in_one_window():
    shares = SpeedShares(2)
    assert _simulate(shares, 128, [0, 0], [3000.0, 1000.0], SpeedShares.WINDOW)[-1] == \
        [64, 64]  # the first window is measured at TF's shares
    assert proportional_sizes(128, shares.weights) == [96, 32]
    assert shares.rates == pytest.approx([3000.0, 1000.0])


def test_a_gpu_beside_a_cpu_is_never_slower_than_alone_and_faster_where_the_cpu_helps():
    # a launch-bound GPU step (1 ms fixed) and a CPU 10x slower per example
    fixed, rate = [1e-3, 0.1e-3], [100_000.0, 10_000.0]
    shares = SpeedShares(2)
    sizes = _simulate(shares, 1024, fixed, rate, 60)[-1]
    gpu_alone = fixed[0] + 1024 / rate[0]
    best = 1.06e-3 + (1024 - 100) / 110_000  # the equal-finish split, worked out by hand
    assert _step(sizes, fixed, rate) < gpu_alone
    assert _step(sizes, fixed, rate) <= 1.06 * max(best, _step([926, 98], fixed, rate))
    assert _step([512, 512], fixed, rate) > 4 * gpu_alone  # TF's split: the straggler


def test_a_replica_too_slow_to_help_gets_no_examples():
    fixed, rate = [1e-3, 0.0], [100_000.0, 40.0]  # one example costs the CPU 25 ms
    shares = SpeedShares(2)
    history = _simulate(shares, 128, fixed, rate, 12)
    assert history[-1] == [128, 0]
    assert _step(history[-1], fixed, rate) == pytest.approx(fixed[0] + 128 / rate[0])


def test_shares_hold_still_under_noise_once_balanced():
    fixed, rate = [0.0, 0.0], [2000.0, 1000.0]
    shares = SpeedShares(2)
    jitter = [1.03, 0.98, 1.01, 0.97, 1.02]
    history = _simulate(shares, 960, fixed, rate, 90,
                        noise=lambda run, r: jitter[(run + 2 * r) % len(jitter)])
    settled = history[SpeedShares.WINDOW:]
    assert len({tuple(h) for h in settled}) == 1  # no shape churn for torch.compile/cudnn
    assert abs(settled[0][0] - 640) <= 0.05 * 640


def test_the_same_measurements_give_the_same_shares():
    runs = [_simulate(SpeedShares(3), 100, [0, 1e-3, 0], [500.0, 900.0, 100.0], 30)
            for _ in range(2)]
    assert runs[0] == runs[1]


# -- measuring replicas, by counting their work ------------------------------------------------
def _clocked(monkeypatch) -> WorkClock:
    clock = WorkClock()
    monkeypatch.setattr(batch_split, "_clock", clock)
    return clock


def _sizes_per_step(strategy, fn, steps=16, size=64) -> list:
    data = [torch.arange(float(size)) for _ in range(steps)]
    out = []
    for x in strategy.experimental_distribute_dataset(data):
        out.append([len(v) for v in strategy.experimental_local_results(x)])
        strategy.run(fn, args=(x,))
    return out


@pytest.mark.parametrize("meet", [False, True])
def test_replicas_are_timed_by_their_own_work(monkeypatch, meet):
    # replica 1 takes 3 s an example, replica 0 one; with `meet`, replica 0 waits at an
    # all_reduce while replica 1 works (ordered: one after the other), and replica 1
    # waits there while replica 0 finishes: waits are no work of theirs
    clock = _clocked(monkeypatch)
    cost = [1.0, 3.0]

    def step(x):
        half = cost[_rid()] * len(x) / 2
        clock.work(half)
        if meet:
            cs.get_replica_context().all_reduce("sum", torch.ones(1))
        clock.work(half)

    s = _strategy(2, batch_split="balanced", execution="ordered")
    warm, window = BatchBalancer.WARMUP, SpeedShares.WINDOW
    sizes = _sizes_per_step(s, step)
    assert sizes[:warm + window] == [[32, 32]] * (warm + window)
    assert sizes[warm + window:] == [[48, 16]] * (len(sizes) - warm - window)
    assert s.extended.batch_balancer.policy.rates == pytest.approx([1.0, 1 / 3])


def test_balanced_logical_cpus_give_the_global_mean_loss_and_plain_gradients(monkeypatch):
    # replica 1 three times slower: its share falls to a quarter while training goes on;
    # every step's gradient is still the plain loop's on the whole batch
    clock = _clocked(monkeypatch)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.ReLU(), torch.nn.Linear(8, 3))
    s = _strategy(2, batch_split="balanced", execution="ordered")
    with s.scope():
        model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8),
                                    torch.nn.ReLU(), torch.nn.Linear(8, 3))
    model.load_state_dict(plain.state_dict())
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(32, 5, generator=g), torch.randint(0, 3, (32,), generator=g))
            for _ in range(12)]
    opt, plain_opt = (torch.optim.SGD(m.parameters(), lr=0.2) for m in (model, plain))

    def step(x, y):
        clock.work([1.0, 3.0][_rid()] * len(x))
        loss = cs.compute_average_loss(F.cross_entropy(model(x), y, reduction="none"))
        loss.backward()
        return loss

    seen = set()
    for (x, y), (px, py) in zip(s.experimental_distribute_dataset(data), data):
        seen.add(tuple(len(v) for v in s.experimental_local_results(x)))
        opt.zero_grad()
        loss = s.reduce("sum", s.run(step, args=(x, y)))
        opt.step()
        plain_opt.zero_grad()
        plain_loss = F.cross_entropy(plain(px), py)
        plain_loss.backward()
        plain_opt.step()
        assert torch.allclose(loss, plain_loss, atol=1e-5)
    assert seen == {(16, 16), (24, 8)}
    for a, b in zip(model.state_dict().values(), plain.state_dict().values()):
        assert torch.allclose(a.float(), b.float(), atol=1e-5)


def test_measuring_stops_being_every_run_once_balanced(monkeypatch):
    clock = _clocked(monkeypatch)
    begun = []
    s = _strategy(2, batch_split="balanced", execution="ordered")
    balancer = s.extended.batch_balancer
    real = balancer.begin_run
    monkeypatch.setattr(balancer, "begin_run",
                        lambda streams: begun.append(real(streams)) or begun[-1])
    _sizes_per_step(s, lambda x: clock.work(len(x) * [1.0, 2.0][_rid()]), steps=60)
    measured = [i for i, t in enumerate(begun) if t is not None]
    assert len(measured) < 60 // 2 and measured[-1] - measured[-2] == BatchBalancer.STRIDE


def test_a_failed_run_is_not_measured(monkeypatch):
    clock = _clocked(monkeypatch)
    s = _strategy(2, batch_split="balanced", execution="ordered")
    balancer = s.extended.batch_balancer

    def step(x):
        clock.work(len(x) * [1.0, 5.0][_rid()])
        if _rid() == 1 and len(x) == 32:
            raise RuntimeError("boom")

    for x in s.experimental_distribute_dataset([torch.arange(64.0)] * 8):
        with pytest.raises(RuntimeError, match="boom"):
            s.run(step, args=(x,))
    assert balancer.active is None and balancer.policy.rates is None


def test_dataparallel_balances_along_its_dim(monkeypatch):
    clock = _clocked(monkeypatch)

    class Slow(torch.nn.Module):  # replica 1 costs 3 s an example, along dim 1
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 2)

        def forward(self, x):
            clock.work(x.shape[1] * [1.0, 3.0][_rid()])
            return self.linear(x)

    # one shared work clock times replicas only when they run one after the other; "auto"
    # runs them concurrently on a quiet machine (then each span holds both replicas' work)
    model = cs.DataParallel(Slow(), ["CPU:0", "CPU:1"], dim=1, batch_split="balanced",
                            execution="ordered")
    assert model.strategy.extended.options.execution == "ordered"
    counts = []
    for _ in range(12):
        out = model(torch.randn(2, 64, 4))
        counts.append(out.shape[1])
        out.sum().backward()
    assert model.strategy.extended.batch_balancer.sizes(64) == [48, 16]
    assert counts == [64] * 12


def test_a_parameter_server_worker_balances_its_own_part_only():
    from csrun.core.distribute.input import _split_rule
    balancer = BatchBalancer("balanced", [CPU0, CPU1])
    for _ in range(SpeedShares.WINDOW):  # replica 0 three times faster
        balancer.measured([8, 8], [8.0, 24.0])
    rule = _split_rule(balancer, total=4, first=2, count=2)  # worker 1 of 2
    assert rule(16) == [4, 4, 6, 2]  # worker 0's part stays TF's
    assert _split_rule(BatchBalancer("even", [CPU0, CPU1]), 4, 2, 2) is None


# -- the global batch holds whatever the shares ------------------------------------------------
def _unequal(s, *parts):
    """A PerReplica of the given per-replica tensors (shares chosen by the test)."""
    return s.experimental_distribute_values_from_function(
        lambda ctx: parts[ctx.replica_id_in_sync_group])


@pytest.mark.parametrize("shares", [(7, 1), (1, 7), (8, 0), (0, 8), (5, 2, 1)])
def test_synchronized_batch_norm_weighs_each_replica_by_its_examples(shares):
    torch.manual_seed(0)
    x = torch.randn(sum(shares), 4, 3) * 3 + 1
    plain = torch.nn.BatchNorm1d(4)
    s = _strategy(len(shares))
    with s.scope():
        bn = torch.nn.BatchNorm1d(4)
    bn.load_state_dict(plain.state_dict())
    slices = x.split(list(shares))
    leaves = [p.clone().requires_grad_() for p in slices]
    weights = torch.randn_like(x)
    out = s.run(lambda v, w: (bn(v) * w).sum().backward() or bn(v).detach(),
                args=(_unequal(s, *leaves), _unequal(s, *weights.split(list(shares)))))
    full = x.clone().requires_grad_()
    (plain(full) * weights).sum().backward()
    plain(x)  # the replicas' second forward (returned, not backpropagated) counts too
    assert torch.allclose(torch.cat([p.grad for p in leaves]), full.grad, atol=1e-5)
    assert torch.allclose(bn.weight.grad, plain.weight.grad, atol=1e-4)
    assert torch.allclose(bn.running_mean, plain.running_mean, atol=1e-6)
    assert torch.allclose(bn.running_var, plain.running_var, atol=1e-5)
    assert torch.allclose(torch.cat(s.experimental_local_results(out)),
                          torch.nn.functional.batch_norm(
                              x, None, None, bn.weight, bn.bias, training=True), atol=1e-5)


@pytest.mark.parametrize("shares", [(7, 1), (8, 0), (2, 5, 1)])
def test_compute_average_loss_divides_by_the_whole_batch_whatever_the_shares(shares):
    losses = torch.arange(float(sum(shares)))
    s = _strategy(len(shares))
    out = s.run(lambda v: cs.compute_average_loss(v),
                args=(_unequal(s, *losses.split(list(shares))),))
    assert float(s.reduce("sum", out)) == pytest.approx(float(losses.mean()))


def test_dataparallel_gathers_the_mean_loss_of_unequal_parts(monkeypatch):
    class Mean(torch.nn.Module):
        def forward(self, x):
            return {"loss": x.mean(), "out": x}

    model = cs.DataParallel(Mean(), ["CPU:0", "CPU:1"], batch_split="balanced")
    balancer = model.strategy.extended.batch_balancer
    for _ in range(SpeedShares.WINDOW):
        balancer.measured([4, 4], [1.0, 7.0])
    x = torch.arange(16.0)
    assert balancer.sizes(16) == [14, 2]
    result = model(x)
    assert float(result["loss"]) == pytest.approx(float(x.mean()))
    assert torch.equal(result["out"], x)


# -- the runner ------------------------------------------------------------------------------
def _config(*overrides):
    from csrun.core.runner.preflight import load_config_text
    from tests.helpers.tiny_config import tiny_config
    return load_config_text(tiny_config("train.steps=12", *overrides), "tiny.yaml")


def test_the_runner_hands_strategy_batch_split_to_its_strategy():
    from csrun.core.runner.roles import LocalRole
    assert LocalRole(_config()).strategy.extended.batch_balancer.mode == "even"
    role = LocalRole(_config("strategy.batch_split=balanced"))
    assert role.strategy.extended.batch_balancer.balanced


def test_balanced_with_per_replica_batches_is_a_config_problem():
    from csrun.core.config.problems import ConfigError
    with pytest.raises(ConfigError) as caught:
        _config("strategy.batch_split=balanced", "dataset.distribute=per_replica")
    assert [p.path for p in caught.value.problems] == ["strategy.batch_split"]
    assert "dataset.distribute: global" in str(caught.value)
    _config("dataset.distribute=per_replica")  # auto: nothing to balance, no problem
    with pytest.raises(ConfigError, match="batch_split"):
        _config("strategy.batch_split=uneven")


def test_a_balanced_run_trains_every_example_of_its_global_batches(monkeypatch):
    from csrun.core.runner.replica_step import ReplicaStep, first_leaf
    from csrun.core.runner.train import train
    clock = _clocked(monkeypatch)
    real = ReplicaStep.__call__

    def costly(self, batch, *args):  # replica 1 three times slower per example
        clock.work([1.0, 3.0][_rid()] * first_leaf(batch).shape[0])
        return real(self, batch, *args)

    monkeypatch.setattr(ReplicaStep, "__call__", costly)
    from csrun.core.runner.events import StepLog
    config = _config("strategy.batch_split=balanced", "strategy.execution=ordered",
                     "train.steps=24", "train.log_every=12")
    events = []
    result = train(config, on_event=events.append).to_dict()
    examples = [r["examples"] for r in result["per_replica"]]
    assert sum(examples) == result["examples"] and result["steps"] == 24
    last = [log for log in events if isinstance(log, StepLog)][-1]
    late = [r.examples for r in last.replicas]  # steps 13..24: split 3 to 1
    assert late[0] == pytest.approx(3 * late[1], rel=0.15)
