"""Mixed precision of a training step (``train.precision``): ``bf16`` runs each replica's
forward under ``torch.autocast`` with bfloat16 (CPU or GPU); ``fp16`` under float16 with a
gradient scaler (GPU replicas only: CPU float16 autocast is slow and unscaled float16
gradients underflow). Parameters, gradients and optimizer state stay float32.

Autocast is per thread, so each replica enters it itself (:meth:`Precision.autocast`).
The loss scale is read once per step, before the replicas run, so that they need not
share the scaler::

    scale = precision.loss_scale()                      # 1.0 unless fp16
    # in each replica: with precision.autocast(device_type): ... (loss * scale).backward()
    precision.unscale(optimizer)                        # before clipping
    precision.step(optimizer)                           # skips a step with inf/NaN grads
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["Precision"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """``mode``: ``fp32``, ``bf16`` or ``fp16``; ``parameter_device``: where the summed
    gradients are (the scaler unscales them there)."""

    def __init__(self, mode: str, parameter_device: torch.device):
        self.mode, self.dtype = mode, _DTYPES.get(mode)
        self.scaler = None
        if mode == "fp16":
            self.scaler = torch.amp.GradScaler(parameter_device.type)
            self.scaler.scale(torch.zeros((), device=parameter_device))  # creates its scale

    def autocast(self, device_type: str):
        """The replica's forward context (nothing for fp32)."""
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type, dtype=self.dtype)

    def loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None else 1.0

    def unscale(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is None:
            optimizer.step()
            return
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_state_dict(self, state: dict | None) -> None:
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
