"""The entry to training: run a config in the role its strategy gives this process.

Above both :mod:`~csrun.core.runner.session` and :mod:`~csrun.core.runner.cluster_role`
(which builds on the session), so that imports point one way: a central-storage config
trains as one :class:`~csrun.core.runner.session.Session` of the whole job; a
parameter-server config plays this process's task of its cluster.

Example::

    result = train(load_config("configs/quickstart.yaml"), on_event=print)
    print(result.params_sha256)
"""

from __future__ import annotations

import collections
import contextlib
import threading
import warnings
from typing import Any, Callable, Sequence

from ..config.problems import ConfigError
from ..config.schema import RunConfig
from .cluster_role import run_task
from .events import Notice, RunResult
from .preflight import check_run_options, load_config
from .session import Outputs, Session, run_session
from .signals import stop_on_signals

__all__ = ["train", "train_from_file", "task_name"]

_SEEN = 256  # distinct warning texts remembered (the newest)


def train_from_file(path: str, overrides: Sequence[str] = (), **options: Any) -> RunResult:
    """Load ``path`` with ``overrides`` (override > file > default) and :func:`train` it.

    Raises:
      ConfigError: the config or the options have problems (exit code 2).
      RunError, CheckpointError: the run failed (exit code 1).
    """
    return train(load_config(path, overrides), **options)


def train(config: RunConfig, *, resume: bool = False, outputs: Outputs | None = None,
          on_event: Callable[[Any], None] | None = None,
          stop: threading.Event | None = None) -> RunResult:
    """Train ``config``; checkpoint, evaluate the holdout, and report. With
    ``strategy.kind: parameter_server``, play this process's task of the cluster
    (:mod:`csrun.core.runner.cluster_role`).

    Args:
      config: a validated config (:func:`csrun.core.runner.preflight.load_config`).
      resume: continue from the newest checkpoint in ``checkpoint.dir`` (from the start
        when there is none); ends bit-for-bit where an uninterrupted run ends.
      outputs: optional metric, plot and TensorBoard files.
      on_event: called with each event of :mod:`csrun.core.runner.events`.
      stop: set it to stop after the current step, save a checkpoint and return with
        status ``"interrupted"``. In the main thread, Ctrl-C and SIGTERM set it (twice:
        abort).

    Returns:
      The :class:`~csrun.core.runner.events.RunResult`.

    Raises:
      ConfigError: unusable options (``--plot`` without matplotlib, ``--resume`` without
        ``checkpoint.dir``).
      RunError: a runtime failure (:class:`~csrun.core.runner.errors.NonFiniteLoss`, an
        empty epoch).
      CheckpointError: the checkpoint to resume from is damaged or from another run, or
        one cannot be written.
    """
    outputs = outputs or Outputs()
    _check_options(config, resume, outputs)
    stop = stop or threading.Event()
    received: list[str] = []
    emit = on_event or (lambda event: None)
    with stop_on_signals(stop, received), _engine_warnings(on_event):
        if config.strategy.kind == "parameter_server":  # one task of a cluster
            result = run_task(config, resume, outputs, emit, stop)
        else:  # the whole job: a LocalRole's session
            result = run_session(Session(config, outputs, emit), resume, stop)
        result.signal = received[0] if received and result.status == "interrupted" else None
        return result


def task_name(result: Any) -> str:
    """The task a result is from, as a file name part: ``ps-0``, ``worker-1``; ``local``
    outside a cluster."""
    task = getattr(result, "task", None) or getattr(result, "cluster", {}).get("task")
    return task.replace(":", "-") if task else "local"


def _check_options(config: RunConfig, resume: bool, outputs: Outputs) -> None:
    # output paths are checked now: a bad one found after hours of training loses them
    problems = check_run_options(config.checkpoint.dir, resume, result=outputs.result,
                                 metrics=outputs.metrics, plot=outputs.plot,
                                 tensorboard=outputs.tensorboard)
    if problems:
        raise ConfigError(problems)


@contextlib.contextmanager
def _engine_warnings(on_event: Callable | None):
    """Report the engine's warnings (e.g. dropped batches) once each, as Notices (the
    newest ``_SEEN`` texts are remembered: a text that names a step is new each time)."""
    seen: collections.OrderedDict[str, None] = collections.OrderedDict()

    def show(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if text in seen:
            seen.move_to_end(text)
        elif on_event is not None:
            seen[text] = None
            if len(seen) > _SEEN:
                seen.popitem(last=False)
            on_event(Notice(text))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        yield
