"""``key=value`` overrides: dotted paths into the config, values parsed as YAML.

Precedence: **override > file > default**. List items are addressed by index; an index
one past the end appends.
"""

from __future__ import annotations

from typing import Any, Sequence

from .problems import ConfigError, Problem, printable
from .safe_yaml import load_yaml

__all__ = ["parse_override", "apply_overrides", "key_path"]


def parse_override(text: str) -> tuple[tuple, Any]:
    """Split ``"a.b.0=value"`` into the key path ``("a", "b", 0)`` and the YAML value.

    Raises:
      ConfigError: no ``=``, an empty key part, or a value that is not valid YAML.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError([Problem("", f"override {text!r} is not key=value",
                                   "write e.g. train.steps=100 or "
                                   "strategy.compute_devices=[CPU:0,CPU:1]",
                                   origin=f"override {text!r}")])
    path = key_path(key)
    try:
        value = load_yaml(raw, f"override {text!r}").data
    except ConfigError as exc:
        for problem in exc.problems:
            problem.path, problem.origin = key, f"override {text!r}"
        raise
    return path, value


def key_path(dotted: str) -> tuple:
    """``"a.b.0"`` -> ``("a", "b", 0)``; only ASCII digits make an index (``"²"`` has
    ``isdigit()`` but is no number), and at most 18 of them: ``int()`` of thousands
    raises, and no list is that long (the key stays text: "not an index")."""
    return tuple(int(p) if p.isascii() and p.isdigit() and len(p) <= 18 else p
                 for p in dotted.split("."))


# Keys of which a config gives one: an override of one replaces the file's other, as
# override > file says (`train.steps=50` over a file with `epochs`).
EXCLUSIVE = {("train", "steps"): ("train", "epochs"), ("train", "epochs"): ("train", "steps")}


def apply_overrides(data: dict, overrides: Sequence[str], origins: dict) -> list[Problem]:
    """Set each override in ``data``; ``origins`` maps each set path to its text."""
    problems = _apply(data, overrides, origins)
    for path, partner in EXCLUSIVE.items():
        if path in origins and partner not in origins:  # both overridden: still refused
            section = data.get(partner[0])
            if isinstance(section, dict):
                section.pop(partner[1], None)
    return problems


def _apply(data: dict, overrides: Sequence[str], origins: dict) -> list[Problem]:
    problems = []
    for text in overrides:
        try:
            path, value = parse_override(text)
            _set_path(data, path, value)
        except ConfigError as exc:
            for problem in exc.problems:
                problem.origin = problem.origin or f"override {text!r}"
            problems += exc.problems
            continue
        origins[path] = f"override {text!r}"
    return problems


def _set_path(data: dict, path: tuple, value: Any) -> None:
    node: Any = data
    for depth, part in enumerate(path):
        last = depth == len(path) - 1
        where = printable(".".join(str(p) for p in path[:depth])) or "the config"
        if isinstance(node, list) and not isinstance(part, int):
            raise _override_error(path, f"{where} is a list; {part!r} is not an index",
                                  f"address its items by number, 0..{len(node)} "
                                  f"({len(node)} appends)")
        if isinstance(node, list):
            if part > len(node):
                raise _override_error(path, f"{where} has {len(node)} items; index {part} "
                                      "is past the end", f"use 0..{len(node)} ({len(node)} "
                                      "appends)")
            if part == len(node):
                node.append({} if not last else None)
        elif isinstance(node, dict):
            if not last and not isinstance(node.get(part), (dict, list)):
                node[part] = {}
        else:
            raise _override_error(path, f"{where} is a value ({node!r:.40}), not a section "
                                  "or list", None)
        if last:
            node[part] = value
        else:
            node = node[part]


def _override_error(path: tuple, message: str, hint: str | None) -> ConfigError:
    key = ".".join(str(p) for p in path)
    return ConfigError([Problem(key, message, hint)])
