"""A clock that only replicas move: each says how much work it did.

:class:`~csrun.core.distribute.replica_run.ExecutionPolicy` decides ordered or concurrent
by how long replicas' bodies take. On a loaded machine a real clock also counts the time
a replica's thread waited for a core, so a test of that decision needs the work itself:
this clock stands in the one replicas are timed by, and moves only by :meth:`work`.
"""

from __future__ import annotations

import threading

from csrun.core.distribute import replica_run


class WorkClock:
    """``clock()`` reads it; ``clock.work(seconds)``, in a replica, advances it."""

    def __init__(self):
        self.now = 0.0
        self._lock = threading.Lock()  # concurrent replicas work at once

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def work(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


def install(monkeypatch) -> WorkClock:
    """Time replicas by a new :class:`WorkClock` until ``monkeypatch`` undoes it."""
    clock = WorkClock()
    monkeypatch.setattr(replica_run, "_clock", clock)
    return clock
