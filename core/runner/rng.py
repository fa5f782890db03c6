"""The process's random generators: seeded from ``train.seed`` before anything draws, and
checkpointed whole (torch's, numpy's legacy global, Python's, CUDA's), so that a resumed
run draws what an uninterrupted one does (dropout masks, shuffles of user code)."""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["seed_everything", "GlobalGenerators"]


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy and Python's random."""
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


class GlobalGenerators:
    """The process-wide generators as one checkpointable state (tensors and plain data
    only: ``torch.load(weights_only=True)`` reads it back)."""

    def state_dict(self) -> dict:
        numpy_state = np.random.get_state(legacy=False)
        state = {"torch": torch.get_rng_state(), "python": random.getstate(),
                 "numpy": {"key": torch.from_numpy(numpy_state["state"]["key"]
                                                   .astype(np.int64)),
                           "pos": int(numpy_state["state"]["pos"]),
                           "has_gauss": int(numpy_state["has_gauss"]),
                           "gauss": float(numpy_state["gauss"])}}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        numpy_state = state["numpy"]
        np.random.set_state({"bit_generator": "MT19937",
                             "state": {"key": numpy_state["key"].numpy().astype(np.uint32),
                                       "pos": numpy_state["pos"]},
                             "has_gauss": numpy_state["has_gauss"],
                             "gauss": numpy_state["gauss"]})
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
