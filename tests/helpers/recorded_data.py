"""A user's map-style dataset that records which examples were read, and the collate
function that records which were collated, for the tests of a parameter-server worker's
share of the input (each worker must read and collate only its own).

Configs name them as any importable code (the repository is on ``PYTHONPATH`` in the
tests)::

    dataset:
      source: {kind: import, target: "tests.helpers.recorded_data:Recorded",
               kwargs: {size: 43}}
      collate: "tests.helpers.recorded_data:collate"
"""

from __future__ import annotations

import threading

import torch
from torch.utils.data import Dataset, default_collate

_lock = threading.Lock()
collated: list[int] = []  # every example collated, in this process (its id: the label)


class Recorded(Dataset):
    """``size`` examples: ``x`` 4 features, ``y`` the example's index (so that a batch
    says which examples it holds); ``reads`` lists the indices read, in order."""

    def __init__(self, size: int = 43):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 4, generator=g)
        self.reads: list[int] = []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int):
        with _lock:
            self.reads.append(int(index))
        return self.x[index], torch.tensor(int(index))


def collate(examples: list):
    """``default_collate``, recording the examples' indices in :data:`collated`."""
    with _lock:
        collated.extend(int(y) for _, y in examples)
    return default_collate(examples)


class Net(torch.nn.Module):
    """A linear model of the 4 features."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x):
        return self.linear(x)[:, 0]


def loss(model, batch):
    """Per-example squared error against the index's parity."""
    x, index = batch
    return (model(x) - (index % 2).float()) ** 2
