"""Per-step metrics written as a run goes: JSON lines, and TensorBoard event files.

``--metrics PATH`` appends one JSON object per step (a resumed run appends after the
steps it re-runs, so readers keep the last line of each step). Lines are whole: a write
that fails (a full disk) is cut back to the line's start, and a torn last line left by a
crash is dropped before appending. ``--tensorboard DIR``
writes event files when the optional ``tensorboard`` package is installed
(``pip install 'csrun[tensorboard]'``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
from typing import Any

__all__ = ["MetricSinks", "OutputError", "tensorboard_available", "drop_torn_line"]


class OutputError(RuntimeError):
    """An output file (``--metrics``, ``--json``, ...) cannot be written (exit code 1);
    the message names the option and the path."""

    @classmethod
    def of(cls, option: str, path: str, exc: OSError) -> "OutputError":
        return cls(f"{option}: cannot write {path!r}: {exc.strerror or exc}")


def tensorboard_available() -> bool:
    """Whether TensorBoard event files can be written here."""
    return importlib.util.find_spec("tensorboard") is not None


def drop_torn_line(path: pathlib.Path, chunk: int = 1 << 16) -> None:
    """Cut a last line that has no newline (a crash or a full disk tore it), so that
    what is appended next starts a line of its own."""
    with open(path, "rb+") as f:
        end = f.seek(0, os.SEEK_END)
        position = end
        while position > 0:
            start = max(0, position - chunk)
            f.seek(start)
            block = f.read(position - start)
            newline = block.rfind(b"\n")
            if newline >= 0:
                if start + newline + 1 < end:
                    f.truncate(start + newline + 1)
                return
            position = start
        f.truncate(0)


class _JsonLines:
    def __init__(self, path: str):
        self._path = path
        target = pathlib.Path(path)
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            if target.is_file():
                drop_torn_line(target)
            self._file = open(target, "ab", buffering=0)  # unbuffered: truncate can undo
        except OSError as exc:
            raise OutputError.of("--metrics", path, exc) from None

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        data, start = (json.dumps(clean) + "\n").encode(), self._file.tell()
        try:
            written = 0
            while written < len(data):  # a raw write may be partial
                written += self._file.write(data[written:])
        except OSError as exc:  # keep lines whole: cut back what part of it got written
            try:
                self._file.truncate(start)
            except OSError:
                pass
            raise OutputError.of("--metrics", self._path, exc) from None

    def close(self) -> None:
        self._file.close()


class _TensorBoard:
    def __init__(self, directory: str):
        from torch.utils.tensorboard import SummaryWriter
        self._writer = SummaryWriter(directory)

    def write(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key in ("loss", "accuracy", "learning_rate", "examples_per_s"):
            value = record.get(key)
            if value is not None:
                self._writer.add_scalar(f"train/{key}", value, step)
        for replica, seconds in enumerate(record.get("step_time_s", [])):
            self._writer.add_scalar(f"replica/{replica}/step_time_s", seconds, step)

    def close(self) -> None:
        self._writer.close()


class MetricSinks:
    """Where per-step records go (none, JSON lines, TensorBoard, or both).

    Args:
      metrics_path: JSON-lines file to append to, or None.
      tensorboard_dir: TensorBoard log directory, or None.
    """

    def __init__(self, metrics_path: str | None = None, tensorboard_dir: str | None = None):
        self._sinks: list = []
        if metrics_path:
            self._sinks.append(_JsonLines(metrics_path))
        if tensorboard_dir:
            self._sinks.append(_TensorBoard(tensorboard_dir))

    @property
    def active(self) -> bool:
        """Whether records go anywhere (a step's record is made only then)."""
        return bool(self._sinks)

    def write(self, record: dict[str, Any]) -> None:
        for sink in self._sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []
