"""Several optimizers stepped as one, each over its own parameters: per-table optimizers
(``SparseAdam`` for the embedding tables beside ``AdamW`` for the dense part), as
TensorFlow's per-variable optimizers and TorchRec's ``CombinedOptimizer`` allow.

A plain loop with two optimizers works as it is (``tables.step(); dense.step()``): in a
parameter-server job each is built on the ps tasks over its own variables' shards. This
class is for code that wants one optimizer object (a runner, a learning-rate schedule,
one checkpoint entry): its ``param_groups`` are the inner optimizers' groups themselves,
so a schedule's changes (``lr``, momentum, betas) reach the optimizer that owns each
group, and through it the ps tasks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["CombinedOptimizer"]


class CombinedOptimizer(torch.optim.Optimizer):
    """``optimizers`` (disjoint parameters) stepped, zeroed and checkpointed as one.

    Example::

        tables = [m.weight for m in model.modules() if isinstance(m, nn.EmbeddingBag)]
        dense = [p for p in model.parameters() if all(p is not t for t in tables)]
        optimizer = CombinedOptimizer([torch.optim.SparseAdam(tables, lr=0.01),
                                       torch.optim.AdamW(dense, lr=0.001)])
    """

    def __init__(self, optimizers: Iterable[torch.optim.Optimizer]):
        self.optimizers = list(optimizers)
        if not self.optimizers or not all(isinstance(o, torch.optim.Optimizer)
                                          for o in self.optimizers):
            raise TypeError("CombinedOptimizer takes a list of torch.optim optimizers")
        # the inner groups themselves (add_param_group keeps each dict): one setting, one
        # place; torch refuses a parameter in two of them
        super().__init__([g for o in self.optimizers for g in o.param_groups], {})
        # what every one of them has (schedules read defaults: OneCycleLR cycles beta1
        # when "betas" is there, which must then be in every group)
        first, *rest = self.optimizers
        self.defaults = {k: v for k, v in first.defaults.items()
                         if all(k in o.defaults for o in rest)}

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for optimizer in self.optimizers:
            optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none)

    def state_dict(self) -> dict:
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict: dict) -> None:
        states = state_dict.get("optimizers") if isinstance(state_dict, dict) else None
        if not isinstance(states, list) or len(states) != len(self.optimizers):
            raise ValueError(f"this state is not of a CombinedOptimizer of "
                             f"{len(self.optimizers)} optimizers")
        for optimizer, state in zip(self.optimizers, states):
            optimizer.load_state_dict(state)
        # torch's load_state_dict makes new group dicts: share them again
        self.param_groups = [g for o in self.optimizers for g in o.param_groups]

    def __repr__(self) -> str:
        inner = ", ".join(type(o).__name__ for o in self.optimizers)
        return f"CombinedOptimizer({inner})"
