"""BatchNorm that normalizes with the statistics of the whole global batch.

Each replica sees only its slice of the batch. A plain BatchNorm would normalize with
the slice's statistics, so training on 2 replicas would not match training on one device.
BatchNorm layers created in ``strategy.scope()`` therefore combine their sums across
replicas (two differentiable all-reduces forward, two backward) and normalize with the
global mean and variance, as TF's ``BatchNormalization(synchronized=True)`` and torch's
``SyncBatchNorm`` do. Every replica then updates its running statistics identically, and
their MEAN aggregation equals what a single device computes.

Outside replicas, in eval mode, with one replica, or with
``StrategyOptions(sync_batch_norm=False)`` (TF's unsynchronized default), the layer runs
its own forward unchanged. The layer's ``forward`` is routed here by an instance
attribute (:func:`install`), taken off again (:func:`uninstall`) when the strategy whose
store adopted the layer is gone.
"""

from __future__ import annotations

import functools

import torch

from . import context
from .reduce import ReduceOp
from .torch_internals import check_batch_norm_input, is_batch_norm

__all__ = ["install", "uninstall", "synchronized_batch_norm"]


def install(module: torch.nn.Module) -> None:
    """Route a BatchNorm module created in scope through :func:`_forward` (idempotent)."""
    if is_batch_norm(module) and "forward" not in module.__dict__:
        module.forward = functools.partial(_forward, module)


def uninstall(module: torch.nn.Module) -> None:
    """Give ``module`` its class's forward back, if :func:`install` routed it here."""
    routed = module.__dict__.get("forward")
    if isinstance(routed, functools.partial) and routed.func is _forward:
        del module.__dict__["forward"]


def _forward(module: torch.nn.Module, input: torch.Tensor) -> torch.Tensor:
    replica = context.current_entry().replica
    if (replica is None or not module.training or not replica.has_peers
            or not replica.strategy.extended.options.sync_batch_norm):
        return type(module).forward(module, input)
    return synchronized_batch_norm(module, input, replica)


def _momentum(module: torch.nn.Module) -> float:
    """The running-average factor of this step (mirrors torch's BatchNorm forward)."""
    if not module.track_running_stats or module.num_batches_tracked is None:
        return 0.0 if module.momentum is None else module.momentum
    module.num_batches_tracked.add_(1)
    if module.momentum is None:
        return 1.0 / float(module.num_batches_tracked)
    return module.momentum


def synchronized_batch_norm(module: torch.nn.Module, input: torch.Tensor,
                            replica) -> torch.Tensor:
    """Training-mode BatchNorm over the global batch of all replicas."""
    check_batch_norm_input(module, input)
    channels = input.shape[1]
    dims = [0] + list(range(2, input.dim()))
    shape = [1, channels] + [1] * (input.dim() - 2)
    compute = input if input.dtype in (torch.float32, torch.float64) else input.float()
    local_count = compute.numel() // channels if channels else 0
    # made on the device, not copied there from the host
    count = torch.full((1,), local_count, dtype=compute.dtype, device=compute.device)
    total = replica.all_reduce(ReduceOp.SUM, torch.cat([compute.sum(dims), count]))
    n = _global_count(total, local_count)
    mean = total[:channels] / n
    centered = compute - mean.view(shape)
    var = replica.all_reduce(ReduceOp.SUM, (centered * centered).sum(dims)) / n
    output = centered * torch.rsqrt(var + module.eps).view(shape)
    if module.affine:
        output = output * module.weight.view(shape) + module.bias.view(shape)
    factor = _momentum(module)
    if module.track_running_stats and module.running_mean is not None:
        with torch.no_grad():
            module.running_mean.mul_(1 - factor).add_(mean.detach() * factor)
            module.running_var.mul_(1 - factor).add_(var.detach() * (n / (n - 1)) * factor)
    return output.to(input.dtype)


def _global_count(total: torch.Tensor, local_count: int):
    """The global batch's values per channel: the reduced tensor's last entry, left on
    the device (reading it would wait for the device every layer of every step). A
    replica with 2 or more values knows the global count is too; one with fewer reads
    it, to refuse a global batch of 1, as torch's BatchNorm does."""
    n = total[-1].detach()
    if local_count > 1:
        return n
    value = float(n)
    if value <= 1:
        raise ValueError(f"BatchNorm needs more than 1 value per channel when training, "
                         f"got a global batch of {int(value)} over all replicas")
    return value
