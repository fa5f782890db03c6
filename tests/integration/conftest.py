"""Fixtures of the integration tests: real ``csrun`` processes on tiny configs."""

import subprocess

import pytest

from tests.helpers.cli import child_env
from tests.helpers.tiny_config import tiny_config

# 2 epochs, with dropout
TINY = tiny_config("dataset.source.examples=128", "dataset.steps.0.buffer=256",
                   "model.dropout=0.1", "train={epochs: 2, log_every: 4}")


@pytest.fixture
def shell(tmp_path):
    """``shell(script, *args)`` runs a bash script in ``tmp_path`` with csrun on PATH."""
    def run(script, *args, timeout=300):
        return subprocess.run(["bash", str(script), *map(str, args)], cwd=tmp_path,
                              env=child_env(), capture_output=True, text=True,
                              timeout=timeout)
    return run


@pytest.fixture
def tiny(tmp_path):
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path
