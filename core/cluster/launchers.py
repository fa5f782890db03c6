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
import itertools
import os
import re
from typing import Iterator, Mapping

from .resolvers import ClusterError, ClusterProblem, SimpleClusterResolver

__all__ = ["TorchrunClusterResolver", "LauncherCluster", "launcher_cluster", "torchrun_cluster",
           "slurm_cluster", "expand_hostlist", "PS_PORT_ENV", "TORCHRUN_VARS", "SLURM_VARS",
           "MAX_TASKS"]

PS_PORT_ENV = "CSRUN_PS_PORT"
# The most processes a launcher's variables may name: every count read from them (the
# world size, a node list's hosts, tasks per node) is checked against it before a list
# that long is built. Far beyond the largest parameter-server jobs.
MAX_TASKS = 65536
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
    values = [_int(env[n]) for n in names]
    if None in values:
        raise _fail(source, f"{', '.join(names)} must be integers, got "
                    + ", ".join(f"{n}={env[n][:40]!r}" for n in names))
    return values


def _int(text: str) -> int | None:
    """A whole number of at most 18 digits (longer ones are no rank, size or port)."""
    text = text.strip()
    signless = text[1:] if text[:1] in "+-" else text
    if not (signless.isascii() and signless.isdigit()) or len(signless) > 18:
        return None
    return int(text)


def _roles(source: str, num_ps: int | None, rank: int, world: int) -> tuple[str, int]:
    if num_ps is None:
        raise _fail(source, f"{world} processes, but how many are ps tasks?",
                    "set strategy.num_ps (ranks 0..num_ps-1 serve the variables)")
    if not 0 < world <= MAX_TASKS:
        raise _fail(source, f"{world} processes is not in 1..{MAX_TASKS}",
                    "is the launcher's world size (WORLD_SIZE, SLURM_NTASKS) right?")
    if not 0 < num_ps < world:
        raise _fail(source, f"strategy.num_ps {num_ps} leaves no worker among {world} "
                    "processes", f"use 1..{world - 1}" if world > 1 else "start more")
    if not 0 <= rank < world:
        raise _fail(source, f"rank {rank} is not in 0..{world - 1}")
    return ("ps", rank) if rank < num_ps else ("worker", rank - num_ps)


def _port(source: str, env: Mapping[str, str], default: int) -> int:
    text = env.get(PS_PORT_ENV)
    port = default if text is None else _int(text)  # bounded as the other variables are
    if port is None or not 0 < port < 65536:
        shown = port if text is None else repr(text[:40])
        raise _fail(source, f"the store's port {shown} is not in 1..65535",
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
    master_port = _int(env.get("MASTER_PORT", ""))
    job = _int(env.get("SLURM_JOB_ID", "") or "0")
    if master_port is not None and master_port >= 0:
        default = master_port + 1
    elif job is None or job < 0:
        raise _fail("Slurm", f"SLURM_JOB_ID={env['SLURM_JOB_ID'][:40]!r} is not a job "
                    "number, and the store's port is derived from it",
                    f"unset it, or set {PS_PORT_ENV} (or MASTER_PORT) to choose the port")
    else:
        default = 20000 + job % 10000
    port = _port("Slurm", env, default)
    nodes = _task_nodes(env.get("SLURM_TASKS_PER_NODE", ""), hosts, world)
    return LauncherCluster("Slurm", _split([f"{h}:{port}" for h in nodes], num_ps), task)


def _split(addresses: list[str], num_ps: int) -> dict[str, list[str]]:
    return {"ps": addresses[:num_ps], "worker": addresses[num_ps:]}


def _task_nodes(per_node: str, hosts: list[str], world: int) -> list[str]:
    """Each task's node under block distribution (``2(x3),1``: 2 tasks on each of the
    first three nodes, 1 on the fourth); all on the first node when unknown."""
    counts: list[int] = []  # tasks on each host, never more entries than hosts
    for part in filter(None, per_node.split(",")):
        found = re.fullmatch(r"(\d{1,9})(?:\(x(\d{1,9})\))?", part.strip())
        if not found:
            return [hosts[0]] * world
        repeat = min(int(found.group(2) or 1), len(hosts) - len(counts))
        counts += [int(found.group(1))] * repeat  # a sum past world is refused below
    if sum(counts) != world:
        return [hosts[0]] * world
    return [host for host, n in zip(hosts, counts) for _ in range(n)]


def expand_hostlist(text: str, limit: int = MAX_TASKS) -> list[str]:
    """Slurm's compact host list, expanded: ``node[01-03,07],gpu1`` -> ``node01, node02,
    node03, node07, gpu1`` (zero padding kept; several brackets in a name multiply).

    Raises:
      ValueError: the list is malformed, or names more than ``limit`` hosts (counted
        while expanding: ``node[0-99999999999]`` is refused, not built).
    """
    items = re.findall(r"(?:[^,\[\]]|\[[^\]\[]*\])+", text.strip())
    if ",".join(items) != text.strip():  # an unbalanced bracket, an empty item
        raise ValueError(f"the node list {text[:80]!r} is malformed")
    names = (host for item in items for host in _expand_one(item))
    hosts = list(itertools.islice(names, limit + 1))
    if len(hosts) > limit:
        raise ValueError(f"the node list {text[:80]!r} names more than {limit} hosts")
    if not hosts:
        raise ValueError(f"the node list {text[:80]!r} names no host")
    return hosts


def _expand_one(item: str) -> Iterator[str]:
    """The names of one item, lazily (a bracket's range may be huge)."""
    if item.count("[") > 8:  # deeper would recurse once per bracket
        raise ValueError(f"the node list item {item[:80]!r} has more than 8 brackets")
    found = re.match(r"([^\[]*)\[([^\]]*)\](.*)", item)
    if not found:
        if "[" in item or "]" in item:
            raise ValueError(f"the node list item {item[:80]!r} is malformed")
        yield item
        return
    prefix, ranges, rest = found.groups()
    for part in ranges.split(","):
        bounds = re.fullmatch(r"(\d{1,18})(?:-(\d{1,18}))?", part.strip())
        if not bounds:
            raise ValueError(f"the range {part[:40]!r} in {item[:80]!r} is malformed")
        low, high = bounds.group(1), bounds.group(2) or bounds.group(1)
        if int(high) < int(low):
            raise ValueError(f"the range {part!r} in {item[:80]!r} runs backwards")
        for n in range(int(low), int(high) + 1):
            yield from (f"{prefix}{n:0{len(low)}d}{tail}" for tail in _expand_one(rest))


class TorchrunClusterResolver(SimpleClusterResolver):
    """A resolver from torchrun's environment: the first ``num_ps`` ranks are parameter
    servers, the rest workers (``worker:0`` is the chief).

    ``ps:0`` hosts the job's store on ``MASTER_ADDR`` at ``MASTER_PORT + 1``: torchrun's
    own store holds ``MASTER_PORT``. The rules are :func:`torchrun_cluster`'s.
    """

    def __init__(self, num_ps: int, environ: Mapping[str, str] | None = None):
        launched = torchrun_cluster(num_ps, os.environ if environ is None else environ)
        super().__init__(launched.cluster, *launched.task)
