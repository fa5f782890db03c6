"""Which processes a test starts, so that the fast suite stays in one process.

Tests that start processes (the CLI as a subprocess, cluster tasks, DataLoader workers, a
killed run) are marked ``process`` and run after the fast suite (``.ci/run``). The
conftest watches every other test with :func:`watch` and fails one that starts a process,
naming how it did. Every way Python starts one goes through these functions: subprocess
(``_fork_exec`` or ``posix_spawn``), multiprocessing (``fork``, or ``fork_exec`` for its
spawn and forkserver), ``os.system``, ``pty``.
"""

from __future__ import annotations

import _posixsubprocess
import contextlib
import os
import subprocess
from typing import Iterator

_ENTRY_POINTS = [(os, "fork"), (os, "forkpty"), (os, "system"), (os, "posix_spawn"),
                 (os, "posix_spawnp"), (subprocess, "_fork_exec"),
                 (_posixsubprocess, "fork_exec")]
_started: list[str] | None = None  # while watching: how each process was started
_installed = False


def _counted(module, name: str):
    real = getattr(module, name)

    def start(*args, **kwargs):
        if _started is not None:
            _started.append(f"{module.__name__}.{name}")
        return real(*args, **kwargs)
    return start


def _install() -> None:
    """Wrap the entry points, once; unwatched, they only call through."""
    global _installed
    if not _installed:
        for module, name in _ENTRY_POINTS:
            if hasattr(module, name):
                setattr(module, name, _counted(module, name))
        _installed = True


@contextlib.contextmanager
def watch() -> Iterator[list[str]]:
    """Within the block, the list of the processes started (by the entry point used)."""
    global _started
    _install()
    _started = []
    try:
        yield _started
    finally:
        _started = None
