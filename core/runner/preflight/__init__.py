"""Every check of a config before anything runs: the one place they live.

Pydantic (:mod:`csrun.core.config`) checks types and ranges; these check meaning, against
this machine and its data:

* :mod:`.devices` -- the devices exist here, none repeats;
* :mod:`.cluster` -- a parameter-server job's cluster and task (``TF_CONFIG``, torchrun,
  Slurm), and the resolver built from them;
* :mod:`.data` -- the data loads and the pipeline yields (and ends) as trained;
* :mod:`.model` -- the model fits the data (built on the meta device) and the memory;
* :mod:`.optimizer` -- the optimizer and schedule accept their arguments;
* :mod:`.training` -- the step, evaluation and export options, and what a
  parameter-server job cannot do;
* :mod:`.outputs` -- ``checkpoint.dir`` and the output files of a run.

Each check runs when the sections it needs are valid, so one pass reports every problem.

Example::

    config = load_config("configs/quickstart.yaml", ["train.epochs=2"])
"""

from __future__ import annotations

import pathlib
from typing import Any, Mapping, Sequence

from ...config.loading import read_config, read_config_text
from ...config.problems import Problem
from ...config.schema import RunConfig
from ...data.imported import ImportedData
from .cluster import cluster_problems
from .data import check_batch_split, check_data, check_distribution
from .devices import check_devices, check_environment, replica_count
from .model import check_model_on_data
from .optimizer import check_optimizer
from .outputs import (check_checkpoint_dir, check_outputs, check_outside, check_run_options,
                      check_writable)
from .training import check_length, check_training

__all__ = ["load_config", "load_config_text", "preflight", "replica_count", "check_devices",
           "check_environment",
           "check_checkpoint_dir", "check_writable", "check_outputs", "check_outside",
           "check_run_options"]


def load_config(path: str | pathlib.Path, overrides: Sequence[str] = (), *,
                environ: Mapping[str, str] | None = None) -> RunConfig:
    """Read, override and validate a config file, and check it against this machine.

    :func:`csrun.core.config.loading.read_config` with the :func:`preflight` checks;
    ``environ`` is where a parameter-server job's cluster is read (default
    ``os.environ``).

    Raises:
      ConfigError: every problem found, each with its dotted path, ``file:line`` and hint.
    """
    return read_config(path, overrides, checks=(_checks(environ),))


def load_config_text(text: str, file: str | None = None, overrides: Sequence[str] = (), *,
                     environ: Mapping[str, str] | None = None) -> RunConfig:
    """:func:`load_config` for YAML text (``file`` names it in messages)."""
    return read_config_text(text, file, overrides, checks=(_checks(environ),))


def _checks(environ: Mapping[str, str] | None):
    # a bad CSRUN_LOGICAL_CPUS is the only problem told: every device check needs it
    return lambda sections: check_environment() or (preflight(sections) +
                                                    cluster_problems(sections, environ))


def preflight(sections: dict[str, Any]) -> list[Problem]:
    """Every problem of the valid ``sections`` (name -> model) alone and together, but
    the cluster's (:func:`.cluster.cluster_problems`)."""
    strategy, dataset, model = (sections.get(n) for n in ("strategy", "dataset", "model"))
    optimizer, train = sections.get("optimizer"), sections.get("train")
    problems: list[Problem] = []
    if strategy is not None:
        problems += check_devices(strategy)
    if optimizer is not None:
        problems += check_optimizer(optimizer)
    if sections.get("checkpoint") is not None:
        problems += check_checkpoint_dir(sections["checkpoint"])
    problems += check_training(sections) + check_length(train)
    if dataset is None:
        return problems
    if strategy is not None:
        problems += check_batch_split(strategy, dataset)
    data, pipeline, found = check_data(dataset, train.seed if train is not None else 0)
    problems += found
    if data is not None and model is not None:
        problems += check_model_on_data(model, data, dataset, strategy, optimizer)
    if isinstance(data, ImportedData) and data.iterable and train is not None and train.epochs:
        problems.append(Problem("train.epochs", "an IterableDataset has no known length, "
                                "so an epoch's steps are unknown", "use train.steps"))
    if pipeline is not None and strategy is not None and not _has(problems, "strategy"):
        problems += check_distribution(dataset, pipeline, replica_count(strategy), train)
    return problems


def _has(problems: list[Problem], section: str) -> bool:
    return any(p.path.split(".")[0] == section for p in problems)
