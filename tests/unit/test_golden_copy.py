"""The repository's copy of the recorded TF outputs is the shared original, byte for byte."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
COPY = REPO / "tests" / "golden" / "golden.json"
SHARED = REPO.parent / "shared" / "golden" / "golden.json"


def test_golden_copy_matches_the_shared_original():
    if not SHARED.is_file():
        pytest.skip(f"the shared original is not beside this checkout ({SHARED})")
    assert COPY.read_bytes() == SHARED.read_bytes()
