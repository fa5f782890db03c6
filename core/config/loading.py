"""Reading a config: the YAML file (with ``file:line`` for every problem), overrides and
the schema; every problem of one pass reported together.

The runner's preflight adds the checks against this machine, its data and its cluster
through ``checks`` (:func:`csrun.core.runner.preflight.load_config`): this layer, the
bottom one, knows nothing of devices, data, models or clusters.

Example::

    config = read_config("configs/quickstart.yaml", ["train.epochs=2", "optimizer.lr=0.01"])
"""

from __future__ import annotations

import pathlib
import typing
from typing import Annotated, Any, Callable, Sequence, Union

from pydantic import BaseModel, TypeAdapter, ValidationError

from .overrides import apply_overrides, key_path
from .problems import ConfigError, Problem, closest, did_you_mean
from .safe_yaml import MAX_BYTES, YamlDocument, load_yaml
from .user_code import import_beside_config
from .schema import (SECTIONS, CentralStorageConfig, CheckpointConfig, DatasetConfig, ModelConfig,
                     OptimizerConfig, ParameterServerConfig,
                     RunConfig, StrategyConfig, TrainConfig)

__all__ = ["read_config", "read_config_text", "Check"]

Check = Callable[[dict], list]
"""A check of the valid sections (name -> model) that returns its problems."""


def read_config(path: str | pathlib.Path, overrides: Sequence[str] = (), *,
                checks: Sequence[Check] = ()) -> RunConfig:
    """Read, override and validate a config file, then run ``checks`` on its valid sections.

    Args:
      path: the YAML file.
      overrides: ``key=value`` strings (dotted keys, YAML values); they win over the file.
      checks: more checks of the valid sections, whose problems are located in the file
        like the schema's (the runner passes its preflight).

    Returns:
      The validated :class:`RunConfig`.

    Raises:
      ConfigError: every problem found, each with its dotted path, ``file:line`` and hint.
    """
    path = pathlib.Path(path)
    text = _read_config(path)
    import_beside_config(path)  # before the checks import what the config names
    return read_config_text(text, str(path), overrides, checks=checks)


def _read_config(path: pathlib.Path) -> str:
    """The text of a config file, or a ConfigError that says why there is none."""
    if path.is_dir():
        names = sorted(p.name for p in path.glob("*.y*ml"))
        raise ConfigError([Problem("", f"{str(path)!r} is a directory, not a config file",
                                   f"YAML files in it: {', '.join(names)}" if names else
                                   "give the path of a .yaml file")])
    try:
        with open(path, "rb") as f:
            # at most one byte past the limit: a device (/dev/zero) or a huge file costs
            # no more than a config would
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError([Problem("", f"config file {str(path)!r} not found",
                                   _sibling_hint(path))]) from None
    except OSError as exc:
        raise ConfigError([Problem("", f"cannot read config file {str(path)!r}: "
                                   f"{exc.strerror or exc}", "check its permissions")]) \
            from None
    if len(data) > MAX_BYTES:
        raise ConfigError([Problem("", f"the file is larger than {MAX_BYTES} bytes; a "
                                   "config is a few kilobytes", file=str(path))])
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError([Problem("", f"the file is not UTF-8 text (byte 0x{data[exc.start]:02x}"
                                   f" at offset {exc.start})", "save it as UTF-8 YAML; is it "
                                   "a binary file?", str(path), line)]) from None


def read_config_text(text: str, file: str | None = None, overrides: Sequence[str] = (),
                     *, checks: Sequence[Check] = ()) -> RunConfig:
    """:func:`read_config` for YAML text (``file`` names it in messages)."""
    document = load_yaml(text, file)
    data = document.data if document.data is not None else {}
    if not isinstance(data, dict):
        raise ConfigError([Problem("", f"the config must be a mapping of sections "
                                   f"({', '.join(SECTIONS)}), got {type(data).__name__}",
                                   file=file, line=1)])
    origins: dict = {}
    problems = apply_overrides(data, overrides, origins)
    sections, found = _validate(data)
    problems += found
    _resolve_paths(sections, file, origins)
    reported = {p.path for p in problems}
    found = [p for check in checks for p in check(sections)]
    problems += [p for p in found if not _explained(p.path, reported)]
    if problems:
        raise ConfigError(_locate(p, document, origins) for p in problems)
    return RunConfig.model_construct(**sections)


# The paths a config names: relative ones written in the file start at its folder, so
# that a config runs the same from any current folder; relative ones given as overrides
# start at the current folder, as any command-line argument does.
_PATHS = (("dataset", "source", "path"), ("checkpoint", "dir"))


def _resolve_paths(sections: dict, file: str | None, origins: dict) -> None:
    """Make every relative path written in ``file`` start at its folder (text without a
    file, and overrides: the current folder)."""
    if file is None:
        return
    for path in _PATHS:
        if any(path[:len(set_path)] == set_path for set_path in origins):
            continue  # set (or replaced) by an override
        value = _get(sections, path)
        if isinstance(value, str) and value and not pathlib.Path(value).is_absolute():
            _set(sections, path, str(pathlib.Path(file).parent / value))


def _get(sections: dict, path: tuple) -> Any:
    node = sections.get(path[0])
    for key in path[1:]:
        node = getattr(node, key, None)
    return node


def _set(sections: dict, path: tuple, value: Any) -> None:
    """Replace one value in the frozen section models (copies along the way)."""
    def put(node, keys):
        if not keys:
            return value
        return node.model_copy(update={keys[0]: put(getattr(node, keys[0]), keys[1:])})
    sections[path[0]] = put(sections[path[0]], path[1:])


def _explained(path: str, reported: set[str]) -> bool:
    """A check's problem at ``path`` is noise when it or a key below it was reported
    (a partially valid section is checked without its bad keys)."""
    return any(r == path or r.startswith(path + ".") for r in reported if path)


def _sibling_hint(path: pathlib.Path) -> str | None:
    folder = path.parent if str(path.parent) else pathlib.Path(".")
    if not folder.is_dir():
        return None
    files = {p.stem: p.name for p in folder.glob("*.y*ml") if p.is_file()}
    names = sorted(files.values())
    # compare the stems: a shared ".yaml" would make unrelated names look alike
    close = closest(path.stem, sorted(files))
    if close is not None:
        return f"did you mean {files[close]!r}?"
    listed = ", ".join(names[:12]) + (", ..." if len(names) > 12 else "")
    return f"YAML files in {str(folder)!r}: {listed}" if names else None


# -- validation, one section at a time -------------------------------------------------
_SECTION_TYPES = {"strategy": StrategyConfig, "dataset": DatasetConfig, "model": ModelConfig,
                  "optimizer": OptimizerConfig, "train": TrainConfig,
                  "checkpoint": CheckpointConfig}
_ADAPTERS: dict = {}


def _adapter(name: str):
    if name not in _ADAPTERS:
        _ADAPTERS[name] = TypeAdapter(_SECTION_TYPES[name])
    return _ADAPTERS[name]


def _validate(data: dict) -> tuple[dict, list[Problem]]:
    """Validate each section on its own, so that the problems of all are reported.

    Returns the sections that are valid (name -> model) and the problems of the others.
    """
    problems = [Problem(str(key), "unknown section", did_you_mean(key, SECTIONS) or
                        f"the sections are {', '.join(SECTIONS)}")
                for key in data if key not in SECTIONS]
    sections: dict = {}
    for name, field in RunConfig.model_fields.items():
        raw = data.get(name)
        if raw is None and field.is_required():
            problems.append(Problem(name, "missing section (required)", field.description))
            continue
        if raw is None:
            raw = data[name] = {}  # an empty section (all keys commented out): defaults
        if name == "strategy" and isinstance(raw, dict):
            raw.setdefault("kind", "central_storage")  # the default strategy's tag
        try:
            sections[name] = _adapter(name).validate_python(raw)
        except ValidationError as exc:
            found = _pydantic_problems(exc, name, data)
            problems += found
            partial = _partial_section(name, raw, found)
            if partial is not None:
                sections[name] = partial
    return sections, problems


def _partial_section(name: str, raw: Any, problems: list[Problem]):
    """The section without its bad keys, if that validates (defaults fill in), so that
    preflight can still check the rest of it; None otherwise.

    A removed key was reported already; a preflight problem at the same path is dropped.
    """
    if not isinstance(raw, dict):
        return None
    bad = {p.path.split(".")[1] for p in problems if p.path.count(".") >= 1}
    if not bad or any(p.path == name for p in problems):
        return None
    try:
        return _adapter(name).validate_python({k: v for k, v in raw.items() if k not in bad})
    except ValidationError:
        return None


def _pydantic_problems(exc: ValidationError, section: str, data: dict) -> list[Problem]:
    by_path: dict[str, Problem] = {}
    for error in exc.errors(include_url=False):
        loc = (section,) + tuple(error["loc"])
        path = ".".join(str(p) for p in _raw_path(loc, data))
        message, hint = _describe(error, loc)
        if error["type"] == "union_tag_invalid":
            path += f".{str((error.get('ctx') or {}).get('discriminator', 'kind')).strip(chr(39))}"
        if path in by_path:  # a plain union: one error per member; say them together
            known = by_path[path]
            if message not in known.message:
                known.message += f"; or {message}"
            continue
        by_path[path] = Problem(path, message, hint)
    return list(by_path.values())


def _raw_path(loc: tuple, data: Any) -> tuple:
    """The part of pydantic's ``loc`` that names keys in the data (drops union tags)."""
    node, out = data, []
    for part in loc:
        if isinstance(node, dict):
            if part in node:
                out.append(part)
                node = node[part]
            elif part not in (node.get("kind"), node.get("op")):
                out.append(part)  # a missing key
                node = None
        elif isinstance(node, list) and isinstance(part, int) and part < len(node):
            out.append(part)
            node = node[part]
    return tuple(out)


def _describe(error: dict, loc: tuple) -> tuple[str, str | None]:
    """A clear message and hint for one pydantic error."""
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind == "missing":
        field = _field_at(loc)
        return "missing (required)", field.description if field else None
    if kind == "extra_forbidden":
        fields = _fields_at(loc[:-1])
        return "unknown key", _other_strategy(loc) or did_you_mean(loc[-1], fields) or (
            f"valid keys here: {', '.join(fields)}" if fields else None)
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        tag = str(ctx.get("discriminator", "kind")).strip("'")
        expected = [t.strip().strip("'") for t in str(ctx.get("expected_tags", "")).split(",")]
        if kind == "union_tag_not_found":  # pydantic names no tags here: the schema does
            expected = [t for t in expected if t] or _tags_at(loc, tag)
            return f"needs `{tag}`", _colon_hint(value) or f"one of: {', '.join(expected)}"
        return (f"unknown {tag} {ctx.get('tag')!r}",
                did_you_mean(ctx.get("tag"), expected) or f"one of: {', '.join(expected)}")
    if kind == "literal_error":
        options = [o.strip().strip("'") for o in str(ctx.get("expected", "")).split(",")]
        options = [o for part in options for o in part.split(" or ")]
        return (f"{value!r} is not allowed; expected {ctx.get('expected')}",
                did_you_mean(value, [o.strip("'") for o in options]))
    shown = "" if isinstance(value, (dict, list)) else f" (got {value!r:.60})"
    if kind == "value_error":  # our own validators say what they got
        return error["msg"].removeprefix("Value error, "), None
    if kind == "string_type" and isinstance(value, bool):  # the "Norway problem"
        return f"{error['msg']}{shown}", ("YAML reads yes/no/on/off/true/false as "
                                          "booleans: quote the text, e.g. 'off'")
    if kind == "invalid-json-value":
        return f"{error['msg']}{shown}", ("kwargs hold plain YAML data: numbers, text, "
                                          "booleans, null, lists and mappings")
    return f"{error['msg']}{shown}", None


def _other_strategy(loc: tuple) -> str | None:
    """``strategy.cluster`` under central storage: say which kind has the key."""
    if loc[0] != "strategy" or len(loc) != 3:
        return None
    for model in (CentralStorageConfig, ParameterServerConfig):
        if loc[-1] in model.model_fields and _tag_of(model) != loc[1]:
            return f"`{loc[-1]}` is a setting of strategy kind: {_tag_of(model)}"
    return None


def _tags_at(loc: tuple, tag: str) -> list[str]:
    """The values of the discriminator ``tag`` the union at ``loc`` takes."""
    field = _field_at(loc)
    found: list[str] = []

    def walk(annotation) -> None:
        for arg in typing.get_args(annotation) or ():
            walk(arg)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and \
                tag in annotation.model_fields:
            found.extend(typing.get_args(annotation.model_fields[tag].annotation))
    if field is not None:
        walk(field.annotation)
    return [str(t) for t in found]


def _colon_hint(value) -> str | None:
    """YAML reads ``{kind:fixed}`` (no space after the colon) as one key ``kind:fixed``."""
    if isinstance(value, dict) and any(isinstance(k, str) and ":" in k for k in value):
        keys = ", ".join(str(k).replace(":", ": ", 1) for k in value)
        return f"YAML needs a space after each colon: {{{keys}}}"
    return None


def _field_at(loc: tuple):
    model = _model_at(loc[:-1])
    return model.model_fields.get(loc[-1]) if model is not None else None


def _fields_at(loc: tuple) -> list[str]:
    model = _model_at(loc)
    return list(model.model_fields) if model is not None else []


def _model_at(loc: tuple):
    """The config model class that pydantic's ``loc`` points into, or None."""
    current: Any = RunConfig
    for part in loc:
        while True:  # unwrap Annotated, Optional and unions down to what ``part`` indexes
            origin, args = typing.get_origin(current), typing.get_args(current)
            if origin is Annotated:
                current = args[0]
            elif origin is Union and sum(a is not type(None) for a in args) == 1:
                current = next(a for a in args if a is not type(None))
            else:
                break
        if isinstance(current, type) and issubclass(current, BaseModel):
            field = current.model_fields.get(part)
            current = field.annotation if field else None
        elif origin is list and isinstance(part, int):
            current = args[0]
        elif origin is dict:
            current = args[1]
        elif origin is Union:
            current = next((m for m in args if _tag_of(m) == part), None)
        else:
            current = None
        if current is None:
            return None
    while typing.get_origin(current) is Annotated:
        current = typing.get_args(current)[0]
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _tag_of(model: Any) -> str | None:
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return None
    for name in ("kind", "op"):
        field = model.model_fields.get(name)
        if field is not None:
            return typing.get_args(field.annotation)[0]
    return None


def _locate(problem: Problem, document: YamlDocument, origins: dict) -> Problem:
    """Fill in where the problem's value came from: an override that set it (or set a
    value inside it: ``model.hidden.0=...`` for a problem with ``model.hidden``), else
    ``file:line``."""
    if problem.origin or problem.line:
        return problem
    path = key_path(problem.path) if problem.path else ()
    for set_path, origin in origins.items():
        if path[:len(set_path)] == set_path:
            problem.origin = origin
            return problem
    problem.file = document.file
    problem.line = document.line_of(path)
    inside = [origin for set_path, origin in origins.items()
              if path and set_path[:len(path)] == path]
    if inside:
        problem.origin = inside[-1]
    return problem
