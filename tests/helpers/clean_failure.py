"""What ``csrun validate`` did with one input, and the rules every rejected input follows.

The rules (README, exit codes): bad input exits 2 with every problem named (what, where,
how to fix) and no traceback, in a short message. Each case is timed for the summary
line; the limit on its time is benchmarks/bad_configs.py's, not a test's.
"""

from __future__ import annotations

import dataclasses

from csrun.core.config.problems import CLIP

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


def check_clean_failure(outcome: Outcome, what: str) -> None:
    """The rules every rejected input follows: exit 2, a JSON list of problems each with
    a path or a location and a message, a short human message, no traceback."""
    assert outcome.exit_code in (0, 2), f"{what}: exit {outcome.exit_code}\n{outcome.stderr}"
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
