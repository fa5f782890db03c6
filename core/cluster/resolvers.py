"""Clusters: which tasks exist (chief, workers, parameter servers) and which one we are.

A cluster spec maps job names to task addresses, as in TF's ``TF_CONFIG``::

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
                 "ps": ["host3:2222"]},
     "task": {"type": "worker", "index": 0}}

A *cluster resolver* gives the spec and this process's ``task_type`` and ``task_id``.
``TFConfigClusterResolver`` reads ``TF_CONFIG``; ``SimpleClusterResolver`` takes them as
arguments; ``TorchrunClusterResolver`` derives them from torchrun's ``RANK``/``WORLD_SIZE``
/``MASTER_ADDR``/``MASTER_PORT`` (the first ``num_ps`` ranks are parameter servers;
:mod:`.launchers` reads torchrun's and Slurm's variables).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
from typing import Mapping

from ..config import strict_json
from ..config.addresses import is_address

__all__ = ["ClusterSpec", "ClusterResolver", "SimpleClusterResolver",
           "TFConfigClusterResolver", "ClusterError",
           "ClusterProblem", "TFConfig", "parse_tf_config", "cluster_spec_problems",
           "training_problems", "task_problems", "TF_CONFIG_SHAPE"]

_JOBS = ("chief", "worker", "ps", "evaluator")
TF_CONFIG_SHAPE = ('TF_CONFIG holds {"cluster": {"worker": [...], "ps": [...]}, "task": '
                   '{"type": "worker", "index": 0}}')


@dataclasses.dataclass(frozen=True)
class ClusterProblem:
    """One thing wrong with a cluster description, as data: callers (the config's
    checks, an exception's text) present it their own way.

    Attributes:
      path: where, as keys into TF_CONFIG's JSON (``("cluster", "worker", 1)``,
        ``("task", "index")``); ``()`` for the whole description.
      message: what is wrong.
      hint: how to fix it, or None.
    """

    path: tuple
    message: str
    hint: str | None = None

    def __str__(self) -> str:
        where = ".".join(map(str, self.path))
        text = f"{where}: {self.message}" if where else self.message
        return f"{text} ({self.hint})" if self.hint else text


class ClusterError(ValueError):
    """A cluster description that cannot work; ``problems`` lists what is wrong."""

    def __init__(self, problems: list[ClusterProblem], source: str | None = None):
        self.problems = list(problems)
        super().__init__("; ".join(f"{source}'s {p}" if source and p.path else str(p)
                                   for p in self.problems))


def _error(message: str, path: tuple = (), hint: str | None = None) -> ClusterError:
    return ClusterError([ClusterProblem(path, message, hint)])


def cluster_spec_problems(cluster: object) -> list[ClusterProblem]:
    """What is wrong with a cluster spec's shape: jobs TF knows, each a list of
    ``host:port`` addresses, at most one chief. All problems, not the first."""
    if not isinstance(cluster, Mapping):
        return [ClusterProblem(("cluster",), f"must map job names to address lists, got "
                               f"{type(cluster).__name__}")]
    problems = []
    for job, addresses in cluster.items():
        if job not in _JOBS:
            close = difflib.get_close_matches(str(job), _JOBS, n=1)
            problems.append(ClusterProblem(
                ("cluster", job), f"unknown job {job!r}; jobs are {', '.join(_JOBS)}",
                f"did you mean {close[0]!r}?" if close else None))
        elif isinstance(addresses, str) or not isinstance(addresses, (list, tuple)):
            problems.append(ClusterProblem(("cluster", job), "must be a list of "
                                           "'host:port' addresses"))
        else:
            problems += [ClusterProblem(("cluster", job, i), f"must be 'host:port' with a "
                                        f"port in 1..65535, got {address!r}")
                         for i, address in enumerate(addresses) if not is_address(address)]
    if isinstance(cluster.get("chief"), (list, tuple)) and len(cluster["chief"]) > 1:
        problems.append(ClusterProblem(("cluster", "chief"), "a cluster has at most one "
                                       "chief", "keep one; the other tasks can be workers"))
    return problems


def training_problems(cluster: Mapping[str, list]) -> list[ClusterProblem]:
    """What keeps a cluster from training: no worker and no chief."""
    if cluster.get("worker") or cluster.get("chief"):
        return []
    return [ClusterProblem(("cluster", "worker"), "the cluster has no worker (and no "
                           "chief) to train", "add a host:port under worker")]


def task_problems(spec: "ClusterSpec", task_type: object, task_id: object
                  ) -> list[ClusterProblem]:
    """What is wrong with ``task_type:task_id`` as this process's task in ``spec``."""
    if task_type is None or task_id is None:
        return [ClusterProblem(("task",), "which task of the cluster is this process? no "
                               "task type and index are given",
                               'give task_type and task_id, or TF_CONFIG\'s "task": '
                               '{"type": ..., "index": ...}')]
    if task_type not in _JOBS:
        return [ClusterProblem(("task", "type"), f"unknown job {task_type!r}; jobs are "
                               f"{', '.join(_JOBS)}")]
    if isinstance(task_id, bool) or not isinstance(task_id, int):
        return [ClusterProblem(("task", "index"), f"must be an int, got {task_id!r}")]
    count = spec.num_tasks(task_type)
    if 0 <= task_id < count:
        return []
    hint = f"use 0..{count - 1}" if count else f"the cluster lists no {task_type} task"
    return [ClusterProblem(("task", "index"), f"task {task_type}:{task_id} does not exist; "
                           f"the cluster has {count} {task_type} task(s)", hint)]


@dataclasses.dataclass(frozen=True)
class TFConfig:
    """What ``TF_CONFIG`` gives: the cluster (jobs -> addresses) and this process's task
    ``(type, index)``; either is None when TF_CONFIG leaves it out."""

    cluster: dict[str, list[str]] | None
    task: tuple[str, int] | None


def parse_tf_config(text: str) -> TFConfig | None:
    """``TF_CONFIG``'s text parsed and checked (the one parser of it); None when blank.

    Raises:
      ClusterError: every problem found; paths are keys into the JSON.
    """
    if not text.strip():
        return None
    try:
        config = strict_json.loads(text)  # a key given twice is an error, not the last
    except json.JSONDecodeError as exc:
        raise _error(f"TF_CONFIG is not valid JSON ({exc.msg} at line {exc.lineno} column "
                     f"{exc.colno})", hint=TF_CONFIG_SHAPE) from None
    if not isinstance(config, dict):
        raise _error(f"TF_CONFIG must be a JSON object, got {type(config).__name__}",
                     hint=TF_CONFIG_SHAPE)
    cluster, task = config.get("cluster"), config.get("task")
    task = None if task == {} else task
    problems = [] if cluster is None else cluster_spec_problems(cluster)
    index = task.get("index", 0) if isinstance(task, dict) else None  # TF_CONFIG's default
    if task is not None and (not isinstance(task, dict) or not isinstance(task.get("type"), str)
                             or isinstance(index, bool) or not isinstance(index, int)):
        problems.append(ClusterProblem(("task",), f"must be {{\"type\": \"worker\", "
                                       f"\"index\": 0}}, got {json.dumps(task)[:80]}",
                                       TF_CONFIG_SHAPE))
    if problems:
        raise ClusterError(problems)
    return TFConfig(None if cluster is None else ClusterSpec(cluster).as_dict(),
                    None if task is None else (task["type"], index))


class ClusterSpec:
    """Job name -> list of task addresses (TF's ``tf.train.ClusterSpec``)."""

    def __init__(self, cluster: Mapping[str, list] | "ClusterSpec"):
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        problems = cluster_spec_problems(cluster)
        if problems:
            raise ClusterError(problems)
        self._jobs = {job: list(addresses) for job, addresses in cluster.items()}

    @property
    def jobs(self) -> list[str]:
        return list(self._jobs)

    def as_dict(self) -> dict[str, list[str]]:
        return {job: list(addresses) for job, addresses in self._jobs.items()}

    def num_tasks(self, job: str) -> int:
        return len(self._jobs.get(job, []))

    def task_address(self, job: str, index: int) -> str:
        return self._jobs[job][index]

    def __bool__(self) -> bool:
        return any(self._jobs.values())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and other.as_dict() == self.as_dict()

    def __repr__(self) -> str:
        return f"ClusterSpec({self.as_dict()!r})"


class ClusterResolver:
    """TF's ``ClusterResolver``: the spec plus this process's place in it."""

    task_type: str | None = None
    task_id: int | None = None
    rpc_layer: str = "gloo"

    def cluster_spec(self) -> ClusterSpec:  # pragma: no cover - interface
        raise NotImplementedError

    def num_accelerators(self, task_type=None, task_id=None, config_proto=None) -> dict:
        import torch
        return {"GPU": torch.cuda.device_count()} if torch.cuda.is_available() else {}

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(task_type={self.task_type!r}, "
                f"task_id={self.task_id!r}, cluster={self.cluster_spec().as_dict()!r})")


class SimpleClusterResolver(ClusterResolver):
    """A resolver from explicit arguments."""

    def __init__(self, cluster_spec: Mapping | ClusterSpec, task_type: str | None = None,
                 task_id: int | None = None, rpc_layer: str = "gloo"):
        self._spec = ClusterSpec(cluster_spec)
        problems = training_problems(self._spec.as_dict()) + task_problems(
            self._spec, task_type, task_id)
        if problems:
            raise ClusterError(problems)
        self.task_type, self.task_id = task_type, task_id
        self.rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        return self._spec


class TFConfigClusterResolver(SimpleClusterResolver):
    """A resolver from the ``TF_CONFIG`` environment variable (or a given JSON string)."""

    def __init__(self, tf_config: str | None = None):
        text = os.environ.get("TF_CONFIG", "") if tf_config is None else tf_config
        try:
            config = parse_tf_config(text)
            if config is None:
                raise _error("TF_CONFIG is not set", hint=TF_CONFIG_SHAPE)
            if config.cluster is None:
                raise _error('TF_CONFIG needs a "cluster" entry mapping jobs to addresses',
                             hint=TF_CONFIG_SHAPE)
            super().__init__(config.cluster, *(config.task or (None, None)))
        except ClusterError as exc:  # say that the problems are TF_CONFIG's
            raise ClusterError(exc.problems, source="TF_CONFIG") from None

