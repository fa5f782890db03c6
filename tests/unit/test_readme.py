"""The README's promises: its snippet runs, two set-up commands, .ci/run runs the second."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_library_snippet_runs(capsys):
    snippet = re.findall(r"```python\n(.*?)```", README, re.S)[0]
    exec(compile(snippet, "README.md", "exec"), {})
    assert len(capsys.readouterr().out.splitlines()) == 5


def test_two_setup_commands_and_ci_runs_the_test_one():
    commands = [line for line in README.splitlines() if line.startswith("python3 -m venv")]
    assert len(commands) == 2
    assert commands[0].endswith("csrun train configs/quickstart.yaml")
    assert commands[1].endswith("python -m pytest")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert commands[1] in ci
    assert (ROOT / ".ci" / "run").stat().st_mode & 0o111


def test_precedence_sentence_and_exit_codes():
    assert "Precedence: **override > file > default**." in README
    for code in ("| 0 |", "| 1 |", "| 2 |", "| 130 |", "| 143 |"):
        assert code in README
