"""The cluster of a config: ``strategy.cluster``/``strategy.task``, ``TF_CONFIG``, or the
variables of torchrun or Slurm's ``srun`` (with ``strategy.num_ps``), in that order.

A ``strategy.kind: parameter_server`` config names its cluster (the ``host:port`` of every
chief, worker and ps task) and this process's task in the config, or leaves them to the
``TF_CONFIG`` environment variable, as TF does::

    TF_CONFIG='{"cluster": {"worker": ["h1:2222", "h2:2222"], "ps": ["h3:2222"]},
                "task": {"type": "worker", "index": 1}}'

When both give a cluster (or a task) they must agree. Every problem is reported with its
dotted path; those that come from ``TF_CONFIG`` say so (``origin``), so a user fixes the
variable, not the file.

Example::

    resolver = cluster_resolver(config.strategy)    # a SimpleClusterResolver
    resolver.task_type, resolver.task_id            # ("worker", 1)
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from ...cluster.launchers import launcher_cluster
from ...cluster.resolvers import (TF_CONFIG_SHAPE, ClusterError, ClusterProblem, ClusterSpec,
                                  SimpleClusterResolver, cluster_spec_problems,
                                  parse_tf_config, task_problems, training_problems)
from ...config.problems import ConfigError, Problem
from ...distribute.devices import DeviceError, resolve_devices
from .devices import replica_count

__all__ = ["cluster_problems", "cluster_resolver", "TF_CONFIG_ORIGIN", "TRAINING_JOBS"]

TF_CONFIG_ORIGIN = "environment TF_CONFIG"
TRAINING_JOBS = ("chief", "worker", "ps")


def cluster_problems(sections: dict[str, Any], environ: Mapping[str, str] | None = None
                     ) -> list[Problem]:
    """Every problem of a parameter-server config's cluster and task (none for central
    storage): no cluster at all, a malformed ``TF_CONFIG``, a task that does not exist,
    settings that cannot work in a cluster."""
    strategy = sections.get("strategy")
    if strategy is None or strategy.kind != "parameter_server":
        return []
    resolver, problems = _resolve(strategy, os.environ if environ is None else environ)
    dataset = sections.get("dataset")
    if resolver is not None and dataset is not None and dataset.distribute == "per_replica":
        problems += _per_replica_problems(dataset, strategy, resolver.cluster_spec())
    elif resolver is not None and dataset is not None:
        problems += _empty_share_problems(dataset, resolver.cluster_spec())
    if strategy.compute_devices is not None and strategy.num_gpus_per_worker:
        problems.append(Problem("strategy.num_gpus_per_worker", "is set together with "
                                "compute_devices, which already names the replicas",
                                "keep one of the two"))
    elif strategy.num_gpus_per_worker:
        problems += _check_gpus(strategy.num_gpus_per_worker)
    return problems


def _per_replica_problems(dataset: Any, strategy: Any, spec: ClusterSpec) -> list[Problem]:
    """Per-replica batches divide the global batch among every replica of the job (each
    worker's replicas times the training tasks), not only this worker's."""
    workers = spec.num_tasks("chief") + spec.num_tasks("worker")
    local = len(strategy.compute_devices) if strategy.compute_devices else \
        strategy.num_gpus_per_worker or 1  # ParameterServerStrategy's default: CPU:0
    replicas = workers * local
    k, batch = next(((k, s) for k, s in enumerate(dataset.steps) if s.op == "batch"),
                    (None, None))
    # (one that does not divide among this worker's replicas is .data's to report)
    if batch is None or batch.size % replicas == 0 or batch.size % replica_count(strategy):
        return []
    return [Problem(f"dataset.steps.{k}.size", f"the global batch size {batch.size} does "
                    f"not divide among the job's {replicas} replicas ({workers} workers x "
                    f"{local}; distribute: per_replica)", f"use a multiple of {replicas}, "
                    f"e.g. {batch.size // replicas * replicas or replicas}")]


def _empty_share_problems(dataset: Any, spec: ClusterSpec) -> list[Problem]:
    """With ``distribute: global`` each of W workers takes ceil(B / W) consecutive
    examples of a global batch of B (TF's split): a batch that leaves the last worker
    none leaves it none in every step, and it could never train."""
    workers = spec.num_tasks("chief") + spec.num_tasks("worker")
    k, batch = next(((k, s) for k, s in enumerate(dataset.steps) if s.op == "batch"),
                    (None, None))
    if batch is None or workers < 2:
        return []
    share = -(-batch.size // workers)
    if (workers - 1) * share < batch.size:
        return []
    fits = next(b for b in range(batch.size + 1, batch.size + workers * workers + 1)
                if (workers - 1) * -(-b // workers) < b)
    return [Problem(f"dataset.steps.{k}.size", f"a global batch of {batch.size} over "
                    f"{workers} workers leaves the last worker no example in any step (each "
                    f"takes up to ceil({batch.size} / {workers}) = {share}, TF's split)",
                    f"use a global batch of at least {fits}, e.g. a multiple of {workers}")]


def _check_gpus(count: int) -> list[Problem]:
    try:
        resolve_devices([f"GPU:{i}" for i in range(count)])
    except DeviceError as exc:
        return [Problem("strategy.num_gpus_per_worker", f"{count} GPU(s) per worker: "
                        f"{exc.message}", exc.hint)]
    return []


def cluster_resolver(strategy: Any, environ: Mapping[str, str] | None = None
                     ) -> SimpleClusterResolver:
    """The resolver of a valid parameter-server ``strategy`` section.

    Raises:
      ConfigError: the problems :func:`cluster_problems` reports.
    """
    resolver, problems = _resolve(strategy, os.environ if environ is None else environ)
    if problems:
        raise ConfigError(problems)
    return resolver


def _resolve(strategy: Any, environ: Mapping[str, str]
             ) -> tuple[SimpleClusterResolver | None, list[Problem]]:
    """Which source wins: ``strategy.cluster`` and ``TF_CONFIG`` (which must agree), then
    torchrun's variables, then Slurm's (:mod:`csrun.core.cluster.launchers`)."""
    try:
        env = parse_tf_config(environ.get("TF_CONFIG", ""))
    except ClusterError as exc:
        return None, _problems(exc.problems, TF_CONFIG_ORIGIN, TF_CONFIG_SHAPE)
    except ValueError as exc:  # json's int() of more than 4300 digits: no JSONDecodeError
        return None, [Problem("strategy.cluster", "TF_CONFIG cannot be read: " +
                              str(exc).split("; use sys.")[0], TF_CONFIG_SHAPE,
                              origin=TF_CONFIG_ORIGIN)]
    env_cluster = _jobs(env.cluster) if env and env.cluster is not None else None
    mine = _jobs(strategy.cluster.model_dump()) if strategy.cluster is not None else None
    env_task, source, task_origin = env and env.task, "TF_CONFIG", TF_CONFIG_ORIGIN
    if mine is None and env_cluster is None:
        try:
            launched = launcher_cluster(strategy.num_ps, environ)
        except ClusterError as exc:
            return None, _problems(exc.problems, LAUNCHER_ORIGIN)
        if launched is None:
            return None, [_no_cluster()]
        env_cluster, env_task, source = launched.cluster, launched.task, launched.source
        task_origin = f"environment ({launched.source})"
    if mine is not None and env_cluster is not None and mine != env_cluster:
        return None, [Problem(
            "strategy.cluster", f"differs from TF_CONFIG's cluster ({_short(env_cluster)})",
            "give the cluster in one place: remove strategy.cluster (csrun launch sets "
            "TF_CONFIG itself), or unset TF_CONFIG")]
    spec, origin = (mine, None) if mine is not None else (env_cluster, task_origin)
    problems = _problems(_spec_problems(spec), origin) + _num_ps_problems(strategy, spec)
    task, missing = _task(strategy, env_task, source)
    if problems or missing:
        return None, problems + missing
    problems = _problems(_task_problems(ClusterSpec(spec), *task),
                         None if strategy.task else task_origin)
    return (None, problems) if problems else (SimpleClusterResolver(spec, *task), [])


LAUNCHER_ORIGIN = "environment (torchrun or Slurm variables)"


def _no_cluster() -> Problem:  # a new one each time: reporting sets its location
    return Problem(
        "strategy.cluster", "kind: parameter_server needs a cluster, and neither "
        "strategy.cluster, the TF_CONFIG environment variable, nor torchrun's or Slurm's "
        "variables give one",
        "start the whole job on this machine with `csrun launch CONFIG --workers 2 --ps "
        "1`, start it with torchrun and strategy.num_ps, set TF_CONFIG for each task, or "
        "list the tasks' host:port addresses in strategy.cluster (chief, worker, ps)")


def _num_ps_problems(strategy: Any, spec: dict) -> list[Problem]:
    count = len(spec.get("ps", []))
    if strategy.num_ps is None or strategy.num_ps == count:
        return []
    return [Problem("strategy.num_ps", f"is {strategy.num_ps}, but the cluster lists "
                    f"{count} ps task(s)", "leave num_ps out when the cluster is given "
                    "(it is for torchrun and Slurm jobs), or make them agree")]


def _problems(found: list[ClusterProblem], origin: str | None, hint: str | None = None
              ) -> list[Problem]:
    """The cluster layer's problems as the config's: TF_CONFIG's ``cluster``/``task``
    stand for ``strategy.cluster``/``strategy.task``."""
    return [Problem(".".join(map(str, ("strategy",) + (p.path or ("cluster",)))), p.message,
                    p.hint or hint, origin=origin) for p in found]


def _jobs(cluster: dict) -> dict[str, list[str]]:
    """The jobs that have tasks (an empty list is the same as no job)."""
    return {job: list(addresses) for job, addresses in cluster.items() if addresses}


def _short(cluster: dict) -> str:
    text = json.dumps(cluster)
    return text if len(text) <= 120 else text[:119] + "…"


def _spec_problems(spec: dict) -> list[ClusterProblem]:
    """All that is wrong with a parameter-server job's cluster: its shape, no ps, no task
    to train."""
    needs_ps = [] if spec.get("ps") else [ClusterProblem(
        ("cluster", "ps"), "the cluster has no ps task: a parameter-server job needs at "
        "least one", "add a host:port under ps")]
    return needs_ps + cluster_spec_problems(spec) + training_problems(spec)


def _task(strategy: Any, env_task: tuple | None, source: str
          ) -> tuple[tuple | None, list[Problem]]:
    mine = (strategy.task.type, strategy.task.index) if strategy.task is not None else None
    if mine is None and env_task is None:
        return None, [Problem("strategy.task", "which task of the cluster is this process? "
                              "neither strategy.task nor TF_CONFIG's task says",
                              "set TF_CONFIG's task, or e.g. strategy.task={type: worker, "
                              "index: 0}")]
    if mine is not None and env_task is not None and mine != env_task:
        return None, [Problem("strategy.task", f"{mine[0]}:{mine[1]} differs from "
                              f"{source}'s task {env_task[0]}:{env_task[1]}",
                              "give the task in one place")]
    return mine or env_task, []


def _task_problems(spec: ClusterSpec, job: str, index: int) -> list[ClusterProblem]:
    if job not in TRAINING_JOBS:  # TF knows evaluators; csrun runs none
        return [ClusterProblem(("task", "type"), f"csrun runs no {job!r} task",
                               f"tasks are {', '.join(TRAINING_JOBS)}")]
    return task_problems(spec, job, index)
