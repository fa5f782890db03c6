"""Exporting the final weights (``checkpoint.export: safetensors``): a plain
``.safetensors`` file keyed by the model's own ``state_dict`` keys, that anyone loads with
no csrun::

    from safetensors.torch import load_file
    model.load_state_dict(load_file("runs/x/model.safetensors"))

Written atomically (a temp file, fsync, rename), like the checkpoints.
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable

import torch
from safetensors.torch import save

from ..config.schema import RunConfig
from .checkpoint import write_atomic
from .errors import RunError
from .events import Notice

__all__ = ["export_safetensors", "export_final"]


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


def export_final(config: RunConfig, model: torch.nn.Module, is_chief: bool,
                 emit: Callable[[Any], None], note: Callable[[], str]) -> str | None:
    """``checkpoint.export``: the final weights as ``<dir>/model.safetensors`` (the
    chief's); the path written, or None. ``note`` says what a failure leaves behind.

    Raises:
      RunError: the file could not be written.
    """
    if config.checkpoint.export is None or not is_chief:
        return None
    path = pathlib.Path(config.checkpoint.dir) / "model.safetensors"
    try:
        export_safetensors(model, path)
    except OSError as exc:
        raise RunError(f"cannot export the final weights to {str(path)!r}: "
                       f"{exc.strerror or exc}; {note()}") from None
    emit(Notice(f"exported the final weights to {path}"))
    return str(path)
