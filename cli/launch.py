"""``csrun launch CONFIG [key=value ...] --workers N --ps M``: a parameter-server job of
separate ``csrun train`` processes on this machine."""

from __future__ import annotations

import threading
from typing import Annotated, Optional

import typer


def launch(
    config: Annotated[str, typer.Argument(
        metavar="CONFIG", help="The YAML config file (strategy.kind: parameter_server).",
        show_default=False)],
    overrides: Annotated[Optional[list[str]], typer.Argument(
        metavar="KEY=VALUE", help="Overrides for every task (override > file > default).",
        show_default=False)] = None,
    workers: Annotated[int, typer.Option(
        "--workers", metavar="N", help="Worker tasks; each reads and trains on its share of every "
        "global batch.", show_default=False)] = ...,
    ps: Annotated[int, typer.Option(
        "--ps", metavar="M", help="Parameter-server tasks; they hold the variables.",
        show_default=False)] = ...,
    chief: Annotated[bool, typer.Option(
        "--chief/--no-chief", help="Start a separate chief task besides the N workers "
        "(default: worker:0 is the chief).")] = False,
    resume: Annotated[bool, typer.Option(
        "--resume", help="The chief continues from the newest checkpoint in "
        "checkpoint.dir and restores the parameter servers from it; the other workers "
        "start at its step.")] = False,
    json_path: Annotated[Optional[str], typer.Option(
        "--json", metavar="PATH", help="Write the outcome (the chief's result and every "
        "task's exit code) as JSON to PATH (- for stdout).")] = None,
    logs: Annotated[Optional[str], typer.Option(
        "--logs", metavar="DIR", help="Keep each task's stdout and stderr in DIR (default: "
        "a temporary directory, removed at the end unless the job failed or lost a "
        "worker).")] = None,
) -> None:
    """Launch a parameter-server job on this machine: one `csrun train` process per task,
    on loopback, each with its own TF_CONFIG; their output prefixed by task.

    Exit codes: 0 the chief and every ps finished (a worker lost to a signal is reported,
    not fatal), 1 the job failed: a task failed (naming the first), 2 bad config or usage
    (nothing started), 130/143
    stopped by Ctrl-C/SIGTERM (the chief saves a checkpoint first).
    """
    # csrun.core (torch) and the rendering are imported when the command runs, not with
    # the module: `csrun --help` and `--version` then start without torch (~2 s)
    from csrun.core.runner.launch import launch as run_job
    from csrun.core.runner.launch import plan_launch
    from csrun.core.runner.signals import stop_on_signals

    from . import streams
    from .outcomes import reporting
    from .render import View, clean_floats, write_json
    view = View(json_to_stdout=json_path == "-")
    with reporting(view, json_path, config=config):
        plan = plan_launch(config, overrides or [], workers=workers, ps=ps, chief=chief,
                           resume=resume, logs=logs)
        view.launch_started(plan)
        stop, received = threading.Event(), []
        streams.stopping(stop)  # then a full stdout no longer holds the job up
        with stop_on_signals(stop, received):
            result = run_job(plan, view.on_launch_event, stop, received,
                             environ=view.task_environ())
        view.launch_summary(result)
        if json_path:
            write_json(json_path, clean_floats(result.to_dict()))
    if result.exit_code:
        raise typer.Exit(result.exit_code)
