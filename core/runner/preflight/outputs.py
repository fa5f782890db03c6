"""Where a run writes: ``checkpoint.dir`` and the output files (``--json``,
``--metrics``, ``--plot``, ``--tensorboard``). Every check of them is here, found before
anything runs, not when the first save of a long run fails. Nothing is created:
``validate`` has no side effects."""

from __future__ import annotations

import os
import pathlib
import stat
from typing import Mapping

from ...config.problems import Problem
from ..metrics import tensorboard_available
from ..plots import plot_available

__all__ = ["check_checkpoint_dir", "check_needs_checkpoint_dir", "check_run_options", "check_writable", "check_outputs",
           "check_outside"]


def check_checkpoint_dir(checkpoint) -> list[Problem]:
    """``checkpoint.dir`` is, or can become, a writable directory."""
    return check_writable(checkpoint.dir, "checkpoint.dir", directory=True)


def check_needs_checkpoint_dir(checkpoint) -> list[Problem]:
    """What writes into ``checkpoint.dir`` has one."""
    if checkpoint is None or checkpoint.dir:
        return []
    return [Problem(f"checkpoint.{field}", "needs checkpoint.dir",
                    "set checkpoint.dir, e.g. runs/mine")
            for field in ("keep_best", "export") if getattr(checkpoint, field) is not None]


def check_run_options(checkpoint_dir: str | None, resume: bool, *, result: str | None,
                      metrics: str | None, plot: str | None, tensorboard: str | None
                      ) -> list[Problem]:
    """A run's options with its config: the outputs can be written (what they need is
    installed) and lie outside ``checkpoint.dir``; ``--resume`` has a directory."""
    problems = check_writable(metrics, "--metrics") + check_writable(plot, "--plot") + \
        check_writable(tensorboard, "--tensorboard", directory=True)
    problems += check_outside(checkpoint_dir, {"--json": result, "--metrics": metrics,
                                               "--plot": plot})
    if resume and not checkpoint_dir:
        problems.append(Problem("checkpoint.dir", "--resume needs a checkpoint directory",
                                "set checkpoint.dir in the config or as an override"))
    if plot and not plot_available():
        problems.append(Problem("--plot", "needs matplotlib, which is not installed",
                                "pip install 'csrun[plot]'"))
    if tensorboard and not tensorboard_available():
        problems.append(Problem("--tensorboard", "needs tensorboard, which is not "
                                "installed", "pip install 'csrun[tensorboard]'"))
    return problems


def check_writable(path: str | None, field: str, *, directory: bool = False) -> list[Problem]:
    """``path`` can be written as a file (or, with ``directory``, a folder): it is not the
    other kind, and the nearest folder that exists on its way can be written in. ``-``
    (stdout) and None pass."""
    if not path or path == "-":
        return []
    target = pathlib.Path(path)
    if not directory and target.is_dir():
        return [Problem(field, f"{path!r} is a directory", "give a file name")]
    if not directory and _blocks(target):
        return [Problem(field, f"{path!r} is a named pipe or a socket; opening it waits "
                        "for a reader, maybe forever", "give a regular file (or - for "
                        "stdout)")]
    start = target if directory else target.parent
    existing = next(p for p in (start, *start.parents) if p.exists() or p == p.parent)
    if not existing.is_dir():
        return [Problem(field, f"{str(existing)!r} is a file, not a directory",
                        "choose another path")]
    if not os.access(existing, os.W_OK | os.X_OK):
        return [Problem(field, f"cannot write in {str(existing)!r} (permission denied)",
                        "choose a path you can write to")]
    return []


def _blocks(target: pathlib.Path) -> bool:
    """A FIFO or socket: ``open(path, "w")`` blocks until someone reads. Devices such
    as /dev/null are fine."""
    try:
        mode = target.stat().st_mode
    except OSError:
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def check_outputs(config: str | None, outputs: Mapping[str, str | None]) -> list[Problem]:
    """No output (option -> path) is the config file or another output's file: writing
    it would destroy the config (``validate c.yaml --json c.yaml``) or tear both."""
    problems, taken = [], [("the config file", config)] if config else []
    for option, path in outputs.items():
        if not path or path == "-":
            continue
        clash = next((what for what, other in taken if _same_file(path, other)), None)
        if clash is not None:
            problems.append(Problem(option, f"{path!r} is {clash}; writing it would "
                                    "overwrite it", "give each output a file of its own"))
        taken.append((f"also the {option} file", path))
    return problems


def check_outside(directory: str | None, outputs: Mapping[str, str | None]) -> list[Problem]:
    """No output file (option -> path) lies in ``checkpoint.dir``: csrun owns and prunes
    the files there, and an output written onto one destroys a checkpoint."""
    if not directory:
        return []
    root = os.path.realpath(directory)
    return [Problem(option, f"{path!r} is inside checkpoint.dir ({directory!r}), whose "
                    "files csrun owns: writing it could destroy a checkpoint",
                    "write outputs outside checkpoint.dir")
            for option, path in outputs.items() if path and path != "-" and
            (os.path.realpath(path) + os.sep).startswith(root + os.sep)]


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)  # hard links and symlinks too
    except OSError:  # one does not exist yet: compare the resolved spellings
        return os.path.realpath(a) == os.path.realpath(b)
