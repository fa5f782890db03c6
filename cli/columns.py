"""The widths csrun takes from a terminal or ``COLUMNS`` (standard library only: the
entry point uses them before rich is loaded, :mod:`csrun.cli.render` after).

A width outside these is no terminal's: ``COLUMNS=0`` made rich print nothing at all
(every error hidden), and a huge one would draw a progress bar that wide. Below the
minimum a width is taken as unknown, above the maximum as the maximum.
"""

__all__ = ["MIN_COLUMNS", "MAX_COLUMNS"]

MIN_COLUMNS, MAX_COLUMNS = 20, 4096
