"""A backward through ``run``'s outputs in cross-replica context fills the central ``.grad``
by the time it returns, as in a plain loop: gradient clipping, grad-norm logging and
GradScaler.unscale_ read it before any optimizer.step() (issue 14)."""

import collections
import dataclasses
import threading

import numpy as np
import pytest
import torch

import csrun.core as cs

CASES = [(1, False), (2, False), (3, False), (2, True)]  # (replicas, copy_parameters)
BATCH = 6


def _strategy(n, copy):
    return cs.CentralStorageStrategy([f"CPU:{i}" for i in range(n)], "CPU:0",
                                     options=cs.StrategyOptions(copy_parameters=copy))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batches(steps=3):
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 4, generator=gen), torch.randint(0, 3, (BATCH,), generator=gen))
            for _ in range(steps)]


def _loss(model, x, y):
    return torch.nn.functional.cross_entropy(model(x), y, reduction="sum") / BATCH


def _train(step, strategy=None, steps=3):
    """Run ``step(model, opt, x, y, strategy)`` on each batch; the model and its results."""
    if strategy is None:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    else:
        with strategy.scope():
            model = _model()
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
    results = [step(model, opt, x, y, strategy) for x, y in _batches(steps)]
    return model, results


def _outside_loss(model, x, y, strategy, combine="reduce"):
    """The global loss, its backward to come in cross-replica context."""
    if strategy is None:
        return _loss(model, x, y)
    (xs, ys) = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    losses = strategy.run(lambda a, b: _loss(model, a, b), args=(xs, ys))
    if combine == "reduce":
        return strategy.reduce("SUM", losses, axis=None)
    return sum(strategy.experimental_local_results(losses))


def _clip_step(combine):
    def step(model, opt, x, y, strategy):
        opt.zero_grad()
        _outside_loss(model, x, y, strategy, combine).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)  # clips: norm ~1
        opt.step()
        return float(norm)
    return step


@pytest.mark.parametrize("combine", ["reduce", "sum of local results"])
@pytest.mark.parametrize("replicas,copy", CASES)
def test_clip_grad_norm_after_an_outside_backward_matches_a_plain_loop(replicas, copy, combine):
    plain, plain_norms = _train(_clip_step(combine))
    model, norms = _train(_clip_step(combine), _strategy(replicas, copy))
    assert norms == pytest.approx(plain_norms, rel=1e-5) and min(norms) > 0.1
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replicas,copy", CASES)
def test_grad_norm_logging_after_an_outside_backward_reads_the_whole_gradient(replicas, copy):
    def step(model, opt, x, y, strategy):
        opt.zero_grad()
        _outside_loss(model, x, y, strategy).backward()
        logged = [None if p.grad is None else p.grad.norm().item() for p in model.parameters()]
        opt.step()
        return logged
    _, expected = _train(step)
    _, logged = _train(step, _strategy(replicas, copy))
    flat = [v for row in logged for v in row]
    assert None not in flat and flat == pytest.approx([v for row in expected for v in row],
                                                      rel=1e-5)


@pytest.mark.parametrize("replicas,copy", CASES)
def test_grad_scaler_unscale_clip_and_step_match_a_plain_loop(replicas, copy):
    def step(model, opt, x, y, strategy):
        scaler = scalers.setdefault(strategy, torch.amp.GradScaler("cpu"))
        opt.zero_grad()
        scaler.scale(_outside_loss(model, x, y, strategy)).backward()
        scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        scaler.step(opt)
        scaler.update()
        return float(norm)
    scalers = {}
    plain, plain_norms = _train(step)
    model, norms = _train(step, _strategy(replicas, copy))
    assert norms == pytest.approx(plain_norms, rel=1e-5) and min(norms) > 0.1
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replicas,copy", CASES)
def test_a_backward_after_later_runs_fills_grad_when_it_returns(replicas, copy):
    # gradient accumulation: two runs' losses summed, one backward, then read .grad
    strategy = _strategy(replicas, copy)
    with strategy.scope():
        layer = torch.nn.Linear(3, 1, bias=False)
    x = torch.ones(2, 3)
    first = strategy.run(lambda: layer(x).sum())
    second = strategy.run(lambda: layer(x).sum())
    (strategy.reduce("SUM", first) + strategy.reduce("SUM", second)).backward()
    assert layer.weight.grad.tolist() == [[4.0 * replicas] * 3]


def test_an_outside_backward_flushes_once_when_it_ends():
    strategy = _strategy(2, False)
    with strategy.scope():
        model = _model()
    store = strategy.extended.store
    flushes, flush = [], store.flush_pending
    store.flush_pending = lambda: (flushes.append(1), flush())[1]
    loss = _outside_loss(model, *_batches(1)[0], strategy)
    flushes.clear()
    loss.backward()  # 4 parameters x 2 replicas reach their leaves: one callback
    assert len(flushes) == 1 and all(p.grad is not None for p in model.parameters())
    # inside a run the hook stays out of the way: the run's end collects
    strategy.run(lambda: _loss(model, *_batches(1)[0]).backward())
    assert len(flushes) == 3  # begin_run and finish_run


def test_an_outside_backward_on_another_thread_fills_grad():
    strategy = _strategy(2, False)
    with strategy.scope():
        model = _model()
    loss = _outside_loss(model, *_batches(1)[0], strategy)
    worker = threading.Thread(target=loss.backward)
    worker.start()
    worker.join()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("replicas,copy", CASES)
def test_outputs_nested_in_dicts_and_tuples_fill_grad_when_their_backward_returns(
        replicas, copy):
    strategy = _strategy(replicas, copy)
    with strategy.scope():
        model = _model()
    x, y = _batches(1)[0]
    (xs, ys) = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    out = strategy.run(lambda a, b: {"stats": (a.sum(), _loss(model, a, b))}, args=(xs, ys))
    strategy.reduce("SUM", out["stats"][1], axis=None).backward()
    plain = _model()
    _loss(plain, x, y).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("replicas,copy", [(2, False), (2, True)])
def test_replica_leaves_carry_no_hook_a_backward_inside_would_take_the_gil_for(
        replicas, copy):
    # a Python hook on a leaf runs in every replica's backward, under the GIL: two CPU
    # replicas contending for it ran 15-20% slower (docs/concepts.md)
    strategy = _strategy(replicas, copy)
    with strategy.scope():
        model = _model()
    leaves = []

    def step(x, y):
        _loss(model, x, y).backward()
        leaves.extend(p for p in model.parameters())
    x, y = _batches(1)[0]
    strategy.run(step, args=next(iter(strategy.experimental_distribute_dataset([(x, y)]))))
    centrals = {id(p) for p in model.parameters()}
    assert leaves and not centrals & {id(leaf) for leaf in leaves}  # the replicas' own
    assert all(not leaf._post_accumulate_grad_hooks for leaf in leaves)


def test_a_kept_tensor_backpropagated_later_reaches_grad_by_the_optimizer_step():
    # not returned from run, so no hook sees its backward end; optimizer.step() collects
    strategy = _strategy(2, False)
    kept = []
    with strategy.scope():
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
    x, y = _batches(1)[0]
    dist = strategy.experimental_distribute_dataset([(x, y)])
    strategy.run(lambda a, b: kept.append(_loss(model, a, b)), args=next(iter(dist)))
    sum(kept).backward()
    opt.step()
    plain = _model()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5)
    _loss(plain, x, y).backward()
    plain_opt.step()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6)


@dataclasses.dataclass
class _Out:
    loss: torch.Tensor
    note: str = "kept as one leaf by regroup"


@pytest.mark.parametrize("copy", [False, True])
def test_a_dataclass_output_fills_grad_when_its_backward_returns(copy):
    strategy = _strategy(2, copy)
    with strategy.scope():
        model = _model()
    x, y = _batches(1)[0]
    out = strategy.run(lambda a, b: _Out(_loss(model, a, b)),
                       args=next(iter(strategy.experimental_distribute_dataset([(x, y)]))))
    sum(o.loss for o in strategy.experimental_local_results(out)).backward()
    plain = _model()
    _loss(plain, x, y).backward()
    for p, q in zip(model.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("copy", [False, True])
def test_a_returned_parameter_backpropagated_later_fills_grad(copy):
    strategy = _strategy(2, copy)
    with strategy.scope():
        layer = torch.nn.Linear(3, 1, bias=False)
    weights = strategy.run(lambda: layer.weight)  # each replica's served parameter
    sum(w.sum() for w in strategy.experimental_local_results(weights)).backward()
    assert layer.weight.grad.tolist() == [[2.0, 2.0, 2.0]]


def test_outputs_of_any_type_leave_a_finished_run_alone():
    strategy = _strategy(2, False)
    with strategy.scope():
        model = _model()
    x, y = _batches(1)[0]
    dist = strategy.experimental_distribute_dataset([(x, y)])
    out = strategy.run(lambda a, b: collections.deque([np.arange(3), _loss(model, a, b)]),
                       args=next(iter(dist)))
    assert len(strategy.experimental_local_results(out)) == 2
    # one numpy array in a container pytree knows: compared with ==, it raised
    lone = strategy.run(lambda: collections.deque([np.arange(3)]))
    assert len(strategy.experimental_local_results(lone)) == 2
