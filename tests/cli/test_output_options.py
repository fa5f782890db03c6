"""``train``'s output options as a user meets them (issue 27): a problem with an option is
the command line's, not the config's; the summary says where each file went."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from rich.console import Console

from csrun.cli.render import View
from csrun.core.config.problems import ConfigError, Problem


def test_plot_without_matplotlib_is_a_command_line_problem(cli, tiny, monkeypatch):
    monkeypatch.setattr("csrun.core.runner.preflight.outputs.plot_available", lambda: False)
    result = cli("train", tiny, "--plot", "loss.png")
    assert result.exit_code == 2
    assert result.stderr.startswith("error: 1 problem with the command line (nothing ran)")
    assert "--plot: needs matplotlib" in result.stderr
    assert "in the config" not in result.stderr


def test_the_summary_counts_problems_where_they_are():
    shown = {}
    for name, problems in {
        "config": [Problem("train.steps", "x"), Problem("model.kind", "y")],
        "options": [Problem("--json", "x")],
        "both": [Problem("train.steps", "x"), Problem("--plot", "y"), Problem("--json", "z")],
    }.items():
        view = View()
        view.err = Console(file=io.StringIO(), width=200)
        view.problems(ConfigError(problems))
        shown[name] = view.err.file.getvalue().splitlines()[0]
    assert shown == {
        "config": "error: 2 problems in the config (nothing ran)",
        "options": "error: 1 problem with the command line (nothing ran)",
        "both": "error: 3 problems: 1 in the config, 2 with the command line (nothing ran)"}


def test_the_summary_says_where_the_plot_and_metrics_went(cli, tiny, tmp_path,
                                                          monkeypatch):
    drawn = []
    monkeypatch.setattr("csrun.core.runner.preflight.outputs.plot_available", lambda: True)
    monkeypatch.setattr("csrun.core.runner.session.write_plot",
                        lambda path, *args: drawn.append(path))
    plot, metrics = tmp_path / "loss.png", tmp_path / "m.jsonl"
    result = cli("train", tiny, "--plot", plot, "--metrics", metrics)
    assert result.exit_code == 0, result.stderr
    assert drawn == [str(plot)]
    lines = result.stdout.splitlines()
    assert f"plot           {plot}" in lines and f"metrics        {metrics}" in lines


@pytest.mark.process
def test_a_reader_that_goes_away_is_no_user_code_failure():
    """``csrun inspect-devices | head -1``: rich ends the process when stdout closes."""
    env = {**os.environ, "CSRUN_LOGICAL_CPUS": "1000"}  # more output than a pipe holds
    process = subprocess.Popen([sys.executable, "-m", "csrun.cli", "inspect-devices"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert process.stdout.readline().strip() == b"local devices"
    process.stdout.close()
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 1 and b"error" not in stderr, stderr
