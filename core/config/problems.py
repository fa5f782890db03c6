"""Problems in a run configuration: what is wrong, where, and how to fix it.

Config loading never stops at the first mistake: every check appends a :class:`Problem`,
and :class:`ConfigError` carries all of them at once, so a user fixes a file in one pass.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Iterable

__all__ = ["Problem", "ConfigError", "ConfigNotice", "did_you_mean", "closest", "clipped",
           "printable"]

# How much of a user's text a message echoes: a 3000-character override or key must not
# make a 3000-character error. Far above what csrun writes itself (a long path, a
# user's exception): those are shown whole, wrapped on a terminal (csrun.cli.lines).
# Hints are csrun's own advice; the limit only stops one that lists user input.
CLIP = {"where": 400, "path": 200, "message": 1000, "hint": 1000}


def clipped(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, ending in ``…`` when it was longer."""
    return text if len(text) <= limit else text[:limit - 1] + "…"


def printable(text: str, keep: str = "") -> str:
    """``text`` with each character a terminal would act on written as Python's ``repr``
    writes it, the rule values are echoed by (``{value!r}``): ESC, CR and BEL as ``\\x1b``,
    ``\\r``, ``\\x07``, a bidi override as ``\\u202e``. A key, a path or a name the user
    wrote then cannot set the terminal's title, clear it or reorder what follows.

    Args:
      keep: characters left as they are (``"\\n\\t"`` for a message of several lines).

    Example: ``printable("st\\x1b[2Jeps")`` is ``"st\\\\x1b[2Jeps"``.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c in keep else repr(c)[1:-1] for c in text)


@dataclasses.dataclass
class Problem:
    """One thing wrong with a config.

    Attributes:
      path: the dotted config path (``train.steps``, ``dataset.steps.1.size``); ``""`` for
        the whole file.
      message: what is wrong.
      hint: how to fix it (a did-you-mean, the available devices, ...), or None.
      file: the YAML file the value came from, or None.
      line: its 1-based line in ``file``, or None.
      origin: where else the value came from (``"override train.steps=x"``), or None.
    """

    path: str
    message: str
    hint: str | None = None
    file: str | None = None
    line: int | None = None
    origin: str | None = None

    @property
    def where(self) -> str:
        """``file:line`` (or the override) the problem points at, ``""`` if unknown."""
        if self.origin:
            return self.origin
        if self.file and self.line:
            return f"{self.file}:{self.line}"
        return self.file or ""

    def shown(self) -> dict[str, str]:
        """``where``, ``path``, ``message`` and ``hint`` as a person reads them: each
        character a terminal would act on escaped (:func:`printable`; a message keeps its
        line breaks), then clipped to :data:`CLIP` (the JSON result keeps them whole)."""
        return {name: clipped(printable(getattr(self, name) or "",
                                        "\n\t" if name == "message" else ""), limit)
                for name, limit in CLIP.items()}

    def __str__(self) -> str:
        shown = self.shown()
        text = f"{shown['where']}: " if shown["where"] else ""
        text += f"{shown['path']}: {shown['message']}" if shown["path"] else shown["message"]
        return text + (f" (hint: {shown['hint']})" if shown["hint"] else "")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    """A config (or a command line) with problems; ``problems`` lists every one."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        count = len(self.problems)
        lines = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{count} problem{'s' if count != 1 else ''} in the config:\n{lines}")


class ConfigNotice(UserWarning):
    """Something a check could not do as usual but that is no problem (e.g. a model
    checked on CPU because the meta device cannot run it); warned, shown by the CLI."""


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """``"did you mean 'x'?"`` for the closest of ``choices``, else None."""
    best = closest(word, choices)
    return f"did you mean {best!r}?" if best is not None else None


def closest(word: str, choices: Iterable[str]) -> str | None:
    """The choice closest to ``word``, or None when none is close.

    Closest by edit distance counting a swap of neighbours as one edit (``Adma`` ->
    ``Adam``), ignoring case; difflib's similarity breaks ties and catches the rest.
    """
    word, choices = str(word), [str(c) for c in choices]
    if not choices:
        return None
    scored = sorted(choices, key=lambda c: (_edits(word.lower(), c.lower()),
                                            -difflib.SequenceMatcher(None, word, c).ratio()))
    best = scored[0]
    if _edits(word.lower(), best.lower()) <= max(1, len(word) // 3):
        return best
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return close[0] if close else None


def _edits(a: str, b: str) -> int:
    """Optimal-string-alignment distance (insert, delete, substitute, swap neighbours)."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        current = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                current[j] = min(current[j], previous2[j - 2] + 1)
        previous2, previous = previous, current
    return previous[len(b)]
