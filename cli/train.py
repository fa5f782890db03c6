"""``csrun train CONFIG [key=value ...]``: train a config (central storage, or one task of
a parameter-server job)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer


def train(
    config: Annotated[str, typer.Argument(
        metavar="CONFIG", help="The YAML config file.", show_default=False)],
    overrides: Annotated[Optional[list[str]], typer.Argument(
        metavar="KEY=VALUE", help="Overrides, e.g. train.steps=100 (override > file > default).",
        show_default=False)] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue from the newest checkpoint in checkpoint.dir.")] = False,
    json_path: Annotated[Optional[str], typer.Option(
        "--json", metavar="PATH", help="Write the result as JSON to PATH (- for stdout); "
        "{task} in PATH becomes this process's task (ps-0, worker-1; local), for "
        "launchers such as torchrun that give every process the same command.")
    ] = None,
    plot: Annotated[Optional[str], typer.Option(
        metavar="PATH", help="Write the loss curve and per-replica step times as an image "
        "(needs matplotlib: pip install 'csrun[plot]').")] = None,
    metrics: Annotated[Optional[str], typer.Option(
        metavar="PATH", help="Append per-step metrics to PATH as JSON lines.")] = None,
    tensorboard: Annotated[Optional[str], typer.Option(
        metavar="DIR", help="Write TensorBoard event files to DIR (needs tensorboard).")
    ] = None,
) -> None:
    """Train CONFIG: distribute -> run -> reduce on the configured replicas (with
    strategy.kind: parameter_server, this process's task of the cluster in TF_CONFIG).

    Exit codes: 0 ok, 1 runtime failure, 2 bad config or usage, 130 interrupted by Ctrl-C,
    143 by SIGTERM (both save a checkpoint first).
    """
    # csrun.core (torch) and the rendering are imported when the command runs, not with
    # the module: `csrun --help` and `--version` then start without torch (~2 s)
    import threading

    from csrun.core.runner.session import Outputs
    from csrun.core.runner.train import task_name, train_from_file

    from . import streams
    from .outcomes import INTERRUPTED, OK, TERMINATED, reporting
    from .render import View, clean_floats, write_json
    view = View(json_to_stdout=json_path == "-")
    stop = threading.Event()  # set by the first Ctrl-C or SIGTERM
    streams.stopping(stop)  # then a full stdout no longer holds the run up
    with reporting(view, json_path, config=config,
                   outputs={"--metrics": metrics, "--plot": plot}):
        result = train_from_file(config, overrides or [], resume=resume,
                                 outputs=Outputs(metrics, plot, tensorboard, json_path),
                                 on_event=view.on_event, stop=stop)
        view.summary(result, {"plot": plot, "metrics": metrics, "tensorboard": tensorboard})
        code = OK if result.status != "interrupted" else \
            TERMINATED if result.signal == "SIGTERM" else INTERRUPTED
        if json_path:
            write_json(json_path.replace("{task}", task_name(result)), clean_floats(
                {**result.to_dict(), "config": config, "overrides": overrides or [],
                 "exit_code": code}))
    if code in (INTERRUPTED, TERMINATED):
        role = getattr(result, "cluster", {}).get("role")  # in a cluster, the chief saves
        view.interrupted(getattr(result, "checkpoint", {}).get("last"),
                         chief=role in (None, "chief"))
        raise typer.Exit(code)
