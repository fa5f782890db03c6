"""Digests for reproducibility checks and checkpoint integrity.

``params_sha256`` is what CI compares between runs: same seed and config must give the same
digest, and a resumed run must end with the digest of an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import hashlib
import pathlib
from typing import BinaryIO

import torch

from ..cluster.embedding_lookup import RowTable, ServedModel, served_tables

__all__ = ["params_sha256", "file_sha256", "state_sha256"]


def state_sha256(state: dict[str, torch.Tensor],
                 tables: dict[str, RowTable] | None = None) -> str:
    """SHA-256 over a state dict: each entry's name, dtype, shape and bytes, sorted by
    name. ``tables``: entries read a chunk of rows at a time (a ps job's tables served
    by rows: the digest never holds one whole), the same digest as if in ``state``."""
    digest, tables = hashlib.sha256(), tables or {}
    for name in sorted({*state, *tables}):
        if name in tables:
            table = tables[name]
            digest.update(f"{name}|{table.dtype}|{tuple(table.shape)}|".encode())
            for rows in table.read_chunks():
                digest.update(_bytes(rows))
            continue
        tensor = state[name].detach().to("cpu").contiguous()
        digest.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        digest.update(_bytes(tensor))
    return digest.hexdigest()


def _bytes(tensor: torch.Tensor) -> bytes:
    tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""


def params_sha256(model: torch.nn.Module) -> str:
    """The digest of a model's final parameters and buffers (its ``state_dict``)."""
    return state_sha256(ServedModel(model).state_dict(), served_tables(model))


def file_sha256(path: str | pathlib.Path | BinaryIO, chunk: int = 1 << 20) -> str:
    """SHA-256 of a file's bytes, read in chunks: a path, or a file open for reading (read
    from where it stands to its end)."""
    digest = hashlib.sha256()
    with contextlib.nullcontext(path) if hasattr(path, "read") else open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()
