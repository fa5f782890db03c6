"""A plain PyTorch loop on 2 logical CPU replicas: the two lines marked ``csrun`` are all
that differ from the single-device script.

    python examples/data_parallel.py            # both models, 3 epochs each
    python examples/data_parallel.py --epochs 1

Part 1 trains an MLP on the UCI digits bundled with csrun (loss on the gathered output);
part 2 a Hugging Face-style model that computes its own loss in ``forward`` (a small
local stand-in: ``transformers`` is not needed). Each prints its held-out accuracy.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import csrun.core as cs                                            # csrun (1 of 2)


def digits() -> tuple[TensorDataset, TensorDataset]:
    """The 1,797 8x8 digits, scaled to [0, 1]; the last 297 held out."""
    with importlib.resources.files("csrun.core.data").joinpath("digits.npz").open("rb") as f:
        data = np.load(f)
        x = torch.tensor(data["images"], dtype=torch.float32).view(-1, 64) / 16.0
        y = torch.tensor(data["labels"], dtype=torch.int64)
    return TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])


# -- part 1: a plain script -------------------------------------------------------------
def train_mlp(epochs: int) -> float:
    torch.manual_seed(0)
    train, held_out = digits()
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(),
                          nn.Dropout(0.1), nn.Linear(128, 10))
    model = cs.DataParallel(model, device_ids=["CPU:0", "CPU:1"])  # csrun (2 of 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        model.train()
        for x, y in DataLoader(train, batch_size=100, shuffle=True):
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
    return accuracy(model, held_out, lambda out: out)


def accuracy(model: nn.Module, data: TensorDataset, logits_of) -> float:
    model.eval()
    with torch.no_grad():
        x, y = data.tensors
        return (logits_of(model(x)).argmax(1) == y).float().mean().item()


# -- part 2: a Hugging Face-style model -------------------------------------------------
@dataclasses.dataclass
class ClassifierOutput:
    """What ``transformers``' ``SequenceClassifierOutput`` holds that matters here."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


class TinyClassifier(nn.Module):
    """Returns its own loss, the mean over its batch, when given labels."""

    def __init__(self, features: int = 64, classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(features, 128), nn.GELU(), nn.Dropout(0.1))
        self.head = nn.Linear(128, classes)

    def forward(self, input_ids, labels=None):
        logits = self.head(self.body(input_ids))
        loss = F.cross_entropy(logits, labels) if labels is not None else None
        return ClassifierOutput(loss=loss, logits=logits)


def train_hf_style(epochs: int) -> float:
    torch.manual_seed(0)
    train, held_out = digits()
    model = cs.DataParallel(TinyClassifier(), device_ids=["CPU:0", "CPU:1"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(epochs):
        model.train()
        for x, y in DataLoader(train, batch_size=100, shuffle=True):
            optimizer.zero_grad()
            outputs = model(input_ids=x, labels=y)  # outputs.loss: the whole batch's mean
            outputs.loss.backward()
            optimizer.step()
    return accuracy(model, held_out, lambda out: out.logits)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args(argv)
    results = {"mlp": train_mlp(args.epochs), "hf_style": train_hf_style(args.epochs)}
    for name, value in results.items():
        print(f"{name}: held-out accuracy {value:.3f}")
    return results


if __name__ == "__main__":
    main()
