"""A text classifier with its own dataset, collate and loss: batches are dicts of token
ids (int64), an attention mask and labels, as with Hugging Face tokenizers."""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

PAD, VOCAB = 0, 50
POSITIVE = (3, 4, 5)  # a sentence is positive when it holds more of these than of NEGATIVE
NEGATIVE = (6, 7, 8)


class Sentences(Dataset):
    """Seeded random "sentences" of 4 to 12 tokens; label 1 when positive words win."""

    def __init__(self, size: int = 256, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(size):
            length = int(torch.randint(4, 13, (), generator=g))
            ids = torch.randint(1, VOCAB, (length,), generator=g)
            score = sum(int((ids == t).sum()) for t in POSITIVE) - \
                sum(int((ids == t).sum()) for t in NEGATIVE)
            if score == 0:  # no tie: add a word that decides
                ids[0] = POSITIVE[0] if length % 2 else NEGATIVE[0]
                score = 1 if length % 2 else -1
            self.items.append({"input_ids": ids, "label": int(score > 0)})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        return self.items[index]


def pad_collate(examples: list[dict]) -> dict:
    """Pad the sentences of a batch to its longest; the mask marks real tokens."""
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), longest), PAD, dtype=torch.int64)
    for row, e in enumerate(examples):
        ids[row, :len(e["input_ids"])] = e["input_ids"]
    return {"input_ids": ids, "attention_mask": (ids != PAD).long(),
            "labels": torch.tensor([e["label"] for e in examples], dtype=torch.int64)}


class BagOfWords(nn.Module):
    """Embeddings averaged over the real tokens, then a linear layer."""

    def __init__(self, vocab: int = VOCAB, width: int = 16, classes: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, width, padding_idx=PAD)
        self.out = nn.Linear(width, classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).float()
        mean = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return self.out(mean)


def loss(model: nn.Module, batch: dict):
    """Per-example losses (reduction="none": csrun sums them over the global batch) and
    a per-example accuracy metric."""
    logits = model(batch["input_ids"], batch["attention_mask"])
    losses = F.cross_entropy(logits, batch["labels"], reduction="none")
    return losses, {"accuracy": (logits.argmax(1) == batch["labels"]).float()}
