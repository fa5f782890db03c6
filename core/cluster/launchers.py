"""Clusters from the launchers that clusters already use: torchrun and Slurm's ``srun``.

Neither launcher knows about ps tasks, so the job says how many it has (``num_ps``): ranks
``0..num_ps-1`` are ``ps:0..`` and the rest ``worker:0..`` (``worker:0`` is the chief).
Only ``ps:0``'s address is ever bound (it hosts the job's store, on rank 0's host); the
other addresses only name the tasks (gloo picks its own ports).

The store's port (``CSRUN_PS_PORT`` overrides both rules):

* torchrun: ``MASTER_PORT + 1`` on ``MASTER_ADDR``. ``MASTER_PORT`` itself is taken:
  torchrun's agent hosts its own TCPStore there, and a second store on it fails to bind.
  Rank 0 runs on ``MASTER_ADDR``'s host (torchrun's rule, and Kubeflow's PyTorchJob's).
* Slurm: ``MASTER_PORT + 1`` when the job script exports ``MASTER_PORT``, else
  ``20000 + SLURM_JOB_ID % 10000``, below Linux's ephemeral range (32768..) so that no
  outgoing connection holds it, and different for jobs that share a node. The host is
  the first node of ``SLURM_STEP_NODELIST`` (else ``SLURM_JOB_NODELIST``), where srun
  puts task 0.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Mapping

from .resolvers import ClusterError, ClusterProblem, SimpleClusterResolver

__all__ = ["TorchrunClusterResolver", "LauncherCluster", "launcher_cluster", "torchrun_cluster", "slurm_cluster",
           "expand_hostlist", "PS_PORT_ENV", "TORCHRUN_VARS", "SLURM_VARS"]

PS_PORT_ENV = "CSRUN_PS_PORT"
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARS = ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST",
              "SLURM_TASKS_PER_NODE", "SLURM_JOB_ID")


@dataclasses.dataclass(frozen=True)
class LauncherCluster:
    """The cluster and task a launcher's variables give; ``source`` names the launcher."""

    source: str
    cluster: dict[str, list[str]]
    task: tuple[str, int]


def _fail(source: str, message: str, hint: str | None = None) -> ClusterError:
    return ClusterError([ClusterProblem((), f"{source}: {message}", hint)])


def launcher_cluster(num_ps: int | None, environ: Mapping[str, str]
                     ) -> LauncherCluster | None:
    """The cluster of torchrun's variables, else of Slurm's; None when neither is set.

    torchrun wins: ``torchrun`` started inside an ``srun`` step sees both, and only its
    ``RANK`` numbers the processes (``SLURM_PROCID`` numbers the torchrun agents).

    Raises:
      ClusterError: the variables are incomplete or malformed, or ``num_ps`` is missing
        or leaves no worker.
    """
    if "RANK" in environ or "WORLD_SIZE" in environ:
        return torchrun_cluster(num_ps, environ)
    if "SLURM_PROCID" in environ and "SLURM_NTASKS" in environ:
        return slurm_cluster(num_ps, environ)
    return None


def _ints(source: str, env: Mapping[str, str], names: tuple[str, ...]) -> list[int]:
    missing = [n for n in names if n not in env]
    if missing:
        raise _fail(source, f"{', '.join(missing)} not set", f"{source} sets "
                    f"{', '.join(names)} for every process")
    try:
        return [int(env[n]) for n in names]
    except ValueError:
        raise _fail(source, f"{', '.join(names)} must be integers, got "
                    + ", ".join(f"{n}={env[n]!r}" for n in names)) from None


def _roles(source: str, num_ps: int | None, rank: int, world: int) -> tuple[str, int]:
    if num_ps is None:
        raise _fail(source, f"{world} processes, but how many are ps tasks?",
                    "set strategy.num_ps (ranks 0..num_ps-1 serve the variables)")
    if not 0 < num_ps < world:
        raise _fail(source, f"strategy.num_ps {num_ps} leaves no worker among {world} "
                    "processes", f"use 1..{world - 1}" if world > 1 else "start more")
    if not 0 <= rank < world:
        raise _fail(source, f"rank {rank} is not in 0..{world - 1}")
    return ("ps", rank) if rank < num_ps else ("worker", rank - num_ps)


def _port(source: str, env: Mapping[str, str], default: int) -> int:
    text = env.get(PS_PORT_ENV)
    port = default if text is None else int(text) if text.isdigit() else -1
    if not 0 < port < 65536:
        raise _fail(source, f"the store's port {text or port} is not in 1..65535",
                    f"set {PS_PORT_ENV}")
    return port


def torchrun_cluster(num_ps: int | None, env: Mapping[str, str]) -> LauncherCluster:
    """From ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` (torchrun's,
    or any launcher's that sets them, such as Kubeflow's PyTorchJob)."""
    rank, world, master_port = _ints("torchrun", env, ("RANK", "WORLD_SIZE", "MASTER_PORT"))
    if not env.get("MASTER_ADDR"):
        raise _fail("torchrun", "MASTER_ADDR not set", "torchrun sets it for every process")
    task = _roles("torchrun", num_ps, rank, world)
    port = _port("torchrun", env, master_port + 1)
    addresses = [f"{env['MASTER_ADDR']}:{port}"] * world  # only ps:0's is bound
    return LauncherCluster("torchrun", _split(addresses, num_ps), task)


def slurm_cluster(num_ps: int | None, env: Mapping[str, str]) -> LauncherCluster:
    """From ``SLURM_PROCID``, ``SLURM_NTASKS`` and the step's (else the job's) node
    list; ``SLURM_TASKS_PER_NODE`` names each task's node (block distribution)."""
    rank, world = _ints("Slurm", env, ("SLURM_PROCID", "SLURM_NTASKS"))
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if not nodelist:
        raise _fail("Slurm", "neither SLURM_STEP_NODELIST nor SLURM_JOB_NODELIST is set",
                    "start the tasks with srun")
    try:
        hosts = expand_hostlist(nodelist)
    except ValueError as exc:
        raise _fail("Slurm", str(exc)) from None
    task = _roles("Slurm", num_ps, rank, world)
    if "MASTER_PORT" in env and env["MASTER_PORT"].isdigit():
        default = int(env["MASTER_PORT"]) + 1
    else:
        default = 20000 + int(env.get("SLURM_JOB_ID", "0") or 0) % 10000
    port = _port("Slurm", env, default)
    nodes = _task_nodes(env.get("SLURM_TASKS_PER_NODE", ""), hosts, world)
    return LauncherCluster("Slurm", _split([f"{h}:{port}" for h in nodes], num_ps), task)


def _split(addresses: list[str], num_ps: int) -> dict[str, list[str]]:
    return {"ps": addresses[:num_ps], "worker": addresses[num_ps:]}


def _task_nodes(per_node: str, hosts: list[str], world: int) -> list[str]:
    """Each task's node under block distribution (``2(x3),1``: 2 tasks on each of the
    first three nodes, 1 on the fourth); all on the first node when unknown."""
    counts: list[int] = []
    for part in filter(None, per_node.split(",")):
        found = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not found:
            return [hosts[0]] * world
        counts += [int(found.group(1))] * int(found.group(2) or 1)
    nodes = [host for host, n in zip(hosts, counts) for _ in range(n)]
    return nodes if len(nodes) == world else [hosts[0]] * world


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compact host list, expanded: ``node[01-03,07],gpu1`` -> ``node01, node02,
    node03, node07, gpu1`` (zero padding kept; several brackets in a name multiply)."""
    items = re.findall(r"(?:[^,\[\]]|\[[^\]\[]*\])+", text.strip())
    if ",".join(items) != text.strip():  # an unbalanced bracket, an empty item
        raise ValueError(f"the node list {text!r} is malformed")
    hosts = [host for item in items for host in _expand_one(item)]
    if not hosts:
        raise ValueError(f"the node list {text!r} names no host")
    return hosts


def _expand_one(item: str) -> list[str]:
    found = re.match(r"([^\[]*)\[([^\]]*)\](.*)", item)
    if not found:
        if "[" in item or "]" in item:
            raise ValueError(f"the node list item {item!r} is malformed")
        return [item]
    prefix, ranges, rest = found.groups()
    names = []
    for part in ranges.split(","):
        bounds = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not bounds:
            raise ValueError(f"the range {part!r} in {item!r} is malformed")
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        if int(high) < int(low):
            raise ValueError(f"the range {part!r} in {item!r} runs backwards")
        names += [f"{prefix}{n:0{len(low)}d}" for n in range(int(low), int(high) + 1)]
    return [name + tail for name in names for tail in _expand_one(rest)]


class TorchrunClusterResolver(SimpleClusterResolver):
    """A resolver from torchrun's environment: the first ``num_ps`` ranks are parameter
    servers, the rest workers (``worker:0`` is the chief).

    ``ps:0`` hosts the job's store on ``MASTER_ADDR`` at ``MASTER_PORT + 1``: torchrun's
    own store holds ``MASTER_PORT``. The rules are :func:`torchrun_cluster`'s.
    """

    def __init__(self, num_ps: int, environ: Mapping[str, str] | None = None):
        launched = torchrun_cluster(num_ps, os.environ if environ is None else environ)
        super().__init__(launched.cluster, *launched.task)
