"""A click model with jagged features: each example has a user, a varying number of
items it saw (multi-hot) and weighted tags, looked up in an EmbeddingBagCollection
without padding. Batches are ``{"item": JaggedTensor, "user": JaggedTensor, "tag":
JaggedTensor (with per-id weights), "clicked": float}``, TorchRec's KeyedJaggedTensor
shape without TorchRec."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from csrun.core import EmbeddingBagCollection, JaggedTensor

USERS, ITEMS, TAGS = 200, 500, 40
GOOD = torch.arange(ITEMS) % 7 < 3  # items a user is likely to click on


class Clicks(Dataset):
    """Seeded random sessions: 1 to 8 items seen, 0 to 3 weighted tags; clicked when
    most of the items seen are good ones."""

    def __init__(self, size: int = 1024, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.examples = []
        for _ in range(size):
            items = torch.randint(0, ITEMS, (int(torch.randint(1, 9, (), generator=g)),),
                                  generator=g)
            tags = torch.randint(0, TAGS, (int(torch.randint(0, 4, (), generator=g)),),
                                 generator=g)
            self.examples.append({
                "user": torch.randint(0, USERS, (1,), generator=g), "item": items,
                "tag": tags, "tag_weight": torch.rand(len(tags), generator=g),
                "clicked": float(GOOD[items].float().mean() > 0.5)})

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        return self.examples[index]


def collate(examples: list[dict]) -> dict:
    """One JaggedTensor per feature: flat ids and offsets, EmbeddingBag's own input."""
    return {"user": JaggedTensor.collate([e["user"] for e in examples]),
            "item": JaggedTensor.collate([e["item"] for e in examples]),
            "tag": JaggedTensor.collate([e["tag"] for e in examples],
                                        [e["tag_weight"] for e in examples]),
            "clicked": torch.tensor([e["clicked"] for e in examples])}


class Ranker(nn.Module):
    """Three tables in one collection (looked up in one request per ps), then an MLP."""

    def __init__(self, dim: int = 8, sparse: bool = True):
        super().__init__()
        self.tables = EmbeddingBagCollection({
            "user": nn.EmbeddingBag(USERS, dim, mode="sum", sparse=sparse),
            "item": nn.EmbeddingBag(ITEMS, dim, mode="mean", sparse=sparse),
            "tag": nn.EmbeddingBag(TAGS, dim, mode="sum", sparse=sparse)})
        self.head = nn.Sequential(nn.Linear(3 * dim, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, features: dict) -> torch.Tensor:
        pooled = self.tables({k: features[k] for k in ("user", "item", "tag")})
        return self.head(torch.cat([pooled["user"], pooled["item"], pooled["tag"]], 1)) \
            .squeeze(1)


def loss(model: nn.Module, batch: dict):
    """Per-example losses (csrun sums them over the global batch) and accuracy."""
    logits = model(batch)
    losses = F.binary_cross_entropy_with_logits(logits, batch["clicked"], reduction="none")
    return losses, {"accuracy": ((logits > 0).float() == batch["clicked"]).float()}
