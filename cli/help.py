"""How ``csrun --help`` and ``csrun COMMAND --help`` read.

Typer's plain help marks a required argument ``{CONFIG}`` in the usage line and lists
arguments with their Python types (``CONFIG <str>``, ``KEY=VALUE <list[str]>``), which
mean nothing on a command line; here they read as in any Unix tool: ``CONFIG
[KEY=VALUE]...``. Options are Typer's own. Lines break only at spaces, never at a word's
hyphen (``parameter-|server``), as everything else csrun prints (:mod:`csrun.cli.lines`).
"""

from __future__ import annotations

import re

import typer.core

__all__ = ["Command", "Group"]

_HYPHEN, _UNBROKEN = re.compile(r"(?<=\w)-(?=\w)"), "\u2011"  # a non-breaking hyphen


class _WholeWords:
    """click wraps help text with Python's textwrap, which breaks at hyphens: while it
    wraps, a word's hyphens are non-breaking ones (as wide), made plain again after."""

    def format_help(self, ctx, formatter) -> None:
        write_text, write_dl = formatter.write_text, formatter.write_dl
        formatter.write_text = lambda text: write_text(_HYPHEN.sub(_UNBROKEN, text))
        formatter.write_dl = lambda rows, *args, **kwargs: write_dl(
            [tuple(_HYPHEN.sub(_UNBROKEN, cell) for cell in row) for row in rows],
            *args, **kwargs)
        super().format_help(ctx, formatter)
        formatter.buffer[:] = [text.replace(_UNBROKEN, "-") for text in formatter.buffer]


class Group(_WholeWords, typer.core.TyperGroup):
    """The ``csrun`` command group, its help in whole words."""


class Command(_WholeWords, typer.core.TyperCommand):
    """A Typer command whose help names arguments by their metavar alone."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        return pieces + [_usage(p) for p in self.get_params(ctx)
                         if p.param_type_name == "argument"]

    def format_options(self, ctx, formatter) -> None:
        rows = {"argument": [], "option": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None or param.param_type_name not in rows:
                continue
            name = _name(param) if param.param_type_name == "argument" else record[0]
            rows[param.param_type_name].append((name, record[1]))
        for title, kind in (("Arguments", "argument"), ("Options", "option")):
            if rows[kind]:
                with formatter.section(title):
                    formatter.write_dl(rows[kind])


def _name(param) -> str:
    """``CONFIG``; ``KEY=VALUE...`` for one taking many values."""
    return (param.metavar or param.name.upper()) + ("..." if param.nargs != 1 else "")


def _usage(param) -> str:
    return _name(param) if param.required else f"[{param.metavar or param.name.upper()}]" + \
        ("..." if param.nargs != 1 else "")
