"""Preflight of a model with its loss on the data: on the meta device (no memory, no
time), or, when the meta device cannot run it (Python that needs real values, as in
``if x.sum() > 0``), built on CPU and run on one real batch of 2 examples, with a
:class:`~csrun.core.config.problems.ConfigNotice` that says so.

Example::

    problems = check_fit(config.model, data, sample)   # sample: a real batch of 2
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ...config.problems import ConfigError, ConfigNotice, Problem
from ...cluster.embedding_lookup import SPARSE_OPTIMIZERS, sparse_update_problem
from ...config.user_code import CHECKED_FAILURES, UserCodeError, user_problem
from ...data.imported import Collate, ImportedData, first_batch
from ...distribute.device_lib import memory_bytes
from ...distribute.devices import default_compute_devices, default_parameter_device, resolve_device
from ...distribute.values import map_structure
from ..models import build_model, check_model, model_bytes, resolve_loss, tensor_bytes
from ..optimizers import NO_TABLES, table_parameters
from ..objectives import NamedLoss, is_loss_function, make_objective, not_a_tensor
from .devices import gib

__all__ = ["check_model_on_data", "check_fit", "check_model_memory", "check_sparse_in_ps"]


def check_model_on_data(model, data, dataset, strategy, optimizer=None) -> list[Problem]:
    """The model and its loss on a real batch of 2 examples (on the meta device first),
    then its memory on the parameter device and, in a ps job, its sparse gradients."""
    if isinstance(data, ImportedData):
        try:
            sample = first_batch(data, Collate(dataset.collate), 2)
        except ConfigError as exc:
            return exc.problems
    else:
        sample = (data.features[:2], data.targets[:2])
    problems = check_fit(model, data, sample)
    if problems or strategy is None:
        return problems
    with torch.device("meta"):  # built once for the checks that read its tensors
        built = build_model(model, data.feature_shape, data.outputs)
    return check_model_memory(model, built, data, strategy) or \
        _check_tables_optimizer(built, optimizer) or \
        check_sparse_in_ps(model, built, strategy, optimizer)


def _check_tables_optimizer(built: torch.nn.Module, optimizer) -> list[Problem]:
    """``optimizer.tables`` for a model without tables would train nothing."""
    tables = getattr(optimizer, "tables", None)
    if tables is None:
        return []
    if not table_parameters(built):
        return [NO_TABLES]
    dense = [f"{name}.weight" if name else "weight" for name, m in built.named_modules()
             if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and not m.sparse]
    if tables.target is None and tables.name == "SparseAdam" and dense:
        return [Problem("optimizer.tables.name", f"SparseAdam takes only sparse gradients, "
                        f"and {', '.join(dense[:3])} get dense ones (built with "
                        "sparse=False)", "build the tables with sparse=True, or use "
                        "Adagrad or SGD (sparse and dense gradients alike)")]
    return []


def check_fit(config, data, sample: Any) -> list[Problem]:
    """Every problem of the ``model`` section with ``data`` (a built-in source or a user's
    dataset) and ``sample``, a real batch of 2 examples as the replicas get them."""
    if config.kind != "import" and not is_loss_function(config.loss):
        if data.task is None:
            return [Problem("model.kind", f"a built-in {config.kind} sizes itself from a "
                            "built-in source; a dataset of your own needs your model",
                            "use model.kind: import")]
        return check_model(config, data.feature_shape, data.outputs, data.task)
    if data.task is None and config.loss == "auto":
        return [Problem("model.loss", "auto needs a built-in source to pick the loss",
                        "name one (cross_entropy, mse, ...) for (x, y) batches, or give "
                        "your own 'package.module:function'")]
    if data.task is None and not is_loss_function(config.loss) and \
            not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        return [Problem("model.loss", f"{config.loss} needs (x, y) batches; the dataset's "
                        f"are a {type(sample).__name__}", "give your own loss function, "
                        "'package.module:function' taking (model, batch)")]
    if data.task is not None and not is_loss_function(config.loss):
        loss = resolve_loss(config, data.task)
        if (loss == "cross_entropy") != (data.task == "classification"):
            return check_model(config, data.feature_shape, data.outputs, data.task)
    try:
        objective = make_objective(config, data.task)
        with torch.device("meta"):
            _run(build_model(config, data.feature_shape, data.outputs), objective,
                 map_structure(_to_meta, sample), data.outputs)
        return []
    except ConfigError as exc:
        return exc.problems
    except UserCodeError as exc:
        if exc.__cause__ is None:  # a wrong shape: as wrong on CPU
            return [_problem(exc)]
        reason = str(exc.__cause__)
    except CHECKED_FAILURES as exc:  # noqa: BLE001 - a user's model may raise anything on meta
        reason = f"{type(exc).__name__}: {exc}"
    return _check_on_cpu(config, data, sample, reason)


def _problem(exc: UserCodeError) -> Problem:
    return Problem("model.loss", exc.message.removeprefix("model.loss: "), exc.hint)


def _to_meta(leaf: Any) -> Any:
    return leaf.to("meta") if isinstance(leaf, torch.Tensor) else leaf


def _run(model: torch.nn.Module, objective, batch: Any, outputs: int | None) -> None:
    """The objective on ``batch``; a named loss first checks the output's shape."""
    if isinstance(objective, NamedLoss) and outputs is not None:
        out = model(batch[0])
        if not isinstance(out, torch.Tensor):
            raise ConfigError([Problem("model.loss", *not_a_tensor(objective.name,
                                                                    objective.model, out))])
        if tuple(out.shape[1:]) != (outputs,):
            shape = list(out.shape)
            raise ConfigError([Problem("model", f"the model outputs {shape} for a batch of "
                                       f"2; the data needs [2, {outputs}]", "set the model's"
                                       " output size to the classes (or targets)")])
    objective.tally(objective.stats(model, batch))


def _check_on_cpu(config, data, sample: Any, reason: str) -> list[Problem]:
    """Build on CPU and run ``sample`` (when the model fits in half the host's memory)."""
    note = f"model: not checked on the meta device ({reason:.120})"
    needed = model_bytes(config, data.feature_shape, data.outputs)
    available = memory_bytes(resolve_device("CPU:0"))
    if available is not None and needed > available // 2:
        warnings.warn(ConfigNotice(f"{note}; too big to build on CPU for a check: only its "
                                   "construction was checked"), stacklevel=2)
        return []
    try:
        objective = make_objective(config, data.task)
        model = build_model(config, data.feature_shape, data.outputs)
        with torch.no_grad():
            _run(model, objective, sample, data.outputs)
    except ConfigError as exc:
        return exc.problems
    except UserCodeError as exc:
        return [_problem(exc)]
    except CHECKED_FAILURES as exc:  # noqa: BLE001
        return [user_problem("model", "the model on a real batch of 2 examples", exc)]
    warnings.warn(ConfigNotice(f"{note}; checked on CPU with one real batch of 2 examples "
                               "instead"), stacklevel=2)
    return []


def check_model_memory(model, built: torch.nn.Module, data, strategy) -> list[Problem]:
    """The parameters and their gradients of ``built`` (the ``model`` section's, on the
    meta device) fit in the parameter device's memory: the least central storage needs
    (an optimizer keeps more)."""
    try:
        device = resolve_device(strategy.parameter_device) if strategy.parameter_device \
            else default_parameter_device(default_compute_devices())[0]
    except ValueError:  # reported by check_devices
        return []
    needed, available = 2 * tensor_bytes(built), memory_bytes(device)
    if available is None or needed <= available:
        return []
    # where the size comes from: the layer widths, the constructor's arguments, the data
    field = {"mlp": "model.hidden", "import": "model.kwargs"}.get(model.kind, "model")
    return [Problem(field, f"the model's parameters and gradients need {gib(needed)}, "
                    f"more than the {gib(available)} of the parameter device "
                    f"{device.short_name} (the data asks for {data.outputs} outputs)",
                    "make the model smaller (hidden, channels), or check the class "
                    "labels: the classes are the largest label + 1")]


def check_sparse_in_ps(model, built: torch.nn.Module, strategy, optimizer) -> list[Problem]:
    """In a ps job, sparse gradients (``nn.Embedding(sparse=True)``, ``EmbeddingBag``)
    are applied on the ps tasks with the optimizer's sparse update: an optimizer (or a
    setting of it, e.g. Adagrad's weight_decay) without one is refused here rather than
    at the first push."""
    if strategy.kind != "parameter_server" or optimizer is None:
        return []
    sparse = [f"{name}.weight" if name else "weight" for name, m in built.named_modules()
              if getattr(m, "sparse", False) is True]
    where, groups_of = "optimizer", getattr(optimizer, "param_groups", [])
    if getattr(optimizer, "tables", None) is not None:  # the tables' own optimizer
        where, optimizer, groups_of = "optimizer.tables", optimizer.tables, []
    cls = getattr(torch.optim, optimizer.name, None)
    if not sparse or not isinstance(cls, type) or optimizer.target is not None:
        return []
    base = {"lr": optimizer.lr, **optimizer.kwargs}
    groups = [base] + [{**base, **group.options()} for group in groups_of]
    why = sparse_update_problem(cls, groups)
    if why is None:
        return []
    field = f"{where}.name" if optimizer.name not in SPARSE_OPTIMIZERS else \
        f"{where}.param_groups" if sparse_update_problem(cls, [base]) is None \
        else f"{where}.kwargs"
    return [Problem(field, f"{', '.join(sparse[:3])} get sparse gradients (sparse=True), "
                    f"which {optimizer.name} with these settings cannot apply on the ps "
                    f"tasks ({why})",
                    f"use one of {', '.join(SPARSE_OPTIMIZERS)} without that setting, or "
                    "build the embedding with sparse=False (its looked-up rows then "
                    "update densely)")]
