"""The chief's heartbeat: how the ps tasks and the other workers notice a dead chief.

The store lives with ps:0, not with the chief, so a chief that dies leaves no broken
connection behind: without a heartbeat a hand-started job's ps tasks would serve forever
and its workers train on for nobody. The chief adds 1 to ``chief/beat`` every second;
a watcher that sees the counter stand still for ``staleness`` seconds (its own clock:
the tasks' clocks need not agree) declares the chief gone.
"""

from __future__ import annotations

import threading
import time

from . import store_keys as keys
from .transport import ParameterServerError

__all__ = ["Heartbeat", "ChiefWatch", "ChiefGone"]

BEAT = keys.BEAT
_EVERY = 1.0


class ChiefGone(ParameterServerError):
    """The chief's heartbeat stopped: it died or hangs, and the job cannot finish."""


class Heartbeat:
    """The chief's beat, on a daemon thread until :meth:`close` (or the store fails)."""

    def __init__(self, raw_store):
        self._store = raw_store
        self._closed = threading.Event()
        threading.Thread(target=self._run, daemon=True, name="csrun-chief-heartbeat").start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._store.add(BEAT, 1)
            except RuntimeError:  # the store is gone: the job is over either way
                return
            self._closed.wait(_EVERY)

    def close(self) -> None:
        self._closed.set()


class ChiefWatch:
    """Watches ``chief``'s beat; :meth:`check` raises :class:`ChiefGone` once it has stood
    still for ``staleness`` seconds. Before the first beat the chief is not yet up, which
    is the waits' business, not the watch's."""

    def __init__(self, store, chief: str, staleness: float):
        self._store, self.chief = store, chief
        self.staleness = max(staleness, 3 * _EVERY)  # never shorter than a few beats
        self._seen, self._since, self._checked = 0, time.monotonic(), 0.0

    def check(self) -> None:
        now = time.monotonic()
        if now - self._checked < _EVERY:  # a store round trip at most once a beat
            return
        self._checked = now
        beat = self._store.add(BEAT, 0)
        if beat != self._seen:
            self._seen, self._since = beat, now
        elif beat and now - self._since > self.staleness \
                and not self._store.check([keys.DONE]):
            raise ChiefGone(f"the chief {self.chief} sent no heartbeat for "
                            f"{now - self._since:.0f} s (strategy.timeout_s is "
                            f"{self.staleness:g} s): it died or hangs, and the job cannot "
                            "finish without it")
