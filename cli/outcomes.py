"""Exit codes, and how the CLI turns what a command raised into a message and a code.

0 ok · 1 runtime failure (clear message) · 2 bad config or usage · 130 interrupted (Ctrl-C),
143 stopped by SIGTERM (both save a checkpoint first).
"""

from __future__ import annotations

import contextlib
import warnings

import typer

from csrun.core.runner.checkpoint import CheckpointError
from csrun.core.runner.preflight import check_writable
from csrun.core.config.problems import ConfigError, ConfigNotice
from csrun.core.config.user_code import UserCodeError
from csrun.core.runner.events import Notice
from csrun.core.runner.session import RunError

from .render import View, clean_floats, write_json

__all__ = ["OK", "FAILED", "USAGE", "INTERRUPTED", "TERMINATED", "reporting"]

OK, FAILED, USAGE, INTERRUPTED, TERMINATED = 0, 1, 2, 130, 143


@contextlib.contextmanager
def reporting(view: View, json_path: str | None):
    """Run a command body; render what it raises, write ``--json`` and exit with its code.

    A ``--json`` path that cannot be written is a usage error before the body runs (not
    after a long run)."""
    try:
        unwritable = check_writable(json_path, "--json")
        if unwritable:
            raise ConfigError(unwritable)
        with _notices(view):
            yield
    except typer.Exit:
        raise
    except ConfigError as exc:
        view.problems(exc)
        _finish(json_path, USAGE, {"status": "invalid",
                                   "problems": [p.to_dict() for p in exc.problems]})
    except (RunError, CheckpointError, UserCodeError) as exc:
        view.failure(str(exc), exc.__cause__ if isinstance(exc, UserCodeError) else None)
        _finish(json_path, FAILED, {"status": "failed", "error": str(exc)})
    except KeyboardInterrupt:
        view.aborted()
        _finish(json_path, INTERRUPTED, {"status": "aborted"})
    except Exception as exc:  # noqa: BLE001 - anything else: a message, not a traceback
        view.crash(exc)
        notes = " ".join(getattr(exc, "__notes__", []))
        _finish(json_path, FAILED, {"status": "failed",
                                    "error": f"{type(exc).__name__}: {exc} {notes}".strip()})


@contextlib.contextmanager
def _notices(view: View):
    """Show the config checks' notices (:class:`ConfigNotice`) as notes."""
    with warnings.catch_warnings():
        warnings.simplefilter("always", ConfigNotice)
        shown = warnings.showwarning

        def show(message, category, *args, **kwargs):
            if issubclass(category, ConfigNotice):
                view.on_event(Notice(str(message)))
            else:
                shown(message, category, *args, **kwargs)
        warnings.showwarning = show
        yield


def _finish(json_path: str | None, code: int, data: dict) -> None:
    if json_path:
        try:
            write_json(json_path, clean_floats({**data, "exit_code": code}))
        except OSError:  # the JSON path itself was the problem; it was reported
            pass
    raise typer.Exit(code)
