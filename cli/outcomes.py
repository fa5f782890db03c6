"""Exit codes, and how the CLI turns what a command raised into a message and a code.

0 ok · 1 runtime failure (clear message) · 2 bad config or usage · 130 interrupted (Ctrl-C),
143 stopped by SIGTERM (both save a checkpoint first).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import warnings

import typer

from csrun.core.runner.checkpoint import CheckpointError
from csrun.core.runner.metrics import OutputError
from csrun.core.runner.preflight import check_outputs, check_writable
from csrun.core.config.problems import ConfigError, ConfigNotice, Problem
from csrun.core.config.user_code import UserCodeError
from csrun.core.runner.events import Notice
from csrun.core.runner.errors import RunError
from csrun.core.runner.signals import Aborted

from .render import View, clean_floats, write_json

__all__ = ["OK", "FAILED", "USAGE", "INTERRUPTED", "TERMINATED", "reporting"]

OK, FAILED, USAGE, INTERRUPTED, TERMINATED = 0, 1, 2, 130, 143


@contextlib.contextmanager
def reporting(view: View, json_path: str | None, *, config: str | None = None,
              outputs: dict[str, str | None] | None = None):
    """Run a command body; render what it raises, write ``--json`` and exit with its code.

    A ``--json`` path that cannot be written, or an output (``--json`` or ``outputs``,
    option -> path) onto the ``config`` file or onto another output, is a usage error
    before the body runs (not after a long run); then ``--json`` is not written either."""
    try:
        outputs = {**(outputs or {}), "--json": json_path}  # a clash is --json's: not written
        unusable = _empty(outputs) + check_writable(json_path, "--json") + \
            check_outputs(config, outputs)
        if unusable:
            json_path = None if any(p.path == "--json" for p in unusable) else json_path
            raise ConfigError(unusable)
        with _notices(view):
            yield
    except typer.Exit:
        raise
    except ConfigError as exc:
        view.problems(exc)
        if any(p.path == "--json" for p in exc.problems):  # a refused path stays untouched
            json_path = None
        _finish(json_path, USAGE, {"status": "invalid",
                                   "problems": [p.to_dict() for p in exc.problems]})
    except (RunError, CheckpointError, OutputError, UserCodeError) as exc:
        view.failure(str(exc), exc.__cause__ if isinstance(exc, UserCodeError) else None)
        _finish(json_path, FAILED, {"status": "failed", "error": str(exc)})
    except SystemExit as exc:
        if isinstance(exc.__context__, BrokenPipeError):
            # rich's answer to a reader that went away (`csrun ... | head`): stop quietly
            _finish(json_path, FAILED, {"status": "failed",
                                        "error": "standard output was closed"})
        error = _user_exit(exc)  # sys.exit/argparse in user code: csrun did not decide it
        view.failure(error)
        _finish(json_path, FAILED, {"status": "failed", "error": error})
    except Aborted as exc:
        view.aborted(exc.signal)
        _finish(json_path, TERMINATED if exc.signal == "SIGTERM" else INTERRUPTED,
                {"status": "aborted", "signal": exc.signal})
    except KeyboardInterrupt:  # a first Ctrl-C outside training: nothing to save
        view.interrupted(None, saved_nothing="no training step was running")
        _finish(json_path, INTERRUPTED, {"status": "interrupted", "signal": "SIGINT"})
    except Exception as exc:  # noqa: BLE001 - anything else: a message, not a traceback
        if _stdout_failed(exc):
            error = f"cannot write to standard output: {exc.strerror} (is it redirected to " \
                    "a full disk?)"
            view.failure(error)
            _finish(json_path, FAILED, {"status": "failed", "error": error})
        view.crash(exc)
        notes = " ".join(getattr(exc, "__notes__", []))
        _finish(json_path, FAILED, {"status": "failed",
                                    "error": f"{type(exc).__name__}: {exc} {notes}".strip()})


@contextlib.contextmanager
def _notices(view: View):
    """Show the config checks' notices (:class:`ConfigNotice`) as notes, and any other
    warning (csrun's, torch's) on a line of the view's, fitted as every line is."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", ConfigNotice)

        def show(message, category, filename, lineno, *args, **kwargs):
            if issubclass(category, ConfigNotice):
                view.on_event(Notice(str(message)))
            else:
                view.warning(f"{category.__name__}: {message}", f"{filename}:{lineno}")
        warnings.showwarning = show
        yield


def _stdout_failed(exc: BaseException) -> bool:
    """Our own files are written through OutputError, which names them: an unnamed disk
    error is standard output's. It is let go, so the exit's flush does not fail again."""
    if not (isinstance(exc, OSError) and exc.filename is None and
            exc.errno in (errno.ENOSPC, errno.EIO, errno.EDQUOT)):
        return False
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - replaces stdout until exit
    return True


def _empty(outputs: dict[str, str | None]) -> list[Problem]:
    """``--json ''`` (a shell variable left unset) must not pass for no --json at all."""
    return [Problem(option, "the path is empty", f"give a file path, or leave {option} out")
            for option, path in outputs.items() if path is not None and not path.strip()]


def _user_exit(exc: SystemExit) -> str:
    notes = "".join(f" {n}" for n in getattr(exc, "__notes__", []))
    return (f"user code exited (SystemExit: {exc.code!r}){notes}; only csrun ends a run, "
            "so this is a failure: is there a sys.exit() or an argparse call in the model "
            "or a map function?")


def _finish(json_path: str | None, code: int, data: dict) -> None:
    if json_path:
        try:
            write_json(json_path, clean_floats({**data, "exit_code": code}))
        except (OSError, OutputError):  # the JSON path itself failed; it was reported
            pass
    raise typer.Exit(code)
