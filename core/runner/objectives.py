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
(in a replica, argmax, == and sum took ~0.15 ms of a 2-replica step), and a named loss's
outputs wait in :class:`PendingCorrect` to be counted when the count is read; evaluation,
which reduces the tallies over replicas, tallies inside the replica.

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
from .failures import PASSED_ON
from .models import LOSSES, resolve_loss

__all__ = ["NamedLoss", "LossFunction", "PendingCorrect", "make_objective",
           "is_loss_function", "batch_examples", "count_correct", "not_a_tensor"]


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
    model = ("model.target", config.target) if config.kind == "import" \
        else ("model.kind", config.kind)
    return NamedLoss(name, name == "cross_entropy", model)


def batch_examples(batch: Any) -> int:
    """The examples of a batch: the first dimension of its first tensor."""
    leaves = [leaf for leaf in flatten(batch) if isinstance(leaf, torch.Tensor)]
    return int(leaves[0].shape[0]) if leaves and leaves[0].dim() else 0


class NamedLoss:
    """A built-in loss of the model's output for ``x`` against ``y``. ``model``: the
    config key and value that name the model (what a failure is blamed on)."""

    def __init__(self, name: str, classify: bool,
                 model: tuple[str, str] = ("model", "the model")):
        self.name, self.classify, self._fn = name, classify, LOSSES[name]
        self.field, self.model = model
        self.what = f"{self.model} (loss {name})"

    def stats(self, model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        """The summed loss, the examples and, to tally, the output against ``y``."""
        x, y = batch
        output = model(x)
        if not isinstance(output, torch.Tensor):
            message, hint = not_a_tensor(self.name, self.model, output)
            raise UserCodeError(f"model.loss: {message}", hint)
        stats = {"loss": self._fn(output, y), "examples": int(x.shape[0])}
        if self.classify:
            stats["predicted"] = (output, y)  # detached after the run: one op less here
        return stats

    def tally(self, stats: dict[str, Any]) -> dict[str, Any]:
        """``stats`` with the correct predictions counted (0 for a regression loss)."""
        stats["correct"] = count_correct(self.tally_step([[stats]]))
        return stats

    def tally_step(self, runs: Sequence[Sequence[dict[str, Any]]]) -> list[tuple]:
        """A step's ``(output, targets)`` pairs, taken from each run's replica ``stats``
        and cut from their graphs, for :class:`PendingCorrect` to count later (none for
        a regression loss)."""
        return [_taken(stats) for run in runs for stats in run if "predicted" in stats]


class LossFunction:
    """The user's ``fn(model, batch) -> losses [B]`` or ``(losses, {name: [B]})``; a
    metric named ``accuracy`` (per example, 0 or 1) counts as correct predictions."""

    def __init__(self, target: str):
        self.name = target
        self.field, self.what = "model.loss", target
        self._fn = import_object(target, "model.loss")
        self.classify = False  # until a call returns an accuracy metric

    def stats(self, model: torch.nn.Module, batch: Any) -> dict[str, Any]:
        """The summed loss, the examples and, to tally, the per-example metrics."""
        examples = batch_examples(batch)
        try:
            result = self._fn(model, batch)
        except PASSED_ON:  # csrun's own (a ps that failed during a lookup): not the user's
            raise
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

    def tally_step(self, runs: Sequence[Sequence[dict[str, Any]]]) -> int:
        """Each run's replica ``stats`` tallied in place; returns the step's correct
        predictions, each replica's made whole once summed over its runs (a fractional
        accuracy counts the same however often the count is read)."""
        return sum(int(sum(float(self.tally(stats)["correct"]) for stats in replica))
                   for replica in zip(*runs))


RECIPE = ("docs/own-training.md, \"A model that returns a mean loss (Hugging Face "
          "style)\"")


def not_a_tensor(loss: str, model: str, output: Any) -> tuple[str, str]:
    """Why a named loss cannot take ``output``, and the recipe that fits such a model
    (the message and the hint)."""
    return (f"{loss} needs the model's output as a tensor; {model} returned a "
            f"{type(output).__name__} (a dict of outputs or a Hugging Face ModelOutput?)",
            "give your own loss function, 'package.module:function', that picks the "
            f"logits or the loss the model returns: {RECIPE}")


def _taken(stats: dict[str, Any]) -> tuple:
    output, targets = stats.pop("predicted")
    return output.detach(), targets


def count_correct(pairs: Sequence[tuple]) -> Any:
    """The correct predictions (argmax over dim 1) in ``(output, targets)`` pairs: one
    argmax, == and sum over each device's concatenated outputs. A tensor when the
    outputs share a device; a Python int when not (counts on two GPUs do not add)."""
    by_device: dict[torch.device, list[tuple]] = {}
    for pair in pairs:
        by_device.setdefault(pair[0].device, []).append(pair)
    counts = [(outputs.argmax(1) == targets).sum() for outputs, targets in
              (group[0] if len(group) == 1 else _concatenated(group)
               for group in by_device.values())]
    if len(counts) == 1:
        return counts[0]
    return sum(int(count) for count in counts)


def _concatenated(pairs: list[tuple]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.cat([o for o, _ in pairs]), torch.cat([y for _, y in pairs])


class PendingCorrect:
    """The correct predictions of training steps, counted when they are read.

    Counting a step (cat, argmax, ==, sum and a read) is a few small ops that cost
    ~10-15 µs each right after a run whatever their size: ~0.1 ms, 3% of a small model's
    2-replica step. A step's outputs (detached: their graphs go with the step) wait
    here instead and are counted together when the count is taken (a log line, a
    ``--metrics`` record, a checkpoint) or when their storage passes ``limit_bytes``.
    """

    def __init__(self, limit_bytes: int = 16 << 20):
        self.limit_bytes = limit_bytes
        self._pairs: list[tuple] = []
        self._bytes = 0
        self._counted = 0

    def add(self, correct: int | list[tuple]) -> None:
        """A step's count: a number, or ``(output, targets)`` pairs to count later."""
        if not isinstance(correct, list):
            self._counted += correct
            return
        self._pairs += correct
        # what they hold: a view's whole storage (a slice of a bigger output keeps it)
        self._bytes += sum(o.untyped_storage().nbytes() + y.untyped_storage().nbytes()
                           for o, y in correct)
        if self._bytes > self.limit_bytes:
            self._count()

    def take(self) -> int:
        """The correct predictions added since the last ``take``."""
        self._count()
        counted, self._counted = self._counted, 0
        return counted

    def _count(self) -> None:
        if self._pairs:
            self._counted += int(count_correct(self._pairs))
            self._pairs, self._bytes = [], 0


def _check_per_example(target: str, what: str, value: Any, examples: int) -> None:
    if isinstance(value, torch.Tensor) and tuple(value.shape) == (examples,):
        return
    shape = list(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
    raise UserCodeError(
        f"model.loss: {target} returned {what} of shape {shape} for a slice of {examples} "
        f"examples; it must return one value per example, shape [{examples}] (a mean "
        "loss, e.g. a Hugging Face model's, must be computed with reduction='none')")
