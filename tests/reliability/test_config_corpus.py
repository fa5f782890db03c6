"""A corpus of tricky configs, kept as files in ``corpus/``, each with what csrun must say.

``corpus/expected.yaml`` lists every case: the file (or a missing one), overrides, the
exit code and the problems that must be reported (path, ``file:line``, message, hint,
origin). The ``validate`` fixture checks the common rules (exit 2, no traceback, short
lines).
"""

from pathlib import Path

import pytest
import yaml

CORPUS = Path(__file__).resolve().parent / "corpus"
EXPECTED = yaml.safe_load((CORPUS / "expected.yaml").read_text(encoding="utf-8"))


def test_every_file_in_the_corpus_has_an_expectation():
    files = {p.name for p in CORPUS.iterdir()} - {"expected.yaml"}
    named = {case.get("file", name) for name, case in EXPECTED.items()}
    assert files - named == set(), "corpus files without an entry in expected.yaml"
    missing = {n for n in named - files if EXPECTED.get(n, {}).get("problems") is None
               or "not found" not in str(EXPECTED[n]["problems"])}
    assert missing == set(), "entries without a file (that are not about a missing one)"


def _matches(problem: dict, expected: dict) -> bool:
    for key, want in expected.items():
        have = problem.get(key)
        if key in ("path", "line") and have != want:
            return False
        if key not in ("path", "line") and (have is None or str(want) not in have):
            return False
    return True


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_case(name, validate, monkeypatch):
    case = EXPECTED[name] or {}
    monkeypatch.chdir(CORPUS)  # relative names, as a user types them
    outcome = validate(case.get("file", name), *case.get("overrides", []))
    assert outcome.exit_code == case.get("exit", 2), outcome.stderr
    for expected in case.get("problems", []):
        assert any(_matches(p, expected) for p in outcome.problems), \
            f"{name}: no problem like {expected} in {outcome.problems}"
    if outcome.exit_code == 2:  # the human output names each problem's place
        for problem in outcome.problems:
            assert (problem["path"] or problem["message"])[:40] in outcome.stderr
