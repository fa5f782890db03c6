"""Code a config names that the user wrote (datasets, collate and loss functions, models):
making it importable, and saying where in it something failed.

A failure in user code is reported with the config key that named the code and the
``file:line`` of the last traceback frame in the user's own files, not a traceback (set
``CSRUN_TRACEBACK=1`` for that).
"""

from __future__ import annotations

import os
import pathlib
import sys
import sysconfig
import traceback

from .problems import Problem

__all__ = ["UserCodeError", "user_code_error", "ensure_cwd_importable",
           "import_beside_config", "user_location",
           "describe_failure", "user_problem", "CHECKED_FAILURES"]

# csrun itself (core/ and cli/, not its examples), and what Python and its installed
# packages bring (torch, numpy, ...)
_CORE = pathlib.Path(__file__).resolve().parents[1]
_NOT_USER = tuple(str(pathlib.Path(p).resolve()) for p in (
    _CORE, _CORE.parent / "cli",
    *{sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}))


class UserCodeError(RuntimeError):
    """User code failed during a run (exit code 1). The message starts with the config
    key naming the code; the original exception is the ``__cause__``. (One plain message
    argument: a DataLoader worker re-raises it by its type and message.)"""

    _WORKER = "Caught UserCodeError in "

    def __init__(self, message: str, hint: str | None = None):
        # a DataLoader worker's re-raise puts the worker's whole traceback in the message:
        # keep csrun's own line, and say which worker
        if message.startswith(self._WORKER):
            where = message.split("\n", 1)[0][len(self._WORKER):].rstrip(".")
            last = message.rstrip().rsplit("\n", 1)[-1]
            message = f"{last.removeprefix('UserCodeError: ')} (in {where})"
        self.message, self.hint = message, hint  # apart, for a config Problem
        super().__init__(f"{message}; {hint}" if hint else message)


def user_code_error(field: str, what: str, exc: BaseException) -> UserCodeError:
    """``raise user_code_error(...) from exc``: ``field: what failed: ... (at file:line)``."""
    return UserCodeError(f"{field}: {describe_failure(what, exc)}")


def ensure_cwd_importable() -> None:
    """Put the current folder first on ``sys.path``, as ``python -m`` does (the
    ``csrun`` script's own folder is there instead), so ``mypkg.mod:fn`` finds ./mypkg."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


_config_folders: list[str] = []  # what import_beside_config put on sys.path


def import_beside_config(config_file: str | os.PathLike) -> None:
    """Search the config file's folder right after the current folder, so a config runs
    the same from any folder: its relative data paths start at its folder too
    (``csrun train examples/text_classifier.yaml`` finds examples/toypkg). The folder of
    an earlier config leaves ``sys.path``."""
    ensure_cwd_importable()
    folder = str(pathlib.Path(config_file).resolve().parent)
    while _config_folders:
        earlier = _config_folders.pop()
        if earlier in sys.path:
            sys.path.remove(earlier)
    cwd = os.getcwd()
    if folder in sys.path or folder == cwd:
        return
    first = next(i for i, entry in enumerate(sys.path) if entry in ("", cwd))
    sys.path.insert(first + 1, folder)
    _config_folders.append(folder)


def _is_user_file(filename: str) -> bool:
    if filename.startswith("<"):  # <string>, <frozen ...>
        return False
    path = str(pathlib.Path(filename).resolve())
    return not any(path == root or path.startswith(root + os.sep) for root in _NOT_USER)


def user_location(exc: BaseException) -> str | None:
    """``file:line`` of the last frame of ``exc``'s traceback in the user's files (paths
    under the current folder shown relative to it), else None."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if _is_user_file(f.filename)]
    if not frames:
        return None
    path = pathlib.Path(frames[-1].filename)
    try:
        path = path.resolve().relative_to(pathlib.Path.cwd())
    except ValueError:
        pass
    return f"{path}:{frames[-1].lineno}"


def describe_failure(what: str, exc: BaseException) -> str:
    """``"<what> failed: KeyError: 'x' (at pkg/data.py:12)"``; for a SystemExit,
    ``"<what> exited: sys.exit(2) (at ...)"``."""
    where = user_location(exc)
    if isinstance(exc, SystemExit):  # its str() is the bare code: "0", "" or the text
        text = f"{what} exited: sys.exit({exc.code!r})"
    else:
        text = f"{what} failed: {type(exc).__name__}: {exc}"
    return text + (f" (at {where})" if where else "")


# A call of user code while a config is checked (an import, a constructor, a dataset
# factory): a SystemExit there (sys.exit, argparse) is the config's problem, exit 2, not
# an end of csrun. During training the runner reports it as a failure instead.
CHECKED_FAILURES = (Exception, SystemExit)
_EXIT_HINT = ("only csrun ends a run: put the sys.exit() (or argparse call) under "
              "`if __name__ == '__main__':`")


def user_problem(field: str, what: str, exc: BaseException, hint: str | None = None
                 ) -> Problem:
    """A config problem at ``field`` for user code that raised ``exc``."""
    if isinstance(exc, SystemExit):
        hint = _EXIT_HINT
    return Problem(field, describe_failure(what, exc), hint)
