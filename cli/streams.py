"""Standard output and error, written so that a reader that stopped reading cannot keep
a stop from being heard.

A pipe whose reader does not read (``csrun train ... | stuck``) or a terminal paused by
Ctrl-S fills up, and a plain write then blocks for as long as the reader wants: the
first Ctrl-C or SIGTERM only asks a run to stop after its step, and the step never ends
while it waits in a write. Here each write waits for the stream to take more in steps of
:data:`POLL_S`; once a stop was asked for (:func:`stopping`) and the stream has stayed
full for :data:`GRACE_S`, what is written to it is dropped, so the run stops, saves its
checkpoint and exits with 130/143. A reader that is merely slow loses nothing.

Standard library only: the console script installs it before anything heavy loads.
"""

from __future__ import annotations

import io
import os
import select
import sys
import threading
import time

__all__ = ["install", "stopping", "POLL_S", "GRACE_S"]

POLL_S = 0.2  # how often a full stream's write looks for a stop
GRACE_S = 1.0  # how long, once a stop was asked for, a full stream is still waited for
_CHUNK = 4096  # PIPE_BUF: a write this size to a pipe select() calls writable never blocks
_stops: list[threading.Event] = []


def stopping(stop: threading.Event) -> None:
    """From now on, ``stop`` being set ends the wait of a write to a full stream."""
    _stops.append(stop)


class _Writer(io.RawIOBase):
    """The raw file under ``sys.stdout``/``sys.stderr``: the descriptor, written in
    chunks the stream can take without blocking."""

    def __init__(self, fd: int):
        super().__init__()
        self.fd, self.dropping = fd, False

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def isatty(self) -> bool:
        return os.isatty(self.fd)

    def write(self, data) -> int:
        if self.dropping:
            return len(data)
        view = memoryview(data)[:_CHUNK]
        give_up = None
        while True:
            if self._ready():
                try:
                    return os.write(self.fd, view)
                except BlockingIOError:  # another process made the stream non-blocking
                    pass
            if any(stop.is_set() for stop in _stops):
                give_up = give_up or time.monotonic() + GRACE_S
                if time.monotonic() > give_up:
                    self.dropping = True  # the reader is gone for good, as far as we know
                    return len(data)

    def _ready(self) -> bool:
        try:
            return bool(select.select([], [self.fd], [], POLL_S)[1])
        except (OSError, ValueError):  # select cannot watch it: write as a plain file
            return True


def install() -> None:
    """Put :class:`_Writer` under ``sys.stdout`` and ``sys.stderr`` (same encoding,
    errors and buffering) when they are the process's own descriptors."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            fd = stream.fileno()
            stream.flush()
        except (AttributeError, OSError, ValueError):  # closed, or no descriptor
            continue
        wrapped = io.TextIOWrapper(io.BufferedWriter(_Writer(fd)), encoding=stream.encoding,
                                   errors=stream.errors,
                                   line_buffering=stream.line_buffering)
        setattr(sys, name, wrapped)
