"""How output looks (round 2, item 11): at 80 columns errors wrap at word boundaries
and hints are whole (they were cut: ``…addresses in strat…``, and the terminal broke
words); without a terminal no line carries trailing spaces (rich padded the summary); a
``COLUMNS`` of no terminal (0, huge) neither hides the output nor draws it that wide."""

from __future__ import annotations

import os
import re
import shutil
import sys

import pytest
from typer.testing import CliRunner

from csrun.cli import entry
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


TERMINAL = {"FORCE_COLOR": "1", "TTY_COMPATIBLE": "1"}


@pytest.mark.parametrize("env", [
    {"COLUMNS": "0"}, {"COLUMNS": "0", **TERMINAL}, {"COLUMNS": "3", **TERMINAL},
    {"CSRUN_COLUMNS": "0"}, {"COLUMNS": "-5"}, {"COLUMNS": "0" * 20 + "1"}],
    ids=["0", "0-terminal", "3-terminal", "task-0", "negative", "zeros"])
def test_a_width_below_the_minimum_is_taken_as_unknown(tiny, env):
    env = {"TF_CONFIG": None, "CSRUN_COLUMNS": None, **env}
    done = CliRunner().invoke(app, ["validate", "missing.yaml"], env=env,
                              catch_exceptions=False)
    assert done.exit_code == 2 and "config file 'missing.yaml' not found" in \
        _ANSI.sub("", done.stderr), done.stderr  # COLUMNS=0 hid every error
    done = CliRunner().invoke(app, ["train", str(tiny), "train.steps=2"], env=env,
                              catch_exceptions=False)
    assert done.exit_code == 0 and "params_sha256" in _ANSI.sub("", done.stdout)
    lines = _ANSI.sub("", done.stdout).splitlines()
    assert min(len(line) for line in lines if line.strip()) > 1  # not one word a line


def test_a_huge_width_is_taken_as_the_maximum(tiny):
    env = {"COLUMNS": "99999999", "TF_CONFIG": None, "CSRUN_COLUMNS": None, **TERMINAL}
    done = CliRunner().invoke(app, ["train", str(tiny), "train.steps=2"], env=env,
                              catch_exceptions=False)
    assert done.exit_code == 0
    shown = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", done.stdout)  # colours, cursor moves
    assert max(map(len, re.split(r"[\r\n]", shown))) <= 4096


def test_the_first_instants_line_fits_a_terminal_of_no_columns(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda: os.terminal_size((0, 0)))
    message = "interrupted (SIGINT) while no training step ran; nothing to save"
    assert " ".join(entry.fitted(message).split()) == message
