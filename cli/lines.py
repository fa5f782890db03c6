"""How the CLI's text becomes lines: on a terminal, lines that fit its width and break
only between words; elsewhere (CI logs, pipes, files), one line per message, for grep.

A terminal breaks a line that is too long wherever its width ends (``TF_C|ONFIG``), and
rich's own wrapping knows neither hanging indents nor phrases that must stay whole
(``(continue with --resume)``), hence this module. A word longer than a whole line is the
only thing cut, after a ``/`` when it is a path.
"""

from __future__ import annotations

import re

from rich.cells import cell_len
from rich.console import Console
from rich.text import Text

__all__ = ["keep", "wrap", "say", "fits"]

_NBSP = "\xa0"  # a space no line breaks at (shown as a space)
_WORD = re.compile(r"[^ ]+")


def keep(text: str) -> str:
    """``text`` as one unit that a line never breaks inside (when it fits a line)."""
    return text.replace(" ", _NBSP)


def wrap(text: Text, width: int, indent: int = 0, hang: int = 2) -> list[Text]:
    """``text`` in lines of at most ``width`` cells broken at spaces: the first line
    indented by ``indent``, the next ones by ``indent + hang``.

    Example::

        wrap(Text("error: a b c"), 9, hang=2)  # ["error: a", "  b c"]
    """
    plain = text.plain

    def room(line: int) -> int:
        return max(1, width - indent - (hang if line else 0))

    spans: list[list[int]] = []  # [start, end] of each line in ``plain``
    for match in _WORD.finditer(plain):
        start, end = match.span()
        if spans and cell_len(plain[spans[-1][0]:end]) <= room(len(spans) - 1):
            spans[-1][1] = end
            continue
        while cell_len(plain[start:end]) > room(len(spans)):
            cut = _cut(plain, start, end, room(len(spans)))
            spans.append([start, cut])
            start = cut
        spans.append([start, end])
    lines = []
    for n, (start, end) in enumerate(spans or [[0, 0]]):
        line = Text(" " * (indent + (hang if n else 0))) + text[start:end]
        line.plain = line.plain.replace(_NBSP, " ")  # same length: the styles stay
        lines.append(line)
    return lines


def _cut(plain: str, start: int, end: int, room: int) -> int:
    """Where to cut a word too long for a line: after its last ``/`` that fits, else
    at the line's end."""
    stop, used = start, 0
    while stop < end and used + cell_len(plain[stop]) <= room:
        used += cell_len(plain[stop])
        stop += 1
    slash = plain.rfind("/", start, stop)
    return slash + 1 if slash >= start and slash + 1 < stop else max(stop, start + 1)


def fits(console: Console) -> bool:
    """Whether lines are fitted to ``console``'s width: on a terminal, or when its file
    asks for it (``fitted``: the output of a ``csrun launch`` task)."""
    return console.is_terminal or getattr(console.file, "fitted", False)


def say(console: Console, text: str | Text, indent: int = 0, hang: int = 2,
        style: str = "") -> None:
    """Print ``text`` (rich markup, or a Text) wrapped to the console's width when lines
    are fitted (:func:`fits`), else on one line."""
    if isinstance(text, str):
        text = Text.from_markup(text, style=style)
    elif style:
        text = Text.assemble(text, style=style)
    if not fits(console):
        line = Text(" " * indent) + text
        line.plain = line.plain.replace(_NBSP, " ")
        console.print(line, soft_wrap=True)
        return
    for line in wrap(text, console.width, indent, hang):
        console.print(line, soft_wrap=True)
