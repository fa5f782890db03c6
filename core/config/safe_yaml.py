"""YAML read safely, with the line of every key so errors can point at ``file:line``.

``yaml.safe_load`` semantics (plain data only, no object construction), plus:

* the 1-based line of every mapping key and sequence item, keyed by its path tuple;
* duplicate keys reported (PyYAML keeps the last one silently);
* alias bombs ("billion laughs") rejected in bounded time: at most ``MAX_ALIASES`` alias
  uses and ``MAX_NODES`` nodes after expansion, checked before anything is constructed;
* nesting deeper than ``MAX_DEPTH`` rejected (PyYAML's composer recurses, and its scanner is
  quadratic in the flow nesting depth, so deep nesting would otherwise be a slow
  ``RecursionError``), as are self-referencing aliases (``a: &a [*a]``);
* every failure, including unreadable characters, is a :class:`ConfigError`.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from typing import Any

import yaml

from .problems import ConfigError, Problem

__all__ = ["YamlDocument", "load_yaml", "MAX_ALIASES", "MAX_NODES", "MAX_BYTES", "MAX_DEPTH"]

MAX_ALIASES = 200
MAX_NODES = 100_000
MAX_BYTES = 2_000_000
MAX_DEPTH = 64  # a config nests 5 or 6 levels; kwargs of a user model a few more

# MAX_DEPTH + 1 flow collections opened in a row: rejected before the scanner sees them
_DEEP_FLOW = re.compile(r"[\[{](?:\s*[\[{]){%d}" % MAX_DEPTH)


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
    def __init__(self, message: str, line: int | None,
                 hint: str = "write the values out instead of using aliases",
                 path: tuple = ()):
        super().__init__(message)
        self.line, self.hint, self.path = line, hint, path


class _CountingLoader(yaml.SafeLoader):
    """SafeLoader that counts alias uses and nesting while composing, to stop alias bombs
    and deep nesting early."""

    def __init__(self, stream):
        super().__init__(stream)
        self.alias_uses = 0
        self.depth = 0

    def compose_node(self, parent, index):
        mark = self.peek_event().start_mark
        if self.check_event(yaml.AliasEvent):
            self.alias_uses += 1
            if self.alias_uses > MAX_ALIASES:
                raise _TooComplex(f"more than {MAX_ALIASES} YAML aliases (*name); a config "
                                  "needs few, and many can expand exponentially",
                                  mark.line + 1)
        if self.depth >= MAX_DEPTH:
            raise _too_deep(mark.line + 1)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def _too_deep(line: int | None) -> _TooComplex:
    return _TooComplex(f"the YAML nests deeper than {MAX_DEPTH} levels", line,
                       "a config nests about 6 levels: look for unclosed brackets or a "
                       "self-referencing alias")


def _walk(node: yaml.Node, path: tuple, lines: dict, dupes: list, budget: list) -> None:
    """Record lines under ``node``; ``budget[0]`` counts nodes left after expansion.

    Aliases make the path grow without the composer nesting deeper (and a self-referencing
    one forever), so the depth is checked here too.
    """
    budget[0] -= 1
    _check_int(node, path)
    if budget[0] < 0:
        raise _TooComplex(f"the YAML expands to more than {MAX_NODES} values (alias "
                          "expansion?)", node.start_mark.line + 1)
    if len(path) > MAX_DEPTH:
        raise _too_deep(node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen = set()
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                for merged in getattr(value_node, "value", []) if isinstance(
                        value_node, yaml.SequenceNode) else [value_node]:
                    _walk(merged, path, lines, dupes, budget)
                continue
            _check_int(key_node, path)
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


def _check_int(node: yaml.Node, path: tuple) -> None:
    """Python refuses ``int()`` of more than 4300 digits with a ValueError (a guard against
    quadratic conversion); found before constructing, it is a problem at its line."""
    limit = sys.get_int_max_str_digits()
    if limit and isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:int" \
            and len(node.value) > limit:
        raise _TooComplex(f"an integer of {len(node.value)} digits; Python reads at most "
                          f"{limit}", node.start_mark.line + 1,
                          "a config needs far smaller numbers; quote it if it is text", path)


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
    deep = _DEEP_FLOW.search(text)
    if deep:
        exc = _too_deep(text.count("\n", 0, deep.start()) + 1)
        raise ConfigError([Problem("", str(exc), exc.hint, file, exc.line)])
    loader = None
    try:
        loader = _CountingLoader(text)  # its reader refuses control characters at once
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
        raise ConfigError([Problem(_dotted(exc.path), str(exc), exc.hint, file, exc.line)]) \
            from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        message = " ".join(str(s) for s in (exc.context, exc.problem) if s)
        raise ConfigError([Problem("", f"invalid YAML: {message}", _yaml_hint(exc), file,
                                   mark.line + 1 if mark else None)]) from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow
        code = ord(exc.character) if isinstance(exc.character, str) else exc.character
        raise ConfigError([Problem("", f"invalid YAML: character U+{code:04X} is not allowed",
                                   "YAML allows printable text only: no control "
                                   "characters or bytes that are not UTF-8", file,
                                   text.count("\n", 0, exc.position) + 1)]) \
            from None
    except yaml.YAMLError as exc:
        raise ConfigError([Problem("", f"invalid YAML: {exc}", None, file)]) from None
    except RecursionError:  # a last resort; the depth checks above should come first
        raise ConfigError([Problem("", "the YAML nests too deeply", None, file)]) from None
    finally:
        if loader is not None:
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
