"""Ctrl-C and SIGTERM while training: the first asks for a clean stop (a checkpoint is
saved), a second aborts. The handlers are the process's only while a run (or a launched
job) is in progress, and the previous ones come back after it.

Work that a stop throws away anyway (the final evaluation: the step's checkpoint is
written before it) runs :func:`interrupting`: there the first signal also interrupts the
main thread's code at once, mid-batch, as Python's own Ctrl-C does, instead of waiting
for the batch to end (a slow one took the run 9 s past a SIGTERM)."""

from __future__ import annotations

import contextlib
import signal
import threading

__all__ = ["Aborted", "Interrupted", "interrupting", "stop_on_signals"]


class Aborted(KeyboardInterrupt):
    """A second Ctrl-C or SIGTERM while training: stop at once, without saving (a
    first one outside training is a plain KeyboardInterrupt). ``signal`` names the one
    that aborted (``"SIGTERM"``: exit 143, as the first would have)."""

    def __init__(self, signal_name: str = "SIGINT"):
        super().__init__(signal_name)
        self.signal = signal_name


class Interrupted(KeyboardInterrupt):
    """The first Ctrl-C or SIGTERM inside :func:`interrupting`: the stop is asked for, and
    the code there is interrupted where it stands. A ``KeyboardInterrupt``, so that
    neither user code's ``except Exception`` nor the engine's failure reports take it
    for an error."""


_interrupting = threading.local()


@contextlib.contextmanager
def interrupting():
    """Inside, the first Ctrl-C or SIGTERM raises :class:`Interrupted` in the main thread
    besides setting the stop (under :func:`stop_on_signals`; elsewhere nothing)."""
    depth = getattr(_interrupting, "depth", 0)
    _interrupting.depth = depth + 1
    try:
        yield
    finally:
        _interrupting.depth = depth


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event, received: list):
    """While training, the first Ctrl-C or SIGTERM (a scheduler's preemption) asks for a
    clean stop, which saves a checkpoint; a second one aborts. ``received`` gets the
    signals' names. Outside the main thread (where Python delivers signals) it does
    nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        received.append(signal.Signals(signum).name)
        if stop.is_set():
            raise Aborted(received[-1])
        stop.set()
        if getattr(_interrupting, "depth", 0):  # the handler runs in the main thread
            raise Interrupted(received[-1])

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
