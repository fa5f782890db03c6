"""A user's dataset and collate function that fail on cue, for the data-fault tests.

Configs name them as any importable code (the repository is on ``PYTHONPATH`` in the
tests)::

    dataset:
      source: {kind: import, target: "tests.helpers.faulty_data:Blobs",
               kwargs: {crash_at: 30}}
      collate: "tests.helpers.faulty_data:late_string"
    model: {kind: import, target: "tests.helpers.faulty_data:Net", loss: cross_entropy}
"""

from __future__ import annotations

import ctypes
import threading

import torch
from torch.utils.data import Dataset, default_collate, get_worker_info

LATE_STRING_AFTER = 4  # late_string's first calls collate as default_collate does
_calls = {"collate": 0}


class Blobs(Dataset):
    """``size`` random (x: 4 features, y: 3 classes) examples.

    Args:
      crash_at: reading this index in a DataLoader worker crashes the worker (a
        segmentation fault, as a bug in native code would); -1: never.
      thread: start a non-daemon thread that never ends (as a careless prefetcher does).
    """

    def __init__(self, size: int = 64, crash_at: int = -1, thread: bool = False):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 4, generator=g)
        self.y = torch.randint(0, 3, (size,), generator=g)
        self.crash_at = crash_at
        if thread:
            threading.Thread(target=threading.Event().wait, name="user-prefetcher").start()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        if index == self.crash_at and get_worker_info() is not None:
            ctypes.string_at(0)  # reads address 0: SIGSEGV
        return self.x[index], self.y[index]


def late_string(examples: list):
    """default_collate, until its call number ``LATE_STRING_AFTER + 1``: a string."""
    _calls["collate"] += 1
    if _calls["collate"] > LATE_STRING_AFTER:
        return "not a batch"
    return default_collate(examples)


def reset() -> None:
    _calls["collate"] = 0


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)
