"""Every key of the job's store (the ``TCPStore`` that ps:0 hosts), in one place: the
protocol between the ps tasks (:mod:`.server`), the workers' coordinator
(:mod:`.coordinator`) and the chief's heartbeat (:mod:`.heartbeat`).

``TASK`` is a task's name (``worker:1``, ``ps:0``), ``K`` a ps index, ``NAME`` a channel's
``TASK#INCARNATION``.
"""

from __future__ import annotations

__all__ = [
    "INITIALIZED", "ABORTED", "DONE", "CLOSED", "HEARD", "BEAT", "CHECKPOINT", "GLOBAL_STEP",
    "ps_ready", "ps_joins",
    "ps_join",
    "ps_log", "ps_stopped", "channel", "incarnation", "owner", "finished", "lost",
    "lost_incarnation", "steps", "transfers", "agreed",
]

INITIALIZED = "job/initialized"  # the chief's JSON ``info``: variables hold their start
ABORTED = "job/aborted"          # why the chief (or a ps) ended the job after a failure
DONE = "job/done"                # the chief ends the job: the ps tasks stop serving
CLOSED = "job/closed"            # the chief read the ps logs: ps:0 (the store) may go
BEAT = "chief/beat"              # the chief's heartbeat counter
HEARD = "job/heard"              # tasks that read why the job was ended (ps:0 waits)
CHECKPOINT = "chief/checkpoint"  # the chief's last checkpoint written whole: JSON step, path
GLOBAL_STEP = "global_step"      # what the workers' steps do not hold (an old checkpoint's)


def ps_ready(k: int) -> str:
    """ps:K serves (its channels can be made)."""
    return f"ps/{k}/ready"


def ps_joins(k: int) -> str:
    """How many channels were asked of ps:K (a counter)."""
    return f"ps/{k}/joins"


def ps_join(k: int, slot: int) -> str:
    """The ``NAME`` of ps:K's ``slot``-th channel."""
    return f"ps/{k}/join/{slot}"


def ps_log(k: int) -> str:
    """ps:K's log of applied pushes, left for the chief as it stops."""
    return f"ps/{k}/log"


def ps_stopped(k: int) -> str:
    return f"ps/{k}/stopped"


def channel(k: int, name: str) -> str:
    """The prefix of the pair group of channel ``NAME`` to ps:K."""
    return f"chan/{k}/{name}"


def incarnation(task: str) -> str:
    """How many processes started as ``TASK`` (a counter)."""
    return f"incarnation/{task}"


def owner(task: str) -> str:
    """The incarnation that plays ``TASK`` (one at a time)."""
    return f"owner/{task}"


def finished(task: str) -> str:
    return f"finished/{task}"


def lost(task: str) -> str:
    """What a ps saw when ``TASK``'s connection broke."""
    return f"lost/{task}"


def lost_incarnation(task: str) -> str:
    """Which incarnation of ``TASK`` died (a later one has rejoined)."""
    return f"lost_incarnation/{task}"


def steps(task: str) -> str:
    """Pushes of ``TASK`` applied, counted by the ps that counts them (a counter)."""
    return f"steps/{task}"


def transfers(task: str) -> str:
    """``TASK``'s bytes moved, as JSON, when it finished."""
    return f"transfers/{task}"


def agreed(name: str) -> str:
    """What every task must agree on under ``NAME`` (the first task's)."""
    return f"job/agree/{name}"
