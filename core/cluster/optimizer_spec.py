"""The optimizer a ps task builds: what a worker sends of its own optimizer, and what
the ps makes of it.

The class travels as ``module:qualname`` (a user's subclass as itself: the ps finds it
among the modules it imported, as it runs the same program), the settings of every
param group as JSON; each push
carries the groups' settings again when they changed, so whatever a schedule changes
(``lr``, momentum, betas, ...) reaches the ps. A setting that cannot travel, or a class
the ps cannot import, is refused before training.
"""

from __future__ import annotations

import inspect
import math
import sys

import torch

from .transport import settings_from_json, settings_to_json

__all__ = ["optimizer_spec", "optimizer_class", "group_settings", "sparse_exact",
           "OptimizerRefused"]


class OptimizerRefused(ValueError):
    """This optimizer cannot be built on the ps tasks (said before any step)."""


def class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def optimizer_spec(optimizer: torch.optim.Optimizer, var_groups: dict[int, int],
                   key: int = 0) -> dict:
    """What a ps needs to build ``optimizer``'s twin over its shards (``var_groups``:
    var id -> param group; ``key``: which of the worker's optimizers it is)."""
    cls = type(optimizer)
    if "<locals>" in cls.__qualname__ or _resolve(class_path(cls)) is not cls:
        raise OptimizerRefused(
            f"{cls.__qualname__} (from {cls.__module__}) cannot be built on the ps tasks: "
            "a ps finds an optimizer class by its module and name, and this one is not "
            "found there (defined inside a function?); define it at the top level of a "
            "module every task imports")
    groups = group_settings(optimizer)
    return {"key": key, "class": class_path(cls),
            "defaults": _json_settings(optimizer.defaults, "defaults", cls),
            "groups": groups, "var_groups": {str(k): v for k, v in var_groups.items()}}


def group_settings(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Every param group's hyperparameters now, as JSON data."""
    return [_json_settings(g, f"param_groups[{i}]", type(optimizer))
            for i, g in enumerate(optimizer.param_groups)]


def _json_settings(settings: dict, where: str, cls: type) -> dict:
    out = settings_to_json(settings)
    lost = [k for k in settings if k != "params" and k not in out]
    if lost:
        raise OptimizerRefused(
            f"{cls.__name__}'s {where} setting {lost[0]!r} is a "
            f"{type(settings[lost[0]]).__name__}, which cannot travel to the ps tasks (they "
            "apply the updates); use a number, bool, string or tuple of numbers")
    bad = [k for k, v in out.items() if isinstance(v, float) and not math.isfinite(v)]
    if bad:
        raise OptimizerRefused(f"{cls.__name__}'s {where} setting {bad[0]!r} is "
                               f"{out[bad[0]]}; the ps tasks cannot apply it")
    return out


def optimizer_class(path: str) -> type:
    """The optimizer class named ``module:qualname`` (a ps, building its optimizer)."""
    cls = _resolve(path)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise OptimizerRefused(f"optimizer {path!r} is not among the modules this ps task "
                               "imported, or is not a torch.optim.Optimizer; every task must "
                               "run the same program (import the optimizer's module on the "
                               "ps tasks too)")
    return cls


def _resolve(path: str):
    module, colon, name = path.partition(":")
    if not colon:  # a torch.optim class by its name alone
        module, name = "torch.optim", path
    # only a module this process has imported already: a request never makes a ps
    # import code (config/targets.py's import_object is csrun's one dynamic import); a
    # ps runs the same program as the workers, which imported the optimizer's module
    value = sys.modules.get(module)
    for part in name.split("."):
        value = getattr(value, part, None)
    return value


def built(cls: type, groups: list[dict], defaults: dict) -> torch.optim.Optimizer:
    """``cls`` over ``groups`` (each with all its settings) with the worker's
    ``defaults``: passed as keywords where ``__init__`` takes them (AdamW's defaults hold
    Adam's ``decoupled_weight_decay``, which AdamW's ``__init__`` does not take), the rest
    set afterwards."""
    try:
        taken = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        taken = {}
    if any(p.kind is p.VAR_KEYWORD for p in taken.values()):
        keywords = defaults
    else:
        keywords = {k: v for k, v in defaults.items() if k in taken}
    optimizer = cls(groups, **keywords)
    optimizer.defaults.update(defaults)
    return optimizer


def apply_settings(optimizer: torch.optim.Optimizer, group_index: list[int],
                   settings: list[dict]) -> None:
    """Set each of ``optimizer``'s groups (worker group ``group_index[i]``) to the
    worker's ``settings`` of that group."""
    for group, index in zip(optimizer.param_groups, group_index):
        if index < len(settings):
            # every key, new ones too: a user's optimizer may read a key that its code or
            # a schedule adds to a group after the first step
            for key, value in settings_from_json(settings[index]).items():
                if key not in ("params", "param_names"):
                    group[key] = value


def sparse_exact(cls: type, settings: dict) -> bool:
    """Whether ``cls`` with ``settings`` takes a sparse gradient of some rows exactly as
    the dense gradient with zeros elsewhere: then a table the model reads densely
    (``sparse=False``) can take the sparse update of its looked-up rows, bit for bit, and
    the ps makes no table-sized gradient (Adagrad and SGD, with momentum too, can; Adam,
    or a weight decay, cannot). Tried on a 4-row variable for two steps of different
    rows: torch's own answer, whatever the class."""
    settings = settings_from_json({k: v for k, v in settings.items()
                                   if k not in ("params", "initial_lr")})
    steps = [(torch.tensor([1, 3]), torch.tensor([[0.5, -1.0], [2.0, 0.25]])),
             (torch.tensor([0, 3]), torch.tensor([[-0.75, 1.5], [0.125, 1.0]]))]
    try:
        dense = _stepped(cls, settings, [torch.zeros(4, 2).index_add_(0, ids, values)
                                         for ids, values in steps])
        with torch.sparse.check_sparse_tensor_invariants(enable=True):
            sparse = _stepped(cls, settings, [torch.sparse_coo_tensor(
                ids.unsqueeze(0), values, (4, 2), is_coalesced=True) for ids, values in steps])
    except (RuntimeError, ValueError, TypeError):
        return False
    return all(torch.equal(a, b) for a, b in zip(dense, sparse))


def _stepped(cls: type, settings: dict, grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """The weight and its state after ``cls`` stepped it with each of ``grads``; rows with
    a gradient at some step but not the next move at the next only if ``cls`` moves rows
    without a gradient."""
    weight = torch.nn.Parameter(torch.arange(8.0).view(4, 2) / 7)
    optimizer = cls([{**settings, "params": [weight]}])
    for grad in grads:
        weight.grad = grad
        optimizer.step()
    state = [v for v in optimizer.state[weight].values() if isinstance(v, torch.Tensor)]
    return [weight.detach()] + [s.to_dense() if s.is_sparse else s for s in state]
