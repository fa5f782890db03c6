"""Fixtures of the integration tests: real ``csrun`` processes on tiny configs."""

import subprocess

import pytest

from tests.helpers.cli import child_env

TINY = """\
# A tiny run for tests: 2 logical CPU replicas.
strategy: {compute_devices: [CPU:0, CPU:1], parameter_device: CPU:0}
dataset:
  source: {kind: synthetic, examples: 128, features: 6, classes: 3}
  holdout: 0.25
  steps:
    - {op: shuffle, buffer: 256}
    - {op: batch, size: 16}
model: {kind: mlp, hidden: [16], dropout: 0.1}
optimizer: {name: Adam, lr: 0.01}
train: {epochs: 2, log_every: 4}
"""


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
