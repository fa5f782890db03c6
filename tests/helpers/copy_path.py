"""Training through the copy path (logical CPU replicas with ``copy_parameters``, the path
GPU replicas take) and the same with the plain loop, for tests that compare them bit for
bit: an MLP (with BatchNorm, or not), SGD, Adam (foreach, fused), AdamW, clipping, an LR
scheduler, gradient accumulation over two runs."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import csrun.core as cs

STEPS = 5
BATCH = 12
# every tensor a bucket of its own; four buckets of the MLP (one of three tensors); one
# copy per dtype
SIZES = (1, 400, 0)


def mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                         nn.Linear(16, 3))


def bn_mlp():
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def make_optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if kind == "adam_foreach":
        return torch.optim.Adam(params, lr=0.01, foreach=True)
    if kind == "adam_fused":
        return torch.optim.Adam(params, lr=0.01, fused=True)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    raise AssertionError(kind)


def batches(steps=STEPS):
    gen = torch.Generator().manual_seed(7)
    return [(torch.randn(BATCH, 8, generator=gen), torch.randint(0, 3, (BATCH,), generator=gen))
            for _ in range(steps)]


def batch_loss(model, x, y):
    """Cross-entropy summed over ``x`` and divided by the global batch."""
    return F.cross_entropy(model(x), y, reduction="sum") / BATCH


def _after_backward(model, opt, sched, i, clip, accumulate) -> None:
    if accumulate and i % 2 == 0:
        return
    if clip:
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()
    if sched:
        sched.step()


def train_plain(make, kind, data, clip=False, schedule=False, accumulate=False):
    """The plain loop: ``data``'s batches, a step after each (after every second one with
    ``accumulate``); the final parameters, buffers and optimizer state."""
    torch.manual_seed(0)
    model = make()
    opt = make_optimizer(kind, model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if schedule else None
    for i, (x, y) in enumerate(data):
        batch_loss(model, x, y).backward()
        _after_backward(model, opt, sched, i, clip, accumulate)
    return state_of(model, opt)


def copy_strategy(replicas: int, size: int, **options):
    """``replicas`` logical CPU replicas computing on copies, buckets of ``size`` bytes."""
    return cs.CentralStorageStrategy(
        [f"CPU:{i}" for i in range(1, replicas + 1)], "CPU:0",
        options=cs.StrategyOptions(copy_parameters=True, bytes_per_pack=size, **options))


def train_csrun(make, kind, data, replicas, size, clip=False, schedule=False,
                accumulate=False, **options):
    """:func:`train_plain` through ``run`` on :func:`copy_strategy`; (state, strategy)."""
    strategy = copy_strategy(replicas, size, **options)
    with strategy.scope():
        torch.manual_seed(0)
        model = make()
        opt = make_optimizer(kind, model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if schedule else None
    for i, (x, y) in enumerate(data):
        xs, ys = x.tensor_split(replicas), y.tensor_split(replicas)
        strategy.run(lambda: batch_loss(model, *own_slice(xs, ys)).backward())
        _after_backward(model, opt, sched, i, clip, accumulate)
    return state_of(model, opt), strategy


def own_slice(xs, ys):
    """This replica's slice of ``xs`` and ``ys``."""
    r = cs.get_replica_context().replica_id_in_sync_group
    return xs[r], ys[r]


def state_of(model, opt):
    """Parameters, buffers and optimizer state, as flat tensors."""
    out = [t.detach().clone() for t in model.state_dict().values()]
    for entry in opt.state_dict()["state"].values():
        out += [v.clone() for v in entry.values() if isinstance(v, torch.Tensor)]
    return out


def all_equal(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


CASES = [
    ("sgd", mlp, {}),
    ("adam_foreach", mlp, {}),
    ("adam_fused", mlp, {}),
    ("adamw", mlp, {}),
    ("sgd", bn_mlp, {}),
    ("adam_foreach", mlp, {"accumulate": True}),
    ("sgd", mlp, {"clip": True}),
    ("adam_foreach", mlp, {"schedule": True}),
]
IDS = ["sgd", "adam-foreach", "adam-fused", "adamw-decay", "batchnorm", "accumulate-2-runs",
       "clip-after-run", "lr-scheduler"]
