"""YAML read safely, with the line of every key so errors can point at ``file:line``.

``yaml.safe_load`` semantics (plain data only, no object construction), plus:

* the 1-based line of every mapping key and sequence item, keyed by its path tuple;
* duplicate keys reported (PyYAML keeps the last one silently);
* alias bombs ("billion laughs") rejected in bounded time: at most ``MAX_ALIASES`` alias
  uses and ``MAX_NODES`` nodes after expansion, checked before anything is constructed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from .problems import ConfigError, Problem

__all__ = ["YamlDocument", "load_yaml", "MAX_ALIASES", "MAX_NODES", "MAX_BYTES"]

MAX_ALIASES = 200
MAX_NODES = 100_000
MAX_BYTES = 2_000_000


@dataclasses.dataclass
class YamlDocument:
    """Parsed YAML: ``data`` and ``lines`` (path tuple -> 1-based line) from ``file``."""

    data: Any
    lines: dict
    file: str | None = None

    def line_of(self, path: tuple) -> int | None:
        """The line of ``path`` or of its nearest ancestor that the file has."""
        path = tuple(path)
        while path:
            if path in self.lines:
                return self.lines[path]
            path = path[:-1]
        return self.lines.get((), None)


class _TooComplex(Exception):
    def __init__(self, message: str, line: int | None):
        super().__init__(message)
        self.line = line


class _CountingLoader(yaml.SafeLoader):
    """SafeLoader that counts alias uses while composing, to stop alias bombs early."""

    def __init__(self, stream):
        super().__init__(stream)
        self.alias_uses = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self.alias_uses += 1
            if self.alias_uses > MAX_ALIASES:
                mark = self.peek_event().start_mark
                raise _TooComplex(f"more than {MAX_ALIASES} YAML aliases (*name); a config "
                                  "needs few, and many can expand exponentially",
                                  mark.line + 1)
        return super().compose_node(parent, index)


def _walk(node: yaml.Node, path: tuple, lines: dict, dupes: list, budget: list) -> None:
    """Record lines under ``node``; ``budget[0]`` counts nodes left after expansion."""
    budget[0] -= 1
    if budget[0] < 0:
        raise _TooComplex(f"the YAML expands to more than {MAX_NODES} values (alias "
                          "expansion?)", node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                for merged in getattr(value_node, "value", []) if isinstance(
                        value_node, yaml.SequenceNode) else [value_node]:
                    _walk(merged, path, lines, dupes, budget)
                continue
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node)
            if key in seen:
                dupes.append((path + (key,), key_node.start_mark.line + 1))
            seen.add(key)
            lines[path + (key,)] = key_node.start_mark.line + 1
            _walk(value_node, path + (key,), lines, dupes, budget)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            lines[path + (i,)] = item.start_mark.line + 1
            _walk(item, path + (i,), lines, dupes, budget)


def _dotted(path: tuple) -> str:
    return ".".join(str(p) for p in path)


def load_yaml(text: str, file: str | None = None) -> YamlDocument:
    """Parse one YAML document safely.

    Raises:
      ConfigError: invalid YAML, duplicate keys, or an alias bomb -- with file:line.
    """
    if len(text.encode("utf-8", "replace")) > MAX_BYTES:
        raise ConfigError([Problem("", f"the file is larger than {MAX_BYTES} bytes; a "
                                       "config is a few kilobytes", file=file)])
    loader = _CountingLoader(text)
    try:
        node = loader.get_single_node()
        lines: dict = {(): 1}
        dupes: list = []
        if node is not None:
            _walk(node, (), lines, dupes, [MAX_NODES])
        if dupes:
            raise ConfigError([Problem(_dotted(p), "duplicate key (YAML would keep only the "
                                       "last one)", "remove one of them", file, line)
                               for p, line in dupes])
        data = loader.construct_document(node) if node is not None else None
    except _TooComplex as exc:
        raise ConfigError([Problem("", str(exc), "write the values out instead of using "
                                   "aliases", file, exc.line)]) from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = " ".join(str(s) for s in (exc.context, exc.problem) if s)
        raise ConfigError([Problem("", f"invalid YAML: {message}", _yaml_hint(exc), file,
                                   mark.line + 1 if mark else None)]) from None
    except yaml.YAMLError as exc:
        raise ConfigError([Problem("", f"invalid YAML: {exc}", None, file)]) from None
    finally:
        loader.dispose()
    return YamlDocument(data, lines, file)


def _yaml_hint(exc: yaml.MarkedYAMLError) -> str | None:
    problem = str(exc.problem or "")
    if "could not determine a constructor" in problem:
        return "csrun reads plain YAML only (no !!python tags)"
    if "mapping values are not allowed" in problem:
        return "a value containing ': ' needs quotes"
    if "found character '\\t'" in problem:
        return "indent with spaces, not tabs"
    return None
