"""The ``csrun`` console script: Ctrl-C is handled from the first instant.

Importing torch takes seconds; a Ctrl-C then used to print a 40-line traceback and no
``--json``, and one during the interpreter's exit (atexit) another. Until a command
installs its own handling (a run's clean stop), a Ctrl-C or SIGTERM ends the process at
once with one line, exit 130/143 and, when ``--json PATH`` was given, a result. Only the
standard library is used here: it must work before anything heavy is imported.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import stat
import sys
import textwrap
import threading

from . import streams
from .columns import MIN_COLUMNS

__all__ = ["main"]

_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}


def main() -> None:
    """Entry point: guard the start, run the command, then exit with its outcome."""
    for signum in _CODES:
        signal.signal(signum, _stop_now)
    _follow_launcher(os.environ.get("CSRUN_LAUNCHER_PID"))
    streams.install()  # a reader that stopped reading cannot keep a stop from being heard
    try:
        from .main import main as run_command
        run_command()
    except SystemExit as exc:  # the command's outcome, decided and reported
        _leave(exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1)
        raise


def _leave(code: int) -> None:
    """Exit with the command's ``code``, whatever happens now: a signal during the exit
    ends it with that code (it used to report "no training step ran"), and a thread of
    the user's code that is not a daemon (a Dataset's prefetcher), which Python would
    wait for forever, is left behind, after the exit handlers ran, with a note; so is a
    call into torch's C++ that a cluster task gave up on (see
    :func:`csrun.core.cluster.transport.calls_running`), and a final evaluation that a
    signal interrupted (:func:`csrun.core.runner.evaluation.abandoned`). (A signal during the exit
    handlers, torch's or the loaders', printed a traceback.)"""
    for signum in _CODES:
        signal.signal(signum, lambda signum, frame: os._exit(code))
    _flush()  # what was written (--json -) is out before a signal could cut the exit short
    main = threading.main_thread()
    stranded = [t for t in threading.enumerate()
                if t is not main and not t.daemon and t.is_alive()]
    transport = sys.modules.get("csrun.core.cluster.transport")  # loaded by a cluster task
    evaluation = sys.modules.get("csrun.core.runner.evaluation")  # loaded by a run
    if not stranded and not (transport and transport.calls_running()) and \
            not (evaluation and evaluation.abandoned()):
        return  # Python's own exit
    if stranded:  # the user's code ran, so csrun.core is loaded already
        from csrun.core.config.problems import printable
        names = ", ".join(printable(t.name[:40]) for t in stranded)
        sys.stderr.write(fitted(f"note: exiting without waiting for {len(stranded)} "
                                f"thread(s) still running in your code "
                                f"({names[:200]}); make them daemon threads, "
                                "or end them") + "\n")
    atexit._run_exitfuncs()
    _flush()
    os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that went away: nothing more to say
            pass


def _follow_launcher(pid: str | None) -> None:
    """A task of ``csrun launch`` gets SIGTERM (its clean stop) when the launcher dies,
    even by SIGKILL: tasks run in sessions of their own, so nothing else would end them.
    Set by the task itself, not in the launcher's fork (unsafe beside its threads)."""
    if not pid or not sys.platform.startswith("linux"):
        return
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl here: the launcher's own checks remain
        return
    parent = os.getppid()
    if parent == 1:  # the launcher died before the line above (its orphan went to init)
        _stop_now(signal.SIGTERM, None)
    elif str(parent) != pid:  # started by hand with a launcher's environment: not its task
        ctypes.CDLL(None, use_errno=True).prctl(1, 0)
        sys.stderr.write(fitted(f"note: CSRUN_LAUNCHER_PID={pid} is not this process's "
                                "parent (started by hand from a launched task's "
                                "environment?): it does not stop with that launcher") + "\n")


def _stop_now(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    code = _CODES[signum]
    message = f"interrupted ({name}) while no training step ran; nothing to save"
    _write_json(_json_path(sys.argv[1:]), {"status": "interrupted", "signal": name,
                                           "error": message, "exit_code": code})
    sys.stderr.write(f"{fitted(message)}\n")
    sys.stderr.flush()
    os._exit(code)  # mid-import: nothing to unwind, and unwinding would print a traceback


def fitted(text: str) -> str:
    """On a terminal, ``text`` broken between words to fit it, as all csrun prints is
    (:mod:`csrun.cli.lines` needs rich, which may not be loaded yet)."""
    if not sys.stderr.isatty():
        return text
    # a terminal that says it has 0 columns (a pty never sized) has the minimum of render's
    width = max(MIN_COLUMNS, shutil.get_terminal_size().columns)
    return textwrap.fill(text, width, subsequent_indent="  ", break_long_words=False,
                         break_on_hyphens=False)


def _json_path(args: list[str]) -> str | None:
    """``--json PATH`` of train, validate or launch (inspect-devices' is a flag)."""
    if not args or args[0] not in ("train", "validate", "launch"):
        return None
    for i, arg in enumerate(args):
        if arg == "--":
            return None
        if arg.startswith("--json="):
            return arg.split("=", 1)[1]
        if arg == "--json" and i + 1 < len(args):
            return args[i + 1]
    return None


def _write_json(path: str | None, data: dict) -> None:
    text = json.dumps(data, indent=2) + "\n"
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    if path is None or not _safe_output(path, sys.argv[2:3]):
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    except OSError:
        pass  # best effort: the one line on stderr says what happened


def _safe_output(path: str, inputs: list[str]) -> bool:
    """Not a pipe or a device that could block, not the config file (the full checks
    of csrun.core need torch, which may be half-imported now)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return False
    except OSError:
        return os.path.isdir(os.path.dirname(path) or ".")
    return not any(os.path.exists(i) and os.path.samefile(path, i) for i in inputs)
