"""What each replica computes on its slice of a batch: the loss *summed* over its
examples, the example count, correct predictions and metric sums; the runner divides by
the global batch, so any number of replicas takes the same steps. The example count is a
Python int, not a tensor: each small op in a replica's step waits for the GIL the other
replicas hold (a step's ops there are timed ~30 µs each with 2 replicas), and the count
is known without one.

Two kinds: a named loss (``cross_entropy``, ``mse``, ...) on ``(x, y)`` batches, or the
user's ``model.loss: "package.module:function"``, called as ``fn(model, batch)`` on any
batch structure and returning per-example losses ``[B]``, optionally with
``{name: per-example metric [B]}``.

Counting correct predictions and summing metrics is split off (:meth:`tally`): a training
step tallies on the caller after the run, where its few small ops wait for no replica
(in a replica, argmax, == and sum took ~0.15 ms of a 2-replica step); evaluation, which
reduces the tallies over replicas, tallies inside the replica.

Example::

    objective = make_objective(config.model, task="classification")
    stats = objective.stats(model, batch)       # {"loss": sum, "examples": B, ...}
    stats = objective.tally(stats)              # {..., "correct": n, "metrics": {...}}
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..config.targets import import_object
from ..config.user_code import UserCodeError, user_code_error
from ..distribute.values import flatten
from .models import LOSSES, resolve_loss

__all__ = ["NamedLoss", "LossFunction", "make_objective", "is_loss_function",
           "batch_examples"]


def is_loss_function(loss: str) -> bool:
    """True for ``"package.module:function"`` (a named loss has no colon)."""
    return ":" in loss


def make_objective(config, task: str | None) -> "NamedLoss | LossFunction":
    """The objective of the ``model`` section (``task`` resolves ``loss: auto``).

    Raises:
      ConfigError: the loss function does not import.
    """
    if is_loss_function(config.loss):
        return LossFunction(config.loss)
    name = resolve_loss(config, task or "classification")  # no task: auto was refused
    return NamedLoss(name, name == "cross_entropy")


def batch_examples(batch: Any) -> int:
    """The examples of a batch: the first dimension of its first tensor."""
    leaves = [leaf for leaf in flatten(batch) if isinstance(leaf, torch.Tensor)]
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() else 0


class NamedLoss:
    """A built-in loss of the model's output for ``x`` against ``y``."""

    def __init__(self, name: str, classify: bool):
        self.name, self.classify, self._fn = name, classify, LOSSES[name]

    def stats(self, model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        """The summed loss, the examples and, to tally, the output against ``y``."""
        x, y = batch
        output = model(x)
        stats = {"loss": self._fn(output, y), "examples": int(x.shape[0])}
        if self.classify:
            stats["predicted"] = (output, y)  # not detached: detach is one more op here
        return stats

    def tally(self, stats: dict[str, Any]) -> dict[str, Any]:
        """``stats`` with the correct predictions counted (0 for a regression loss)."""
        stats["correct"] = self.tally_step([stats])
        return stats

    def tally_step(self, replicas: Sequence[dict[str, Any]]) -> Any:
        """The correct predictions of a step's replicas (their outputs dropped from
        their ``stats``): counted in one pass where the outputs share a device, as each
        op costs ~10 µs here whatever its size."""
        pairs = [stats.pop("predicted") for stats in replicas if "predicted" in stats]
        if len(pairs) > 1 and len({output.device for output, _ in pairs}) == 1:
            with torch.no_grad():  # the outputs still require grad: record nothing
                outputs = torch.cat([output for output, _ in pairs])
            return (outputs.argmax(1) == torch.cat([y for _, y in pairs])).sum()
        return sum((output.argmax(1) == y).sum() for output, y in pairs)


class LossFunction:
    """The user's ``fn(model, batch) -> losses [B]`` or ``(losses, {name: [B]})``; a
    metric named ``accuracy`` (per example, 0 or 1) counts as correct predictions."""

    def __init__(self, target: str):
        self.name = target
        self._fn = import_object(target, "model.loss")
        self.classify = False  # until a call returns an accuracy metric

    def stats(self, model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        """The summed loss, the examples and, to tally, the per-example metrics."""
        examples = batch_examples(batch)
        try:
            result = self._fn(model, batch)
        except Exception as exc:  # noqa: BLE001 - the user's model or loss raised
            raise user_code_error("model.loss", self.name, exc) from exc
        losses, metrics = result if isinstance(result, tuple) and len(result) == 2 \
            else (result, {})
        _check_per_example(self.name, "losses", losses, examples)
        if not isinstance(metrics, dict):
            raise UserCodeError(f"model.loss: {self.name} returned {type(metrics).__name__}"
                                " as its metrics; return (losses, {name: tensor [B]})")
        for name, values in metrics.items():
            _check_per_example(self.name, f"metric {name!r}", values, examples)
        self.classify = self.classify or "accuracy" in metrics
        return {"loss": losses.sum(), "examples": examples, "per_example": metrics}

    def tally(self, stats: dict[str, Any]) -> dict[str, Any]:
        """``stats`` with the metrics summed; ``accuracy``'s sum is the correct count."""
        metrics = stats.pop("per_example", {})
        stats["metrics"] = {str(k): v.detach().sum().double() for k, v in metrics.items()}
        stats["correct"] = stats["metrics"].get("accuracy", 0)
        return stats

    def tally_step(self, replicas: Sequence[dict[str, Any]]) -> Any:
        """Each replica's ``stats`` tallied in place; returns their correct predictions."""
        return sum(self.tally(stats)["correct"] for stats in replicas)


def _check_per_example(target: str, what: str, value: Any, examples: int) -> None:
    if isinstance(value, torch.Tensor) and tuple(value.shape) == (examples,):
        return
    shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise UserCodeError(
        f"model.loss: {target} returned {what} of shape {shape} for a slice of {examples} "
        f"examples; it must return one value per example, shape [{examples}] (a mean "
        "loss, e.g. a Hugging Face model's, must be computed with reduction='none')")
