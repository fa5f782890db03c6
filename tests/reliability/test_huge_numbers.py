"""Huge numbers in a config (round 2, items 6 and 8).

Integers longer than Python's 4300-digit limit for ``int(str)`` in a config, an override
(value or list index) or ``TF_CONFIG``: a config problem (exit 2) at its place, not an
unexpected ``ValueError`` (exit 1). A ``repeat`` of 10**12: counted, not walked."""

from __future__ import annotations

import json

import pytest

from tests.helpers.tiny_config import TINY

BIG = "7" * 5000


def test_a_huge_integer_in_the_file_is_a_problem_at_its_line(validate, tmp_path):
    path = tmp_path / "big.yaml"
    path.write_text(TINY + f"checkpoint: {{keep: {BIG}}}\n")
    outcome = validate(path)
    assert outcome.exit_code == 2
    [problem] = outcome.problems
    assert problem["path"] == "checkpoint.keep" and problem["line"] == 11
    assert "5000 digits" in problem["message"]


@pytest.mark.parametrize("override, path, says", [
    (f"train.seed={BIG}", "train.seed", "5000 digits"),
    (f"dataset.steps.{BIG}=1", "dataset.steps", "is not an index")])
def test_a_huge_integer_in_an_override_is_a_problem_of_that_override(
        override, path, says, validate, tmp_path):
    config = tmp_path / "tiny.yaml"
    config.write_text(TINY)
    outcome = validate(config, override)
    assert outcome.exit_code == 2
    assert any(p["path"].startswith(path) and says in p["message"] and
               p["origin"] == f"override {override!r}" for p in outcome.problems)


def test_a_huge_integer_in_tf_config_is_a_problem_of_tf_config(validate, tmp_path,
                                                                monkeypatch):
    config = tmp_path / "ps.yaml"
    config.write_text(TINY.replace("strategy: {", "strategy: {kind: parameter_server, "
                                   ).replace(", parameter_device: CPU:0", ""))
    monkeypatch.setenv("TF_CONFIG", json.dumps({"cluster": {"worker": ["localhost:1"],
                                                            "ps": ["localhost:2"]}})
                       [:-1] + f', "task": {{"type": "worker", "index": {BIG}}}}}')
    outcome = validate(config)
    assert outcome.exit_code == 2
    assert any("TF_CONFIG" in p["message"] and "digits" in p["message"]
               for p in outcome.problems), outcome.problems


@pytest.mark.process
@pytest.mark.timeout(120)
def test_validate_of_a_huge_repeat_count_ends_at_once(csrun, tmp_path):
    """The plan of 10**12 repeats was walked to count its steps: validate never ended."""
    config = tmp_path / "repeat.yaml"
    config.write_text(TINY.replace("    - {op: batch", "    - {op: repeat, count: "
                                   "1000000000000}\n    - {op: batch"))
    done = csrun("validate", config, timeout=60)  # ~3 s of it importing torch
    assert done.returncode == 0, done.stderr
