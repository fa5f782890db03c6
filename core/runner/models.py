"""Models and losses of a run: built-ins (linear, MLP, small CNN) or an importable class.

Built-ins size their input and output from the data (features, classes or targets).
Losses are summed over examples; the runner divides by the *global* batch size, so the
gradient summed over replicas is the gradient of the global-batch mean.

Example::

    model = build_model(config.model, data.feature_shape, data.outputs)
    loss_fn = make_loss(resolve_loss(config.model, data.task))
"""

from __future__ import annotations

import itertools
import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config.targets import import_object
from ..config.schema import ModelConfig
from ..config.problems import ConfigError, Problem
from ..config.user_code import CHECKED_FAILURES, user_problem


__all__ = ["build_model", "resolve_loss", "make_loss", "check_model", "count_parameters",
           "model_bytes", "tensor_bytes", "LOSSES"]

_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "sigmoid": nn.Sigmoid}
LOSSES = {
    "cross_entropy": lambda out, y: F.cross_entropy(out, y, reduction="sum"),
    "mse": lambda out, y: F.mse_loss(out, y, reduction="sum"),
    "l1": lambda out, y: F.l1_loss(out, y, reduction="sum"),
    "smooth_l1": lambda out, y: F.smooth_l1_loss(out, y, reduction="sum"),
}


def build_model(config: "ModelConfig", feature_shape: tuple, outputs: int) -> nn.Module:
    """Build the model (call inside ``strategy.scope()`` to place it centrally).

    Raises:
      ConfigError: the features do not fit the model, or the import target is bad.
    """
    if config.kind == "import":
        return _imported(config)
    inputs = math.prod(feature_shape) if feature_shape else 1
    if config.kind == "linear":
        return nn.Sequential(nn.Flatten(), nn.Linear(inputs, outputs, bias=config.bias))
    if config.kind == "mlp":
        layers: list[nn.Module] = [nn.Flatten()]
        width = inputs
        for size in config.hidden:
            layers += [nn.Linear(width, size), _ACTIVATIONS[config.activation]()]
            if config.dropout:
                layers.append(nn.Dropout(config.dropout))
            width = size
        return nn.Sequential(*layers, nn.Linear(width, outputs))
    return _cnn(config, feature_shape, outputs)


def _cnn(config, feature_shape: tuple, outputs: int) -> nn.Module:
    if len(feature_shape) not in (2, 3):
        raise ConfigError([Problem("model.kind", f"a cnn needs image examples (C x H x W or "
                                   f"H x W), but they have shape {list(feature_shape)}",
                                   "for digits set dataset.source.layout: image")])
    channels, height, width = (1, *feature_shape) if len(feature_shape) == 2 else feature_shape
    # H x W images get their channel axis: (N, H, W) -> (N, 1, H, W)
    layers: list[nn.Module] = [nn.Unflatten(1, (1, height))] if len(feature_shape) == 2 else []
    for size in config.channels:
        layers.append(nn.Conv2d(channels, size, config.kernel_size,
                                padding=config.kernel_size // 2))
        if config.batch_norm:
            layers.append(nn.BatchNorm2d(size))
        layers.append(nn.ReLU())
        if min(height, width) >= 2:  # halve while there is something to halve
            layers.append(nn.MaxPool2d(2))
            height, width = height // 2, width // 2
        channels = size
    layers += [nn.Flatten(), nn.Linear(channels * height * width, config.hidden), nn.ReLU(),
               nn.Linear(config.hidden, outputs)]
    return nn.Sequential(*layers)


def _imported(config) -> nn.Module:
    cls = import_object(config.target, "model.target")
    try:
        model = cls(**config.kwargs)
    except TypeError as exc:
        raise ConfigError([Problem("model.kwargs", f"{config.target}(**kwargs) failed: {exc}",
                                   "check the constructor's parameter names")]) from None
    except CHECKED_FAILURES as exc:  # noqa: BLE001 - the user's constructor may raise anything
        raise ConfigError([user_problem("model.target", f"{config.target}(**kwargs)",
                                        exc)]) from None
    if not isinstance(model, nn.Module):
        raise ConfigError([Problem("model.target", f"{config.target} built a "
                                   f"{type(model).__name__}, not a torch.nn.Module")])
    return model


def resolve_loss(config: "ModelConfig", task: str) -> str:
    """The loss name, with ``auto`` resolved by the task."""
    if config.loss != "auto":
        return config.loss
    return "cross_entropy" if task == "classification" else "mse"


def make_loss(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(output, target)``, summed over examples."""
    return LOSSES[name]


def check_model(config: "ModelConfig", feature_shape: tuple, outputs: int,
                task: str) -> list[Problem]:
    """Build the model on the meta device (no memory, no time) and run one fake batch."""
    loss = resolve_loss(config, task)
    if (loss == "cross_entropy") != (task == "classification"):
        wanted = "cross_entropy" if task == "classification" else "mse, l1 or smooth_l1"
        return [Problem("model.loss", f"{loss} does not fit a {task} dataset",
                        f"use {wanted} (or auto)")]
    try:
        with torch.device("meta"):
            model = build_model(config, feature_shape, outputs)
            out = model(torch.empty((2, *feature_shape)))
    except ConfigError as exc:
        return exc.problems
    except CHECKED_FAILURES as exc:  # noqa: BLE001 - a user model may raise anything
        return [Problem("model", f"the model fails on a batch of shape "
                        f"{[2, *feature_shape]}: {type(exc).__name__}: {exc}",
                        "check the model against the dataset's feature shape")]
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != (2, outputs):
        shape = list(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        return [Problem("model", f"the model outputs {shape} for a batch of 2; the "
                        f"{task} data needs [2, {outputs}]",
                        "set the model's output size to the classes (or targets)")]
    return []


def model_bytes(config: "ModelConfig", feature_shape: tuple, outputs: int) -> int:
    """Bytes of the model's parameters and buffers, measured on the meta device (nothing
    is allocated, so a model too big for any machine costs nothing to measure)."""
    with torch.device("meta"):
        return tensor_bytes(build_model(config, feature_shape, outputs))


def tensor_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers (on any device, meta included)."""
    return sum(t.numel() * t.element_size()
               for t in itertools.chain(model.parameters(), model.buffers()))


def count_parameters(model: nn.Module) -> int:
    """Trainable parameter count, for logs."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)

