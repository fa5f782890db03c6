"""Exporting the final weights (``checkpoint.export: safetensors``): a plain
``.safetensors`` file keyed by the model's own ``state_dict`` keys, that anyone loads with
no csrun::

    from safetensors.torch import load_file
    model.load_state_dict(load_file("runs/x/model.safetensors"))

Written atomically (a temp file, fsync, rename), like the checkpoints.
"""

from __future__ import annotations

import pathlib

import torch
from safetensors.torch import save

from .checkpoint import write_atomic

__all__ = ["export_safetensors"]


def export_safetensors(model: torch.nn.Module, path: str | pathlib.Path) -> pathlib.Path:
    """Write ``model.state_dict()`` (tensors only) to ``path``; returns the path.

    Raises:
      OSError: it could not be written (nothing is left behind).
    """
    # safetensors refuses tensors sharing memory (tied weights) and views: own copies
    tensors = {key: value.detach().to("cpu", copy=True).contiguous()
               for key, value in model.state_dict().items() if isinstance(value, torch.Tensor)}
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = save(tensors, metadata={"format": "pt", "writer": "csrun"})
    write_atomic(path, lambda f: f.write(data))
    return path
