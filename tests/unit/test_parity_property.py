"""N replicas equal one device, as a property over generated models and batches (issue 24).

Hypothesis draws a small network (depth, widths, activations, BatchNorm or LayerNorm, a
buffer updated in forward, weight tying), a global batch size (splits that leave a replica
short or empty included), 2 or 3 replicas, the alias or the copy path and the execution
mode; two SGD steps with momentum on the replicas must give the plain loop's parameters,
buffers and gradients. Few examples, no deadline: the file runs in seconds.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import csrun.core as cs


class Counted(nn.Module):
    """A buffer written in forward (an integer and a floating counter)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.calls += 1
        self.seen.add_(1.0)
        return x


_ACTIVATIONS = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU, "none": nn.Identity}
_NORMS = {"batch": nn.BatchNorm1d, "layer": nn.LayerNorm, "none": None}


@st.composite
def networks(draw):
    """A recipe: (input width, [(width, norm, activation)], classes, counted, tied)."""
    layers = draw(st.lists(st.tuples(st.integers(2, 8), st.sampled_from(list(_NORMS)),
                                     st.sampled_from(list(_ACTIVATIONS))),
                           min_size=1, max_size=3))
    return (draw(st.integers(2, 6)), layers, draw(st.integers(2, 4)), draw(st.booleans()),
            draw(st.booleans()))


class Net(nn.Module):
    def __init__(self, recipe):
        super().__init__()
        inputs, layers, classes, counted, tied = recipe
        blocks, width = [], inputs
        for out, norm, activation in layers:
            blocks.append(nn.Linear(width, out))
            if _NORMS[norm] is not None:
                # eps 1e-2: a variance near 0 (2 examples, or inputs a ReLU zeroed) would
                # otherwise turn float32 noise, summed in another order by the synchronized
                # BatchNorm, into differences up to 1e-4 (it is no less exact there)
                blocks.append(_NORMS[norm](out, eps=1e-2))
            blocks.append(_ACTIVATIONS[activation]())
            width = out
        if counted:
            blocks.append(Counted())
        self.body = nn.Sequential(*blocks)
        self.head = nn.Linear(width, classes)
        self.back = nn.Linear(classes, width, bias=False) if tied else None
        if tied:  # the head's weight, transposed, also maps back (weight tying)
            self.back.weight = self.head.weight

    def forward(self, x):
        h = self.body(x)
        if self.back is not None:
            h = h + torch.tanh(F.linear(self.head(h), self.head.weight.t()))
        return self.head(h)


def _train(recipe, batch, strategy=None):
    torch.manual_seed(0)
    if strategy is None:
        model = Net(recipe)
    else:
        with strategy.scope():
            model = Net(recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(batch)
    data = [(torch.randn(batch, recipe[0], generator=g),
             torch.randint(0, recipe[2], (batch,), generator=g)) for _ in range(2)]

    def step(x, y):
        F.cross_entropy(model(x), y, reduction="sum").div(batch).backward()
    grads = []
    for x, y in (data if strategy is None else strategy.experimental_distribute_dataset(data)):
        opt.zero_grad()
        step(x, y) if strategy is None else strategy.run(step, args=(x, y))
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return model.state_dict(), grads


def _constant_batch_norm_input(recipe, batch) -> bool:
    """Whether a BatchNorm of the plain model's first step sees a feature equal across the
    batch (a ReLU before it zeroed every example). Its output is then 0 up to float32
    noise: torch's kernel gives 1.2e-7 where the synchronized one gives exactly 0, and a
    ReLU after it turns that noise into a whole gradient (0.18 against 0) -- an
    ill-conditioned case, not a difference between replicas and one device."""
    torch.manual_seed(0)
    model, constant = Net(recipe), []
    g = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, recipe[0], generator=g)
    hooks = [m.register_forward_pre_hook(
        lambda _, args: constant.append(bool((args[0] == args[0][:1]).all(0).any())))
        for m in model.modules() if isinstance(m, nn.BatchNorm1d)]
    model(x)
    for hook in hooks:
        hook.remove()
    return any(constant)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipe=networks(), batch=st.integers(2, 13), replicas=st.sampled_from([2, 3]),
       copy=st.booleans(), execution=st.sampled_from(["auto", "ordered", "concurrent"]))
def test_replicas_equal_one_device(recipe, batch, replicas, copy, execution):
    assume(not _constant_batch_norm_input(recipe, batch))
    strategy = cs.CentralStorageStrategy(
        [f"CPU:{i}" for i in range(replicas)], "CPU:0",
        options=cs.StrategyOptions(copy_parameters=copy, execution=execution))
    state, grads = _train(recipe, batch, strategy)
    plain_state, plain_grads = _train(recipe, batch)
    for name, value in plain_state.items():
        torch.testing.assert_close(state[name], value, atol=1e-5, rtol=1e-4, msg=name)
    for a, b in zip(grads, plain_grads):
        # float32 rounding scales with the step's largest gradient: a bias before a
        # BatchNorm has a gradient of 0 up to that noise (summed in another order here)
        scale = max(1.0, max(float(y.abs().max()) for y in b if y.numel()))
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-5 * scale, rtol=1e-4)
