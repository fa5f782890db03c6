"""A ps task's checkpoint file: its shards and their optimizer slots as safetensors.

Written by csrun itself in the safetensors layout (a little-endian header length, a JSON
header, then each tensor's bytes), each tensor streamed from its own memory: the
``safetensors`` library's writer first copies every tensor into one buffer, which for a
table of GiBs is that much more memory on the ps. Read back with the library
(``safe_open``: memory-mapped, so a ps that takes some rows of a shard reads only
those). The SHA-256 is computed as the bytes are written; the file is written to a
temporary name, flushed and renamed into place (atomic).

    record = write_file(folder, "ckpt-00000050.ps-0.safetensors", tensors, meta)
    with ShardFile(folder / record["file"], record["sha256"]) as f:
        f.rows("s3", 0, 100)
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import secrets
import struct

import torch

from ..config import strict_json

__all__ = ["write_file", "ShardFile", "ShardFileError"]

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
           torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
           torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_CHUNK = 64 << 20  # bytes written (and hashed) at a time


class ShardFileError(RuntimeError):
    """A checkpoint file that is missing, damaged or not what its index says."""


def write_file(folder: pathlib.Path, name: str, tensors: dict[str, torch.Tensor],
               metadata: dict) -> dict:
    """Write ``tensors`` (contiguous CPU tensors) and ``metadata`` (JSON data) as
    ``folder/name``, atomically; returns ``{"file", "bytes", "sha256"}``."""
    header: dict = {"__metadata__": {"csrun": json.dumps(metadata)}}
    offset = 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[key] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                       "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    path = folder / name
    tmp = folder / f".{name}.{secrets.token_hex(4)}.tmp"
    digest = hashlib.sha256()
    try:
        with open(tmp, "xb") as f:
            for chunk in [struct.pack("<Q", len(text)), text]:
                f.write(chunk)
                digest.update(chunk)
            for tensor in tensors.values():
                _stream(f, digest, tensor)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(folder)
    return {"file": name, "bytes": path.stat().st_size, "sha256": digest.hexdigest()}


def _stream(f, digest, tensor: torch.Tensor) -> None:
    flat = tensor.detach().contiguous().view(-1)
    data = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
    for start in range(0, len(data), _CHUNK):
        chunk = data[start:start + _CHUNK]
        f.write(chunk)
        digest.update(chunk)


def _fsync_dir(folder: pathlib.Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_sha256(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class ShardFile:
    """One ps's checkpoint file, checked against its SHA-256 before anything is read."""

    def __init__(self, path: pathlib.Path, sha256: str):
        from safetensors import safe_open  # the library reads what csrun wrote
        self.path = path
        try:
            if file_sha256(path) != sha256:
                raise ShardFileError(f"checkpoint file {str(path)!r} is corrupted: its "
                                     "SHA-256 does not match its manifest")
            self._file = safe_open(str(path), framework="pt")
        except OSError as exc:
            raise ShardFileError(f"checkpoint file {str(path)!r} cannot be read: "
                                 f"{exc.strerror or exc}") from None
        except Exception as exc:  # noqa: BLE001 - safetensors' own parse errors
            if isinstance(exc, ShardFileError):
                raise
            raise ShardFileError(f"checkpoint file {str(path)!r} is not a valid "
                                 f"safetensors file: {exc}") from None
        self.keys = set(self._file.keys())
        self.metadata = strict_json.loads((self._file.metadata() or {}).get("csrun", "{}"))

    def __enter__(self) -> "ShardFile":
        return self

    def __exit__(self, *exc) -> None:
        self._file = None

    def shape(self, key: str) -> list[int]:
        return list(self._file.get_slice(key).get_shape())

    def rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` of tensor ``key`` (a 0-d tensor whole)."""
        piece = self._file.get_slice(key)
        return self._file.get_tensor(key) if not piece.get_shape() else piece[start:stop]
