"""Clusters: which tasks exist (chief, workers, parameter servers) and which one we are.

A cluster spec maps job names to task addresses, as in TF's ``TF_CONFIG``::

    {"cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
                 "ps": ["host3:2222"]},
     "task": {"type": "worker", "index": 0}}

A *cluster resolver* gives the spec and this process's ``task_type`` and ``task_id``.
``TFConfigClusterResolver`` reads ``TF_CONFIG``; ``SimpleClusterResolver`` takes them as
arguments; ``TorchrunClusterResolver`` derives them from torchrun's ``RANK``/``WORLD_SIZE``
/``MASTER_ADDR``/``MASTER_PORT`` (the first ``num_ps`` ranks are parameter servers).
"""

from __future__ import annotations

import json
import os
from typing import Mapping

__all__ = ["ClusterSpec", "ClusterResolver", "SimpleClusterResolver",
           "TFConfigClusterResolver", "TorchrunClusterResolver", "ClusterError"]

_JOBS = ("chief", "worker", "ps", "evaluator")


class ClusterError(ValueError):
    """A cluster description that cannot work (names what is wrong and how to fix it)."""


def is_address(value: object) -> bool:
    """``"host:port"`` with a port in 1..65535 (the form of every task address)."""
    if not isinstance(value, str):
        return False
    host, sep, port = value.rpartition(":")
    return bool(sep and host and port.isascii() and port.isdigit() and 0 < int(port) < 65536)


def _check_address(job: str, index: int, address: object) -> str:
    if not is_address(address):
        raise ClusterError(f"cluster.{job}[{index}] must be 'host:port' with a port in "
                           f"1..65535, got {address!r}")
    return address


class ClusterSpec:
    """Job name -> list of task addresses (TF's ``tf.train.ClusterSpec``)."""

    def __init__(self, cluster: Mapping[str, list] | "ClusterSpec"):
        if isinstance(cluster, ClusterSpec):
            cluster = cluster.as_dict()
        if not isinstance(cluster, Mapping):
            raise ClusterError(f"a cluster spec must map job names to address lists, got "
                               f"{type(cluster).__name__}")
        jobs = {}
        for job, addresses in cluster.items():
            if job not in _JOBS:
                raise ClusterError(f"unknown job {job!r} in the cluster spec; jobs are "
                                   f"{', '.join(_JOBS)}")
            if isinstance(addresses, str) or not isinstance(addresses, (list, tuple)):
                raise ClusterError(f"cluster.{job} must be a list of 'host:port' addresses")
            jobs[job] = [_check_address(job, i, a) for i, a in enumerate(addresses)]
        if len(jobs.get("chief", [])) > 1:
            raise ClusterError("a cluster has at most one chief")
        self._jobs = jobs

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


def _check_task(spec: ClusterSpec, task_type: object, task_id: object) -> tuple[str, int]:
    if task_type is None or task_id is None:
        raise ValueError("a cluster spec needs a task_type and a task_id: which task of the "
                         "cluster is this process? (TF_CONFIG's \"task\": {\"type\": ..., "
                         "\"index\": ...})")
    if task_type not in spec.jobs:
        raise ClusterError(f"task type {task_type!r} is not a job of the cluster "
                           f"({', '.join(spec.jobs) or 'no jobs'})")
    if isinstance(task_id, bool) or not isinstance(task_id, int):
        raise ClusterError(f"task_id must be an int, got {task_id!r}")
    if not 0 <= task_id < spec.num_tasks(task_type):
        raise ClusterError(f"task {task_type}:{task_id} does not exist; the cluster has "
                           f"{spec.num_tasks(task_type)} {task_type} task(s)")
    if spec.num_tasks("worker") + spec.num_tasks("chief") == 0:
        raise ClusterError("the cluster has no worker (and no chief) to train")
    return task_type, task_id


class SimpleClusterResolver(ClusterResolver):
    """A resolver from explicit arguments."""

    def __init__(self, cluster_spec: Mapping | ClusterSpec, task_type: str | None = None,
                 task_id: int | None = None, rpc_layer: str = "gloo"):
        self._spec = ClusterSpec(cluster_spec)
        self.task_type, self.task_id = _check_task(self._spec, task_type, task_id)
        self.rpc_layer = rpc_layer

    def cluster_spec(self) -> ClusterSpec:
        return self._spec


class TFConfigClusterResolver(SimpleClusterResolver):
    """A resolver from the ``TF_CONFIG`` environment variable (or a given JSON string)."""

    def __init__(self, tf_config: str | None = None):
        text = os.environ.get("TF_CONFIG", "") if tf_config is None else tf_config
        if not text.strip():
            raise ClusterError("TF_CONFIG is not set; set it to "
                               '{"cluster": {...}, "task": {"type": ..., "index": ...}}')
        try:
            config = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ClusterError(f"TF_CONFIG is not valid JSON ({exc.msg} at line {exc.lineno} "
                               f"column {exc.colno})") from None
        if not isinstance(config, dict) or "cluster" not in config:
            raise ClusterError('TF_CONFIG needs a "cluster" entry mapping jobs to addresses')
        task = config.get("task") or {}
        if not isinstance(task, dict):
            raise ClusterError('TF_CONFIG "task" must be {"type": ..., "index": ...}')
        super().__init__(config["cluster"], task.get("type"), task.get("index"))


class TorchrunClusterResolver(SimpleClusterResolver):
    """A resolver from torchrun's environment: the first ``num_ps`` ranks are parameter
    servers, the next rank is the chief's role (worker 0), the rest are workers.

    All tasks share ``MASTER_ADDR``; task ``k`` gets port ``MASTER_PORT + k``.
    """

    def __init__(self, num_ps: int, environ: Mapping[str, str] | None = None):
        env = os.environ if environ is None else environ
        try:
            rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
            host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        except KeyError as exc:
            raise ClusterError(f"torchrun's {exc.args[0]} is not set; start the task with "
                               "torchrun or set TF_CONFIG") from None
        except ValueError:
            raise ClusterError("torchrun's RANK, WORLD_SIZE and MASTER_PORT must be "
                               "integers") from None
        if not 0 < num_ps < world:
            raise ClusterError(f"{num_ps} parameter server(s) leave no worker among "
                               f"{world} torchrun processes")
        addresses = [f"{host}:{port + k}" for k in range(world)]
        spec = {"ps": addresses[:num_ps], "worker": addresses[num_ps:]}
        task = ("ps", rank) if rank < num_ps else ("worker", rank - num_ps)
        super().__init__(spec, *task)
