"""What devices this machine offers and where a default strategy would put things.

TF's ``device_lib.list_local_devices`` for ``csrun inspect-devices``.

Example::

    report = list_local_devices()
    print(report["default_placement"]["parameter_device"])
"""

from __future__ import annotations

import os
from typing import Any

import torch

from .devices import (LogicalDevice, default_compute_devices, default_parameter_device,
                      local_devices)

__all__ = ["list_local_devices", "memory_bytes"]


def memory_bytes(device: LogicalDevice) -> int | None:
    """Total memory of ``device``: the host's RAM for (logical) CPUs, a GPU's own memory;
    None where it cannot be known."""
    if device.is_gpu:
        if not torch.cuda.is_available() or device.index >= torch.cuda.device_count():
            return None
        return int(torch.cuda.get_device_properties(device.index).total_memory)
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None


def list_local_devices() -> dict[str, Any]:
    """Every local device and TF's default placement of a ``CentralStorageStrategy()``.

    Returns:
      ``{"devices": [...], "default_placement": {...}, "host": {...}}``. Each device has
      ``name`` (TF's full name), ``short_name``, ``torch``, ``kind`` and ``memory_bytes``;
      GPUs add ``model`` and ``capability``.
    """
    compute = default_compute_devices()
    parameter, spelling = default_parameter_device(compute)
    return {
        "devices": local_devices(),
        "default_placement": {
            "compute_devices": [d.short_name for d in compute],
            "parameter_device": parameter.short_name,
            "parameter_device_reported": spelling,
            "rule": "TF's default: every local GPU computes, else the CPU; parameters on "
                    "the only compute device, else on the CPU",
        },
        "host": {"cpu_cores": os.cpu_count(), "torch": torch.__version__,
                 "cuda_available": torch.cuda.is_available(),
                 "cuda_version": torch.version.cuda},
    }
