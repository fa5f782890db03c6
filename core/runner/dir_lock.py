"""A run owns its ``checkpoint.dir``: an exclusive ``flock`` on a lock file in it.

Two runs sharing a directory would delete each other's checkpoints (a fresh run clears
the directory, each prunes to ``keep``); a scheduler that restarts a job while its old
copy is still saving is the same case. The lock is the kernel's: it dies with the process
(even with SIGKILL), so a crashed run never leaves a stale lock behind. The file holds the
holder's pid, for the message.
"""

from __future__ import annotations

import fcntl
import os
import pathlib

from ..config.problems import ConfigError, Problem

__all__ = ["DirectoryLock", "LOCK_NAME"]

LOCK_NAME = ".csrun.lock"


class DirectoryLock:
    """Hold ``directory`` for this process until :meth:`release` (or the process ends).

    Raises:
      ConfigError: another process holds it (exit code 2), naming it and its pid.
    """

    def __init__(self, directory: str | os.PathLike, field: str = "checkpoint.dir",
                 shown: str | os.PathLike | None = None):
        directory = pathlib.Path(directory)
        shown = str(directory if shown is None else shown)  # the path as the user gave it
        directory.mkdir(parents=True, exist_ok=True)
        # a file object, not a bare fd: if the run fails to start, collecting it unlocks
        self._file = open(directory / LOCK_NAME, "a+", encoding="utf-8")
        try:
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read(40).strip()
            self._file.close()
            who = f"pid {holder}" if holder.isdigit() else "another process"
            raise ConfigError([Problem(
                field, f"{shown!r} is in use by another run ({who})",
                "wait for that run to end (or stop it), or give this run another "
                "checkpoint.dir; two runs in one directory delete each other's "
                "checkpoints")]) from None
        self._file.truncate(0)
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        if not self._file.closed:
            self._file.close()  # closing the file drops the flock
