"""docs/tf-parity.md says what it can show: every row but the n/a ones names its evidence,
and the evidence exists (issue 24).

Evidence is written in backticks in a row: a golden case id (or a pattern such as
``props_*``) recorded from TF 2.21, or a test as ``file.py::test_name`` (any test file of
tests/, found by its name). A row "same" without either is a claim nothing checks.
"""

from __future__ import annotations

import ast
import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "tf-parity.md"
TEST_REF = re.compile(r"^(test_\w+\.py)(?:::(test_\w+))?$")
GOLDEN_LIKE = re.compile(r"^[A-Za-z0-9_]*\*[A-Za-z0-9_*]*$")


def rows(text: str) -> list[tuple[int, str, str]]:
    """``(line, status, row)`` of every table row that is not a header or a rule."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) < 3 or set(cells[0]) <= {"-"}:
            continue
        if cells[1] == "status":
            continue
        found.append((number, cells[1].replace("*", "").strip(), line))
    return found


def _tests_in(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {node.name for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.name.startswith("test_")}


def problems(text: str, golden_ids: set[str], tests_root: Path) -> list[str]:
    """What is wrong with the parity rows of ``text``: rows without evidence, test
    references and golden patterns that point at nothing."""
    files = {p.name: p for p in tests_root.rglob("test_*.py")}
    found = []
    for line, status, row in rows(text):
        evidence = 0
        for token in re.findall(r"`([^`]+)`", row):
            ref = TEST_REF.match(token)
            if ref:
                path = files.get(ref.group(1))
                if path is None:
                    found.append(f"line {line}: no test file {ref.group(1)}")
                elif ref.group(2) and ref.group(2) not in _tests_in(path):
                    found.append(f"line {line}: {ref.group(1)} has no {ref.group(2)}")
                else:
                    evidence += 1
            elif token in golden_ids:
                evidence += 1
            elif GOLDEN_LIKE.match(token) and not token.startswith("*"):
                if fnmatch.filter(golden_ids, token):
                    evidence += 1
                else:
                    found.append(f"line {line}: no golden case matches {token}")
        if status != "n/a" and not evidence:
            found.append(f"line {line}: a '{status}' row names no golden case or test: "
                         f"{row[:80]}")
    return found


def test_every_parity_row_names_evidence_that_exists(golden):
    ids = {cid for cid in golden if cid != "__meta__"}
    found = problems(DOC.read_text(), ids, ROOT / "tests")
    assert not found, "docs/tf-parity.md:\n" + "\n".join(found)
    statuses = {status for _, status, _ in rows(DOC.read_text())}
    assert {"same", "deviates", "n/a"} <= statuses  # the table was read at all


def test_the_check_finds_rows_without_evidence_and_evidence_that_is_not_there(tmp_path):
    (tmp_path / "test_here.py").write_text("def test_real():\n    pass\n")
    doc = "\n".join([
        "| API | status | notes |",
        "|---|---|---|",
        "| a | same | pinned (`case_one`, `test_here.py::test_real`) |",
        "| b | same | claimed, nothing named |",
        "| c | **deviates** | (`test_here.py::test_gone`, `test_nowhere.py`) |",
        "| d | same | (`case_*`, `other_*`) |",
        "| e | n/a | no graph in eager |",
    ])
    assert problems(doc, {"case_one"}, tmp_path) == [
        "line 4: a 'same' row names no golden case or test: | b | same | claimed, "
        "nothing named |",
        "line 5: test_here.py has no test_gone",
        "line 5: no test file test_nowhere.py",
        "line 5: a 'deviates' row names no golden case or test: | c | **deviates** | "
        "(`test_here.py::test_gone`, `test_nowhere.py`) |",
        "line 6: no golden case matches other_*",
    ]
