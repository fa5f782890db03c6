"""benchmarks/torch_versions.py (issue 38): it runs the suite README's test command runs,
on the floor pyproject declares, a middle release and the newest, and prints README's
table; README's table and pyproject's floor agree with it. Nothing is installed here."""

import importlib.util
import re
from pathlib import Path

import pytest

from csrun.core.distribute import torch_internals

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("csrun_torch_versions",
                                               ROOT / "benchmarks" / "torch_versions.py")
tv = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tv)


def test_it_runs_the_default_pytest_run():
    args = tv.parse([])
    assert args.paths == ["tests"]  # pyproject's testpaths: what `python -m pytest` runs
    assert args.markers == "not slow and not process"
    assert 'testpaths = ["tests"]' in (ROOT / "pyproject.toml").read_text()


def test_the_middle_release_is_where_compiled_replicas_start():
    assert tv.release(tv.MIDDLE)[:2] == torch_internals.COMPILED_REPLICAS_SINCE
    assert tv.release(tv.pyproject_lowest()) < tv.release(tv.MIDDLE)


def test_the_table_has_a_row_per_release():
    summary = {"results": [
        {"torch": "2.4.1", "installed": "2.4.1+cu121", "numpy": "2.4.6", "passed": 10,
         "failed": 1, "errors": 0, "skipped": 2, "wall_s": 600.0, "verdict": "failed"},
        {"torch": "9.9.9", "verdict": "not set up", "reason": "no such release"}]}
    lines = tv.table(summary).splitlines()
    assert lines[2] == "| 2.4.1+cu121 | 2.4.6 | 10 | 1 | 0 | 2 | 10 min | failed |"
    assert lines[3] == "| 9.9.9 | | | | | | | not set up |"


def test_readme_shows_a_table_for_the_floor_pyproject_declares():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    floor = tv.pyproject_lowest()
    rows = re.findall(r"^\| (\d+\.\d+\.\d+)\S* \|.*\| (passed|failed) \|$", readme, re.M)
    assert rows, "README's Set up has no torch_versions.py table"
    releases = [tv.release(v) for v, _ in rows]
    assert min(releases)[:2] == tv.release(floor)[:2]
    assert dict(rows).get(min(rows, key=lambda r: tv.release(r[0]))[0]) == "passed"


@pytest.mark.parametrize("version, want", [("2.4", (2, 4)), ("2.4.0", (2, 4)),
                                           ("2.11.0+cu130", (2, 11))])
def test_release_reads_every_spelling(version, want):
    assert tv.release(version) == want
