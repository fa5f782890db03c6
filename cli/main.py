"""The ``csrun`` command: one module per command; this file only registers them."""

from __future__ import annotations

import os

# Before torch loads OpenMP: idle OpenMP workers sleep instead of spinning. The input
# thread and the replicas share few cores; spinning workers made small runs 4x slower on
# 2 busy cores (configs/per_replica.yaml: 9-12 s instead of 2.5 s). Set it to override.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Before torch loads c10's logging: a broken store or gloo connection (a dead ps) logs a
# warning with 10-50 lines of C++ frames before csrun's one-line error, which says what
# happened. CSRUN_TRACEBACK=1 (or setting the variable yourself) shows them.
if not os.environ.get("CSRUN_TRACEBACK"):
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")

import importlib.metadata  # noqa: E402
from typing import Annotated, Optional  # noqa: E402

import typer  # noqa: E402

from . import inspect_devices, launch, train, validate  # noqa: E402
from .help import Command, Group  # noqa: E402

app = typer.Typer(
    name="csrun", cls=Group, no_args_is_help=True, add_completion=False,
    pretty_exceptions_enable=False, rich_markup_mode=None,
    help="TensorFlow's CentralStorageStrategy and ParameterServerStrategy for PyTorch: "
         "train a YAML config on several replicas with parameters kept on one device, or "
         "on a cluster of workers and parameter servers.")
# short_help: the list of commands would cut each docstring at its first line's end
app.command("train", cls=Command, short_help="Train a config: on replicas of this "
            "machine, or as one task of a parameter-server job.")(train.train)
app.command("validate", cls=Command, short_help="Check a config without running it: "
            "exit 0 if valid, 2 with every problem.")(validate.validate)
app.command("inspect-devices", cls=Command, short_help="List the local devices and "
            "where a default CentralStorageStrategy puts replicas and parameters."
            )(inspect_devices.inspect_devices)
app.command("launch", cls=Command, short_help="Run a parameter-server job on this "
            "machine: one csrun train process per task.")(launch.launch)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"csrun {importlib.metadata.version('csrun')}")
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[Optional[bool], typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")]
          = None) -> None:
    """csrun: TensorFlow's CentralStorageStrategy and ParameterServerStrategy for PyTorch."""


def main() -> None:
    """Run the command line (the console script, :mod:`csrun.cli.entry`, guards it)."""
    app()


if __name__ == "__main__":  # `python -m csrun.cli.main`; `python -m csrun.cli` (the
    main()                  # console script's entry) also handles an early Ctrl-C
