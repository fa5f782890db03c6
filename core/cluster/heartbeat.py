"""The chief's heartbeat: how the ps tasks and the other workers notice a dead chief.

The store lives with ps:0, not with the chief, so a chief that dies leaves no broken
connection behind: without a heartbeat a hand-started job's ps tasks would serve forever
and its workers train on for nobody. The chief adds 1 to ``chief/beat`` every second;
a watcher that sees the counter stand still for ``staleness`` seconds (its own clock:
the tasks' clocks need not agree) declares the chief gone.
"""

from __future__ import annotations

import json
import threading
import time

from . import store_keys as keys
from .transport import ParameterServerError

__all__ = ["Heartbeat", "ChiefWatch", "ChiefGone", "intact"]

BEAT = keys.BEAT
_EVERY = 1.0
_NONE = "\x00none"  # a value no key holds (see ChiefWatch._hear_checkpoint)


def intact(step: int, path: str) -> str:
    """A failed job's last checkpoint, as the chief, which wrote it, names it."""
    return f"the last checkpoint, step {step}, is intact ({path})"


class ChiefGone(ParameterServerError):
    """The chief's heartbeat stopped: it died or hangs, and the job cannot finish."""


class Heartbeat:
    """The chief's beat, on a daemon thread until :meth:`close` (or the store fails);
    it carries the chief's newest checkpoint (:meth:`checkpointed`)."""

    def __init__(self, raw_store):
        self._store = raw_store
        self._closed = threading.Event()
        self._checkpoint: str | None = None  # news for the next beat
        threading.Thread(target=self._run, daemon=True, name="csrun-chief-heartbeat").start()

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._store.add(BEAT, 1)
                news, self._checkpoint = self._checkpoint, None
                if news is not None:
                    self._store.set(keys.CHECKPOINT, news)
            except RuntimeError:  # the store is gone: the job is over either way
                return
            self._closed.wait(_EVERY)

    def checkpointed(self, step: int, path: str) -> None:
        """A checkpoint was written whole: the other tasks hear it with the next beat
        (the chief never waits for the store here) and name it if the job fails later,
        when ps:0, the store, may be gone."""
        self._checkpoint = json.dumps({"step": step, "path": path})

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
        self.checkpoint: dict | None = None  # the chief's last one, as last heard

    def note(self) -> str | None:
        """What a failure leaves behind, as far as this task heard: the chief's newest
        checkpoint, written whole (intact); None when it heard of none. (It hears once
        a beat: the chief may have written a newer one since.)"""
        if self.checkpoint is None:
            return None
        return (f"the chief's checkpoints are intact (the newest this task heard of: step "
                f"{self.checkpoint['step']}, {self.checkpoint['path']})")

    def check(self) -> None:
        now = time.monotonic()
        if now - self._checked < _EVERY:  # a store round trip at most once a beat
            return
        self._checked = now
        beat = self._store.add(BEAT, 0)
        self._hear_checkpoint()
        if beat != self._seen:
            self._seen, self._since = beat, now
        elif beat and now - self._since > self.staleness \
                and not self._store.check([keys.DONE]):
            raise ChiefGone(f"the chief {self.chief} sent no heartbeat for "
                            f"{now - self._since:.0f} s (strategy.timeout_s is "
                            f"{self.staleness:g} s): it died or hangs, and the job cannot "
                            "finish without it")

    def _hear_checkpoint(self) -> None:
        """Keep the chief's last checkpoint, to name it if the store (ps:0) dies later.
        One round trip: compare_set with a value no key holds returns the key's value,
        or that value when there is no key, and changes nothing."""
        value = self._store.compare_set(keys.CHECKPOINT, _NONE, _NONE)
        value = value.decode() if isinstance(value, bytes) else value
        if value != _NONE:
            self.checkpoint = json.loads(value)
