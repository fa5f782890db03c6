"""Each CPU replica draws from its own generator (core/distribute/replica_random.py)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

import csrun.core as cs
from csrun.core.distribute.replica_random import ReplicaRandom
from tests.helpers.replica_training import train_bits


def _strategy(n=2, **options):
    return cs.CentralStorageStrategy([f"CPU:{i}" for i in range(n)], "CPU:0",
                                     options=cs.StrategyOptions(**options))


def test_dropout_replicas_run_concurrently_and_repeat_bit_for_bit():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        auto = _strategy(2)
        bits = train_bits(auto, dropout=True)
        assert auto.extended.execution == "concurrent"
        assert train_bits(_strategy(2), dropout=True) == bits
        ordered = _strategy(2, execution="ordered")
        assert train_bits(ordered, dropout=True) == bits
        assert ordered.extended.execution == "ordered"
        assert train_bits(_strategy(2, execution="concurrent"), dropout=True) == bits
    assert train_bits(_strategy(2), seed=1, dropout=True) != bits


def test_one_replica_draws_as_a_plain_loop_does():
    bits = train_bits(_strategy(1), dropout=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(),
                                torch.nn.Dropout(0.5), torch.nn.Linear(256, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(256, 64, generator=g), torch.randint(0, 4, (256,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y, reduction="sum").div(256).backward()
        opt.step()
    assert b"".join(p.detach().numpy().tobytes() for p in model.parameters()) == bits


def test_replicas_and_steps_draw_different_numbers_and_the_global_stream_moves_once():
    strategy = _strategy(2)
    torch.manual_seed(0)
    first = strategy.run(lambda: torch.rand(4)).values
    second = strategy.run(lambda: torch.rand(4)).values
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[0], second[0])
    torch.manual_seed(0)
    assert all(torch.equal(a, b) for a, b in zip(strategy.run(lambda: torch.rand(4)).values,
                                                 first))
    # one draw of the global generator per run that draws, however much; none otherwise
    torch.manual_seed(0)
    strategy.run(lambda: torch.rand(1000))
    after = torch.rand(1)
    torch.manual_seed(0)
    torch.empty((), dtype=torch.int64).random_()
    assert torch.equal(torch.rand(1), after)
    torch.manual_seed(0)
    strategy.run(lambda x: x * 2, args=(torch.ones(2),))
    assert torch.equal(torch.rand(1), torch.manual_seed(0) and torch.rand(1))


_DROPOUTS = [(F.dropout, (4, 6, 5)), (F.alpha_dropout, (4, 6)), (F.dropout1d, (6, 5)),
             (F.dropout1d, (4, 6, 5)), (F.dropout2d, (4, 6, 5, 3)), (F.dropout3d, (6, 5, 3, 2)),
             (F.feature_alpha_dropout, (4, 6, 5))]


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("fn,shape", _DROPOUTS)
def test_dropout_from_a_generator_matches_torch_op_for_op(fn, shape, p, inplace):
    # the same seed in the global generator and the replica's: same output and gradient
    x = torch.randn(shape)

    def call(mode):
        leaf = x.clone().requires_grad_()
        if mode is None:
            torch.manual_seed(7)
            out = fn(leaf * 1, p=p, training=True, inplace=inplace)
        else:
            with mode:
                out = fn(leaf * 1, p=p, training=True, inplace=inplace)
        out.sum().backward()
        return out.detach(), leaf.grad
    mode = ReplicaRandom()
    mode.generator.manual_seed(7)
    mode.seeded = True
    expected, got = call(None), call(mode)
    assert torch.equal(expected[0], got[0]) and torch.equal(expected[1], got[1])


def test_dropout_keeps_torch_checks():
    mode = ReplicaRandom()
    with mode, pytest.raises(ValueError, match="between 0 and 1"):
        F.dropout(torch.ones(3), p=1.5)
    with mode, pytest.raises(RuntimeError, match="Expected 2D or 3D"):
        F.dropout1d(torch.ones(3))


def _rand_like(x: torch.Tensor) -> torch.Tensor:
    return torch.rand_like(x)


with warnings.catch_warnings():  # TorchScript is deprecated; still the simplest op out of
    warnings.simplefilter("ignore")  # a torch function mode's reach
    _scripted_rand = torch.jit.script(_rand_like)


def test_a_draw_the_replicas_streams_do_not_cover_falls_back_naming_the_op():
    strategy = _strategy(2)
    with pytest.warns(RuntimeWarning, match="global CPU generator \\(an op outside"):
        strategy.run(lambda: _scripted_rand(torch.ones(2)))
    assert strategy.extended.execution == "ordered"

    strategy = _strategy(2)
    # a torch.ops overload without a generator argument is named
    with pytest.warns(RuntimeWarning, match="aten.rand.default"):
        strategy.run(lambda: torch.ops.aten.rand.default([2]))


def _mode_calls(strategy, steps):
    """How many torch calls went through a replica's random-stream mode, per run."""
    calls = []
    original = ReplicaRandom.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        calls[-1] += 1
        return original(self, func, types, args, kwargs)
    x = torch.randn(8, 4)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ReplicaRandom, "__torch_function__", counting)
        for step in steps:
            calls.append(0)
            strategy.run(step, args=(x,))
    return calls


def test_a_model_that_never_draws_stops_paying_for_the_streams():
    """The mode taxes every torch call in a replica; a model without randomness keeps
    it for the first run only."""
    calls = _mode_calls(_strategy(2), [lambda x: torch.relu(x).sum()] * 4)
    assert calls[0] > 0 and calls[1:] == [0, 0, 0]
    drawing = _mode_calls(_strategy(2), [lambda x: F.dropout(x, 0.5).sum()] * 3)
    assert all(c > 0 for c in drawing)


@pytest.mark.parametrize("execution", ["auto", "ordered", "concurrent"])
def test_a_model_that_starts_drawing_later_gets_its_streams_back(execution):
    """model.train() after an evaluation: the draws must not stay on the global generator
    (interleaved at random when concurrent); from the step after the first draw on, each
    replica draws from its own stream again, and the results repeat."""
    steps = [lambda x: x.sum()] * 2 + [lambda x: F.dropout(x, 0.5)] * 4

    def outputs():
        strategy = _strategy(2, execution=execution)
        torch.manual_seed(3)
        x = torch.ones(64, 512)  # long enough to run concurrently under auto
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return [strategy.run(s, args=(x,)) for s in steps][3:]
    first, again = outputs(), outputs()
    for a, b in zip(first, again):
        assert all(torch.equal(u, v) for u, v in zip(a.values, b.values))
    calls = _mode_calls(_strategy(2, execution=execution), steps)
    assert calls[1] == 0 and calls[2] == 0 and all(c > 0 for c in calls[3:])


def test_a_watched_run_reads_the_global_state_twice(monkeypatch):
    """Once before and once after: the after-run checks share one read (each was ~5 µs,
    a fifth of an empty run's cost, before the watch read torch's C++ generator in place;
    three were made before that)."""
    from csrun.core.distribute import replica_random, replica_run
    strategy = _strategy(2)
    x = torch.ones(4, 8)
    for _ in range(2):  # past the first run, whose streams decide whether they stay
        strategy.run(lambda x: x.sum(), args=(x,))
    reads = []
    real = replica_random.global_state

    def counted():
        reads.append(1)
        return real()
    monkeypatch.setattr(replica_random, "global_state", counted)
    monkeypatch.setattr(replica_run, "global_state", counted)
    strategy.run(lambda x: x.sum(), args=(x,))
    assert len(reads) == 2


def test_global_state_moves_exactly_when_the_generators_state_does():
    """The watch's fingerprint of the global generator (its seed, mt19937 position,
    first state word and cached normal samples) moves with a draw, with a randn that only
    uses up its cached sample, with 624 draws that bring the position round again and
    with a reseed; it stays put while nothing draws and comes back with the seed, even
    where a cached sample was dropped (its value stays behind in torch's C++ generator)."""
    from csrun.core.distribute.replica_random import global_state
    whole = lambda: torch.default_generator.get_state().numpy().tobytes()  # noqa: E731
    torch.manual_seed(5)
    first = before = (global_state(), whole())
    for step in [lambda: None, lambda: torch.rand(3),
                 lambda: torch.randn((), dtype=torch.float64),  # draws, caches a sample
                 lambda: torch.randn((), dtype=torch.float64),  # the sample: no draw
                 lambda: torch.randint(0, 2 ** 31, (624,)),  # the position comes round
                 lambda: torch.manual_seed(6)]:
        step()
        now = (global_state(), whole())
        assert (now[0] == before[0]) == (now[1] == before[1])
        before = now
    assert before[0] != first[0]
    torch.manual_seed(5)
    seeded = (global_state(), whole())
    torch.rand(3)
    torch.manual_seed(5)
    assert global_state() == seeded[0]
    torch.randn((), dtype=torch.float64)  # a sample cached, then dropped by a reseed
    torch.manual_seed(5)
    assert (global_state(), whole()) == seeded


def test_the_run_seed_is_read_from_the_host_and_only_cpu_replicas_have_streams():
    """Issue 36: the one value a run reads for its randomness (the run seed, drawn once a
    run from the global CPU generator) is a CPU tensor's: a read that waits for no
    device; GPU replicas draw from their own device generators, with no stream here."""
    from types import SimpleNamespace

    from csrun.core.distribute.replica_random import RunSeed, _on_cpu
    from csrun.core.distribute.replica_run import ExecutionPolicy
    from tests.helpers.op_count import OpCount

    seed = RunSeed()
    count = OpCount()
    with count.counting():
        seed.get()
        seed.get()  # once a run: the second is the first's
    reads = count.syncs()
    assert len(reads) == 1 and all(t.is_cpu for _, ts in reads for t in ts)
    gpu, cpu = SimpleNamespace(is_gpu=True), SimpleNamespace(is_gpu=False)
    assert ExecutionPolicy([gpu, gpu], "auto")._random is None
    assert ExecutionPolicy([gpu, cpu], "auto")._random is None  # one CPU: torch's own
    streams = ExecutionPolicy([cpu, gpu, cpu], "auto")._random
    assert [s is not None for s in streams] == [True, False, True]
    assert not _on_cpu((torch.empty(2, device="meta"),), {})  # a device's op: not wrapped
