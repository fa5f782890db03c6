"""``docs/config.md``, generated from the config models (their docstrings and field
descriptions), so the reference cannot drift from the code.

Regenerate with ``python -m csrun.core.config.reference docs/config.md``; a test fails
when the committed file is stale.
"""

from __future__ import annotations

import json
import pathlib
import sys
import types
import typing
from typing import Any, Literal, Union

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from .schema import RunConfig

__all__ = ["render_reference", "main"]

_HEADER = """\
# Config reference

<!-- Generated from csrun/core/config/schema.py by `python -m csrun.core.config.reference
docs/config.md`. Do not edit by hand: tests/unit/test_config_reference.py fails when it
is stale. -->

A csrun config is a YAML file with the sections below. Values can be changed on the
command line with dotted `key=value` overrides after the config path (values are parsed as
YAML: `train.steps=200`, `strategy.compute_devices=[CPU:0,CPU:1]`,
`dataset.steps.1.size=128`). Precedence: **override > file > default**.

Unknown keys are errors (with a did-you-mean). Integers are 64-bit (at most
9223372036854775807) and numbers must be finite (no `.nan` or `.inf`); `kwargs` hold
plain YAML data (numbers, strings, booleans, null, lists and mappings). `validate` and
`train` report every problem at once with its dotted path and `file:line`, and exit with
code 2.
"""


def render_reference() -> str:
    """The Markdown text of ``docs/config.md``."""
    parts = [_HEADER]
    for name, field in RunConfig.model_fields.items():
        parts.append(_section(name, field.annotation, level=2, intro=field.description))
    return "\n".join(parts).rstrip() + "\n"


def _unwrap(annotation: Any) -> Any:
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return annotation


def _models_of(annotation: Any) -> list[type[BaseModel]]:
    """The config models an annotation holds (a model, a union of them, a list of them)."""
    annotation = _unwrap(annotation)
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType, list):  # once each: `X | list[X]` is one section
        return list(dict.fromkeys(m for arg in typing.get_args(annotation)
                                  for m in _models_of(arg)))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _tag(model: type[BaseModel]) -> tuple[str, str] | None:
    for key in ("kind", "op"):
        if key in model.model_fields:
            return key, typing.get_args(model.model_fields[key].annotation)[0]
    return None


def _section(path: str, annotation: Any, level: int, intro: str | None) -> str:
    models = _models_of(annotation)
    heading = "#" * level
    out = []
    if len(models) == 1 and _tag(models[0]) is None:
        out.append(f"{heading} `{path}`\n\n{_doc(models[0])}\n")
        out.append(_table(path, models[0], level))
        return "\n".join(out)
    key = _tag(models[0])[0]
    listed = typing.get_origin(_unwrap(annotation)) is list
    shown = f"{path}[]" if listed else path
    choices = ", ".join(f"`{_tag(m)[1]}`" for m in models)
    out.append(f"{heading} `{shown}`\n\n{intro or ''} Choices of `{key}`: {choices}.\n")
    for model in models:
        out.append(f"{heading}# `{shown}` with `{key}: {_tag(model)[1]}`\n\n{_doc(model)}\n")
        out.append(_table(shown, model, level + 1))
    return "\n".join(out)


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def _table(path: str, model: type[BaseModel], level: int) -> str:
    rows = ["| key | type | default | description |", "|---|---|---|---|"]
    nested = []
    for name, field in model.model_fields.items():
        description = (field.description or "").replace("|", "\\|")
        kind = _type(field.annotation) + _bounds(field.metadata)
        rows.append(f"| `{name}` | {kind} | {_default(field)} | "
                    f"{description} |")
        if _models_of(field.annotation):
            nested.append(_section(f"{path}.{name}", field.annotation, level + 1,
                                   field.description))
    return "\n".join(rows) + "\n" + "".join("\n" + n for n in nested)


def _type(annotation: Any) -> str:
    annotation = _unwrap(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    models = _models_of(annotation)
    if models and _tag(models[0]) and origin is not list:
        return f"section (by `{_tag(models[0])[0]}`)"
    if origin is Literal:
        return " \\| ".join(f"`{json.dumps(a)}`" for a in args)
    if origin in (Union, types.UnionType):
        return " \\| ".join(_type(a) for a in args)
    if origin is list:
        return f"list of {_type(args[0])}"
    if origin is dict:
        return "mapping"
    if annotation is type(None):
        return "null"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(metadata: list) -> str:
    """Range constraints of a field (``Field(gt=0)``), as `` > 0``."""
    signs = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    found = [f"{signs[name]} {getattr(m, name)}" for m in metadata for name in signs
             if getattr(m, name, None) is not None]
    return f" ({', '.join(found)})" if found else ""


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return "(section defaults)"
    return f"`{json.dumps(value)}`"


def main(argv: list[str] | None = None) -> int:
    """Write the reference to the path given (stdout without one)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        # An option is never a path: "--help" once became a file of that name.
        sys.stdout.write("usage: python -m csrun.core.config.reference [OUTPUT.md]\n")
        return 0 if argv[0] in ("-h", "--help") else 2
    text = render_reference()
    if argv:
        pathlib.Path(argv[0]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
