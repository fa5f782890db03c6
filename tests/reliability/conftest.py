"""Fixtures of the reliability tests: bad input, faults, crashes, load, security.

The rules they hold csrun to (README, exit codes): bad input exits 2 with every problem
named (what, where, how to fix) and no traceback, in bounded time; a runtime failure exits
1 with a one-line message; no fault corrupts a checkpoint.

Fixtures:

``validate``
    ``validate(path, *overrides)`` runs ``csrun validate PATH ... --json -`` in-process and
    returns a :class:`Outcome` (exit code, JSON result, stderr, seconds); every call is
    checked for the rules above, timed, and counted in the summary line
    ``reliability: N bad or tricky configs checked, slowest X ms``.
``csrun``, ``spawn``
    a real ``csrun`` process (waited for, or a Popen), in ``tmp_path``, with this folder on
    ``PYTHONPATH`` so that configs can name ``injected_faults:...`` models.
``work``, ``valid_file``, ``tiny``
    a folder for generated configs, a valid config in it, a tiny trainable config.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from broken_configs import VALID, block_yaml
from csrun_processes import TINY, child_env, csrun_command
from csrun.cli.main import app
from csrun.core.config.problems import CLIP

CASE_LIMIT_S = 10.0  # the bound on one bad config; measured cases take well under 1 s
# "A short message": each part of a problem is clipped (CLIP), so no line of the error
# output is longer than this, however long the input it echoes
LINE_LIMIT = 2 + CLIP["where"] + 2 + CLIP["path"] + 2 + CLIP["message"]


@dataclasses.dataclass
class Outcome:
    """What one ``csrun validate`` did."""

    exit_code: int
    result: dict | None
    stderr: str
    seconds: float

    @property
    def problems(self) -> list[dict]:
        return (self.result or {}).get("problems", [])


@dataclasses.dataclass
class Timings:
    """How many configs a session checked, and the slowest."""

    cases: int = 0
    slowest_s: float = 0.0
    slowest: str = ""

    def add(self, seconds: float, what: str) -> None:
        self.cases += 1
        if seconds > self.slowest_s:
            self.slowest_s, self.slowest = seconds, what


_TIMINGS = Timings()


def pytest_terminal_summary(terminalreporter):
    if _TIMINGS.cases:
        terminalreporter.write_line(
            f"reliability: {_TIMINGS.cases} bad or tricky configs checked, slowest "
            f"{_TIMINGS.slowest_s * 1000:.0f} ms ({_TIMINGS.slowest[:80]})")


def check_clean_failure(outcome: Outcome, what: str) -> None:
    """The rules every rejected input follows: exit 2, a JSON list of problems each with
    a path or a location and a message, a short human message, no traceback, in time."""
    assert outcome.exit_code in (0, 2), f"{what}: exit {outcome.exit_code}\n{outcome.stderr}"
    assert outcome.seconds < CASE_LIMIT_S, f"{what}: took {outcome.seconds:.1f} s"
    assert "Traceback (most recent call last)" not in outcome.stderr
    assert "set CSRUN_TRACEBACK=1" not in outcome.stderr, outcome.stderr  # an unexpected error
    if outcome.exit_code == 0:
        assert outcome.result["status"] == "valid"
        return
    assert outcome.result["status"] == "invalid" and outcome.problems, what
    for problem in outcome.problems:
        # where: a dotted path, file:line or the override; for a file that cannot be
        # read, the message names it
        assert problem["message"], problem
        assert problem["path"] or problem["file"] or problem["origin"] or \
            "file" in problem["message"], problem
    lines = outcome.stderr.splitlines()
    assert lines[0].startswith("error: ") and "problem" in lines[0], outcome.stderr
    assert max(map(len, lines)) <= LINE_LIMIT, f"{what}: a long line\n{outcome.stderr}"


@pytest.fixture(scope="session")
def validate(valid_file):
    """``validate(path, *overrides)`` -> :class:`Outcome`, checked by
    :func:`check_clean_failure`."""
    runner = CliRunner()
    # the first validation loads torch's optimizers, the meta device, ... (seconds): not
    # a case's own time
    assert runner.invoke(app, ["validate", str(valid_file)]).exit_code == 0

    def run(path, *overrides) -> Outcome:
        begin = time.perf_counter()
        # "--": whatever an override looks like ("-0", "--json"), it stays an override
        done = runner.invoke(app, ["validate", str(path), "--json", "-", "--", *overrides],
                             catch_exceptions=False)
        seconds = time.perf_counter() - begin
        outcome = Outcome(done.exit_code, json.loads(done.stdout) if done.stdout else None,
                          done.stderr, seconds)
        what = f"{path} {' '.join(overrides)}"
        _TIMINGS.add(seconds, what)
        check_clean_failure(outcome, what)
        return outcome
    return run


@pytest.fixture(scope="session")
def work(tmp_path_factory) -> Path:
    """A folder for the generated configs (one per session: hypothesis runs many examples
    per test)."""
    return tmp_path_factory.mktemp("configs")


@pytest.fixture(scope="session")
def valid_file(work) -> Path:
    path = work / "valid.yaml"
    path.write_text(block_yaml(VALID), encoding="utf-8")
    return path


# -- real processes ------------------------------------------------------------------------
@pytest.fixture
def csrun(tmp_path):
    """``csrun(*args, timeout=...)`` runs the real CLI in ``tmp_path`` and waits."""
    def run(*args, timeout=300, command=None, env=None):
        args = [a if isinstance(a, bytes) else str(a) for a in args]  # bytes: as they are
        return subprocess.run((command or csrun_command()) + args,
                              cwd=tmp_path, env={**child_env(), **(env or {})},
                              capture_output=True, text=True, timeout=timeout)
    return run


@pytest.fixture
def spawn(tmp_path):
    """``spawn(*args)`` starts the real CLI in ``tmp_path`` (a Popen)."""
    started = []

    def start(*args, command=None, env=None):
        process = subprocess.Popen((command or csrun_command()) + [str(a) for a in args],
                                   cwd=tmp_path, env={**child_env(), **(env or {})},
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(process)
        return process
    yield start
    for process in started:  # a failed test must not leave a training process behind
        if process.poll() is None:
            process.kill()
        process.communicate()


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path
