"""How output looks (round 2, item 11): at 80 columns errors wrap at word boundaries
and hints are whole (they were cut: ``…addresses in strat…``, and the terminal broke
words); without a terminal no line carries trailing spaces (rich padded the summary)."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from csrun.cli.main import app

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def test_errors_on_an_80_column_terminal_wrap_at_words_and_keep_hints_whole(tiny):
    done = CliRunner().invoke(app, ["validate", str(tiny), "strategy.kind=parameter_server"],
                              env={"COLUMNS": "80", "FORCE_COLOR": "1", "TF_CONFIG": None},
                              catch_exceptions=False)
    assert done.exit_code == 2
    lines = _ANSI.sub("", done.stderr).splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 80
    flowing = " ".join(line.strip() for line in lines)  # a broken word would show a gap
    assert "or list the tasks' host:port addresses in strategy.cluster (chief, worker, " \
           "ps)" in flowing, flowing
    assert "neither strategy.cluster, the TF_CONFIG environment variable, nor torchrun's " \
           "or Slurm's variables give one" in flowing


def test_output_without_a_terminal_has_no_trailing_spaces(tiny):
    done = CliRunner().invoke(app, ["train", str(tiny)], catch_exceptions=False)
    assert done.exit_code == 0 and "params_sha256" in done.stdout
    padded = [line for line in done.stdout.splitlines() if line != line.rstrip()]
    assert not padded, padded
