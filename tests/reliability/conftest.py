"""Fixtures of the reliability tests: bad input, faults, crashes, load, security.

The rules they hold csrun to (README, exit codes): bad input exits 2 with every problem
named (what, where, how to fix) and no traceback; a runtime failure exits 1 with a
one-line message; no fault corrupts a checkpoint. (How long a refusal takes is measured by
benchmarks/bad_configs.py.)

Fixtures:

``validate``
    ``validate(path, *overrides)`` runs ``csrun validate PATH ... --json -`` in-process and
    returns a :class:`~tests.helpers.clean_failure.Outcome` (exit code, JSON result, stderr, seconds); every call is
    checked for the rules above, timed, and counted in the summary line
    ``reliability: N bad or tricky configs checked, slowest X ms``.
``work``, ``valid_file``
    a folder for generated configs, a valid config in it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from csrun.cli.main import app
from tests.helpers.broken_configs import VALID, block_yaml
from tests.helpers.clean_failure import Outcome, Timings, check_clean_failure

_TIMINGS = Timings()


def pytest_terminal_summary(terminalreporter):
    if _TIMINGS.cases:
        terminalreporter.write_line(
            f"reliability: {_TIMINGS.cases} bad or tricky configs checked, slowest "
            f"{_TIMINGS.slowest_s * 1000:.0f} ms ({_TIMINGS.slowest[:80]})")


@pytest.fixture(scope="session")
def validate(valid_file):
    """``validate(path, *overrides)`` -> :class:`~tests.helpers.clean_failure.Outcome`,
    checked by :func:`~tests.helpers.clean_failure.check_clean_failure`."""
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
