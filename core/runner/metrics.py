"""Per-step metrics written as a run goes: JSON lines, and TensorBoard event files.

``--metrics PATH`` appends one JSON object per step (a resumed run appends after the
steps it re-runs, so readers keep the last line of each step). ``--tensorboard DIR``
writes event files when the optional ``tensorboard`` package is installed
(``pip install 'csrun[tensorboard]'``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
from typing import Any

__all__ = ["MetricSinks", "tensorboard_available"]


def tensorboard_available() -> bool:
    """Whether TensorBoard event files can be written here."""
    return importlib.util.find_spec("tensorboard") is not None


class _JsonLines:
    def __init__(self, path: str):
        target = pathlib.Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(target, "a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                 for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

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

    def write(self, record: dict[str, Any]) -> None:
        for sink in self._sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self._sinks:
            sink.close()
        self._sinks = []
