"""Losses that depend on the whole batch, written so that any number of replicas trains
as one device (docs/own-training.md, "Losses that depend on the whole batch").

A replica's loss function sees only its slice of the batch. Two idioms need more:

* **in-batch negatives** (contrastive, InfoNCE): each example is scored against every
  other example of the batch. :func:`contrastive_loss` gathers the other replicas'
  embeddings with ``ReplicaContext.all_gather`` (differentiable: the gradient reaches the
  replica that made each embedding);
* **a class-weighted mean** (``F.cross_entropy(weight=...)``): the batch's sum of
  weights divides the weighted sum. :func:`weighted_loss` adds up that sum over the
  replicas with ``all_reduce``.

:func:`sliced_contrastive_loss` is the mistake they fix (negatives from the replica's
slice only): it trains differently with 1 and 2 replicas.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import csrun.core as cs

DIM, CLASSES = 8, 3
TEMPERATURE = 0.5
WEIGHTS = torch.tensor([1.0, 4.0, 0.5])  # class weights, as F.cross_entropy(weight=) takes


class Pairs(Dataset):
    """Seeded pairs of noisy views of one random point, and a class (imbalanced)."""

    def __init__(self, size: int = 64, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        points = torch.randn(size, DIM, generator=g)
        self.anchor = points + 0.1 * torch.randn(size, DIM, generator=g)
        self.positive = points + 0.1 * torch.randn(size, DIM, generator=g)
        self.label = torch.multinomial(torch.tensor([0.6, 0.1, 0.3]), size, True, generator=g)

    def __len__(self) -> int:
        return len(self.label)

    def __getitem__(self, index: int) -> dict:
        return {"anchor": self.anchor[index], "positive": self.positive[index],
                "label": self.label[index]}


class Encoder(nn.Module):
    """An embedding (``forward``) and a classifier head on it (``classify``)."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(DIM, width), nn.Tanh(), nn.Linear(width, width))
        self.head = nn.Linear(width, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.body(x), dim=1)

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def contrastive_loss(model, batch):
    """InfoNCE over the whole batch: each anchor against every positive of every replica.

    Per example (shape [B] of this replica's slice), so the runner's sum over replicas
    divided by the global batch is the one-device mean."""
    anchors, positives = model(batch["anchor"]), model(batch["positive"])
    context = cs.get_replica_context()
    every_positive = context.all_gather(positives, axis=0)  # the whole batch's, in order
    sizes = context.all_gather(torch.tensor([len(anchors)], device="cpu"), axis=0)
    first = int(sizes[:context.replica_id_in_sync_group].sum())  # this slice's offset
    logits = anchors @ every_positive.T / TEMPERATURE
    targets = torch.arange(first, first + len(anchors), device=logits.device)
    return F.cross_entropy(logits, targets, reduction="none")


def sliced_contrastive_loss(model, batch):
    """The mistake: negatives from this replica's slice only."""
    anchors, positives = model(batch["anchor"]), model(batch["positive"])
    logits = anchors @ positives.T / TEMPERATURE
    return F.cross_entropy(logits, torch.arange(len(anchors)), reduction="none")


def weighted_loss(model, batch):
    """``F.cross_entropy(logits, labels, weight=WEIGHTS)`` of the whole batch: each
    example's weighted loss, scaled so that the runner's sum over the batch divided by
    its example count is the weighted sum divided by the batch's total weight."""
    labels, weights = batch["label"], WEIGHTS.to(batch["label"].device)
    losses = F.cross_entropy(model.classify(batch["anchor"]), labels, weight=weights,
                             reduction="none")  # weights[label] * loss, per example
    context = cs.get_replica_context()
    count = torch.tensor(float(len(labels)), device=labels.device)
    examples = context.all_reduce("SUM", count)
    weight = context.all_reduce("SUM", weights[labels].sum())
    return losses * (examples / weight)
