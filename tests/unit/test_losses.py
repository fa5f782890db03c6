"""compute_average_loss: TF's signature; a global-batch mean that equals a plain loop's.

The trap it closes: ``F.cross_entropy(out, y)`` inside ``run`` averages over the replica's
slice, and the replicas' gradients are summed, so a plain-loop habit trains with R times
the gradient. A user who computes the global batch size by hand gets the short last batch
wrong.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import csrun.core as cs


def _data(count: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(count, 5, generator=g), torch.randint(0, 3, (count,), generator=g)


def _plain_grads(x, y, model):
    model.zero_grad()
    F.cross_entropy(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("replicas", [1, 2, 3])
@pytest.mark.parametrize("count", [8, 7, 1])  # even, a short last batch, an empty replica
def test_the_gradient_equals_a_plain_loop_mean(replicas, count):
    x, y = _data(count)
    torch.manual_seed(1)
    plain = torch.nn.Linear(5, 3)
    expected = _plain_grads(x, y, plain)
    strategy = cs.CentralStorageStrategy([f"CPU:{i}" for i in range(replicas)])
    with strategy.scope():
        model = torch.nn.Linear(5, 3)
        model.load_state_dict(plain.state_dict())

    def step(xs, ys):
        loss = cs.compute_average_loss(F.cross_entropy(model(xs), ys, reduction="none"))
        loss.backward()
        return loss.detach()

    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    losses = strategy.run(step, args=batch)
    torch.optim.SGD(model.parameters(), lr=0.0).step()  # gradients reach .grad centrally
    for got, want in zip([p.grad for p in model.parameters()], expected):
        torch.testing.assert_close(got, want)
    torch.testing.assert_close(strategy.reduce("SUM", losses, axis=None),
                               F.cross_entropy(plain(x), y))


def test_the_mean_habit_is_what_it_replaces():
    """Guards the premise: a per-replica mean really is R times too large when summed."""
    x, y = _data(8)
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        model = torch.nn.Linear(5, 3)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))
    mean = strategy.run(lambda a, b: F.cross_entropy(model(a), b).detach(), args=batch)
    scaled = strategy.run(lambda a, b: cs.compute_average_loss(
        F.cross_entropy(model(a), b, reduction="none")).detach(), args=batch)
    total = strategy.reduce("SUM", mean, axis=None)
    torch.testing.assert_close(total, 2 * strategy.reduce("SUM", scaled, axis=None))


def test_outside_any_strategy_it_is_the_batch_mean():
    losses = torch.tensor([1.0, 2.0, 6.0])
    assert cs.compute_average_loss(losses).item() == pytest.approx(3.0)


def test_weights_align_on_the_batch_dimension_as_in_tf():
    losses = torch.ones(2, 3)  # [B, T]
    weights = torch.tensor([1.0, 3.0])  # one per example, not per column
    assert cs.compute_average_loss(losses, sample_weight=weights).item() == pytest.approx(6.0)
    assert cs.compute_average_loss(losses, sample_weight=0.5).item() == pytest.approx(1.5)


def test_an_explicit_global_batch_size_wins():
    losses = torch.tensor([2.0, 4.0])
    assert cs.compute_average_loss(losses, global_batch_size=4).item() == pytest.approx(1.5)
    assert cs.compute_average_loss(losses, global_batch_size=torch.tensor(3)).item() == \
        pytest.approx(2.0)


@pytest.mark.parametrize("size, error", [
    (-2, ValueError), (torch.tensor([2, 2]), ValueError), (2.5, TypeError), (True, TypeError),
    (torch.tensor(2.0), TypeError)])
def test_a_bad_global_batch_size_is_refused(size, error):
    # TF 2.21's checks and error types (0 is allowed: TF's div_no_nan gives 0);
    # tests/unit/test_parity_round4.py has every form
    with pytest.raises(error, match="global_batch_size must be"):
        cs.compute_average_loss(torch.ones(2), global_batch_size=size)


def test_a_scalar_loss_is_refused_with_the_fix():
    with pytest.raises(ValueError, match="reduction='none'"):
        cs.compute_average_loss(torch.tensor(1.0))


def test_cross_replica_context_needs_the_size():
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        with pytest.raises(RuntimeError, match="replica context"):
            cs.compute_average_loss(torch.ones(4))
        assert cs.compute_average_loss(torch.ones(4), global_batch_size=8).item() == 0.5
