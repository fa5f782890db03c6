"""``csrun inspect-devices [--json]``: the local devices and TF's default placement."""

from __future__ import annotations

from typing import Annotated

import typer


def inspect_devices(
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print the report as JSON on stdout instead of a table.")] = False,
) -> None:
    """List every device (TF name, torch name, kind, memory, GPU model and capability) and
    where a default CentralStorageStrategy() would compute and keep parameters."""
    # csrun.core (torch) and the rendering are imported when the command runs, not with
    # the module: `csrun --help` and `--version` then start without torch (~2 s)
    from csrun.core.config.problems import ConfigError
    from csrun.core.distribute.device_lib import list_local_devices
    from csrun.core.runner.preflight import check_environment

    from .outcomes import reporting
    from .render import View, write_json
    view = View(json_to_stdout=as_json)
    with reporting(view, "-" if as_json else None):
        problems = check_environment()  # a bad CSRUN_LOGICAL_CPUS: exit 2, naming it
        if problems:
            raise ConfigError(problems)
        report = list_local_devices()
        if as_json:
            write_json("-", report)
        else:
            view.devices(report)
