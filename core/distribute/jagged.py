"""Jagged features: a variable number of ids per example, as ``nn.EmbeddingBag`` takes
them natively (flat ids and offsets) and TorchRec's ``JaggedTensor`` holds them.

A :class:`JaggedTensor` is one leaf of a batch that splits by examples, as a tensor
splits by its first dimension: over replicas and over workers alike, each part with its
own examples' ids. A dict of them, one per feature, is TorchRec's
``KeyedJaggedTensor`` shape without TorchRec::

    batch = {"items": JaggedTensor.from_lengths(ids, lengths), "dense": x}
    bags = model.items(batch["items"].values, batch["items"].bag_offsets())

No padding is needed (on issue 37's model, 44% of the padded item feature was padding).
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["JaggedTensor"]


class JaggedTensor:
    """Ids of ``len(self)`` examples, example ``i``'s being
    ``values[offsets[i]:offsets[i + 1]]`` (``offsets`` holds one more entry than there
    are examples, its first 0); ``weights``: one per id (``per_sample_weights``)."""

    def __init__(self, values: torch.Tensor, offsets: torch.Tensor,
                 weights: torch.Tensor | None = None):
        if values.dim() != 1 or offsets.dim() != 1 or len(offsets) < 1:
            raise ValueError(f"a JaggedTensor takes 1-d values and offsets (one more than "
                             f"the examples), got shapes {list(values.shape)} and "
                             f"{list(offsets.shape)}")
        if weights is not None and weights.shape != values.shape:
            raise ValueError(f"weights must be one per id: {list(weights.shape)} for "
                             f"{list(values.shape)} ids")
        self.values, self.offsets, self.weights = values, offsets, weights

    @classmethod
    def from_lengths(cls, values: torch.Tensor, lengths: torch.Tensor,
                     weights: torch.Tensor | None = None) -> "JaggedTensor":
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64, device=values.device)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return cls(values, offsets, weights)

    @classmethod
    def collate(cls, examples: Sequence[torch.Tensor],
                weights: Sequence[torch.Tensor] | None = None) -> "JaggedTensor":
        """Each example's 1-d ids (and weights), as one batch."""
        lengths = torch.tensor([len(e) for e in examples], dtype=torch.int64)
        values = torch.cat(list(examples)) if examples else torch.empty(0, dtype=torch.int64)
        return cls.from_lengths(values, lengths,
                                torch.cat(list(weights)) if weights is not None else None)

    # -- as a batch leaf: examples first, split like a tensor's first dimension ----------
    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def shape(self) -> torch.Size:
        return torch.Size([len(self)])

    def dim(self) -> int:
        return 1

    @property
    def device(self) -> torch.device:
        return self.values.device

    def __getitem__(self, index: slice) -> "JaggedTensor":
        """The examples ``index`` (a slice with step 1), their ids only."""
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError("a JaggedTensor is indexed by a slice of its examples")
        first, stop, _ = index.indices(len(self))
        stop = max(first, stop)
        begin, end = int(self.offsets[first]), int(self.offsets[stop])
        weights = self.weights[begin:end] if self.weights is not None else None
        return JaggedTensor(self.values[begin:end], self.offsets[first:stop + 1] - begin,
                            weights)

    def to(self, *args, **kwargs) -> "JaggedTensor":
        weights = self.weights.to(*args, **kwargs) if self.weights is not None else None
        return JaggedTensor(self.values.to(*args, **kwargs),
                            self.offsets.to(*args, **kwargs), weights)

    def is_pinned(self) -> bool:
        return self.values.is_pinned() and self.offsets.is_pinned()

    def pin_memory(self) -> "JaggedTensor":
        weights = self.weights.pin_memory() if self.weights is not None else None
        return JaggedTensor(self.values.pin_memory(), self.offsets.pin_memory(), weights)

    # -- as EmbeddingBag takes it ----------------------------------------------------------
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def bag_offsets(self) -> torch.Tensor:
        """Each example's first id's position: ``nn.EmbeddingBag``'s ``offsets``."""
        return self.offsets[:-1]

    def __repr__(self) -> str:
        return (f"JaggedTensor({len(self)} examples, {len(self.values)} ids"
                f"{', weighted' if self.weights is not None else ''})")
