"""Problems in a run configuration: what is wrong, where, and how to fix it.

Config loading never stops at the first mistake: every check appends a :class:`Problem`,
and :class:`ConfigError` carries all of them at once, so a user fixes a file in one pass.
"""

from __future__ import annotations

import dataclasses
import difflib
from typing import Iterable

__all__ = ["Problem", "ConfigError", "did_you_mean"]


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

    def __str__(self) -> str:
        text = f"{self.where}: " if self.where else ""
        text += f"{self.path}: {self.message}" if self.path else self.message
        return text + (f" (hint: {self.hint})" if self.hint else "")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class ConfigError(ValueError):
    """A config (or a command line) with problems; ``problems`` lists every one."""

    def __init__(self, problems: Iterable[Problem]):
        self.problems = list(problems)
        count = len(self.problems)
        lines = "\n".join(f"  {p}" for p in self.problems)
        super().__init__(f"{count} problem{'s' if count != 1 else ''} in the config:\n{lines}")


def did_you_mean(word: str, choices: Iterable[str]) -> str | None:
    """``"did you mean 'x'?"`` for the closest of ``choices``, else None."""
    choices = [str(c) for c in choices]
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    if not close:
        lowered = {c.lower(): c for c in choices}
        if str(word).lower() in lowered:
            close = [lowered[str(word).lower()]]
    return f"did you mean {close[0]!r}?" if close else None
