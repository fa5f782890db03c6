"""``csrun validate CONFIG [key=value ...]``: check a config without running it."""

from __future__ import annotations

from typing import Annotated, Optional

import typer


def validate(
    config: Annotated[str, typer.Argument(
        metavar="CONFIG", help="The YAML config file.", show_default=False)],
    overrides: Annotated[Optional[list[str]], typer.Argument(
        metavar="KEY=VALUE", help="Overrides (override > file > default).",
        show_default=False)] = None,
    json_path: Annotated[Optional[str], typer.Option(
        "--json", metavar="PATH", help="Write the outcome (and the resolved config) as JSON "
        "to PATH (- for stdout).")] = None,
) -> None:
    """Validate CONFIG (types, devices, data, model, optimizer); exit 0 if valid, else 2."""
    # csrun.core (torch) and the rendering are imported when the command runs, not with
    # the module: `csrun --help` and `--version` then start without torch (~2 s)
    from csrun.core.runner.preflight import load_config

    from .outcomes import reporting
    from .render import View, write_json
    view = View(json_to_stdout=json_path == "-")
    with reporting(view, json_path, config=config):
        resolved = load_config(config, overrides or [])
        view.valid(config, resolved)
        if json_path:
            write_json(json_path, {"status": "valid", "exit_code": 0,
                                   "config": resolved.model_dump(mode="json")})
