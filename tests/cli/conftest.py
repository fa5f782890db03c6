"""Fixtures of the CLI tests: Typer's CliRunner and tiny configs on disk."""

import pytest
from typer.testing import CliRunner

from csrun.cli.main import app

TINY = """\
# A tiny run for tests: 2 logical CPU replicas, a few steps.
strategy: {compute_devices: [CPU:0, CPU:1]}
dataset:
  source: {kind: synthetic, examples: 96, features: 4, classes: 3}
  holdout: 0.25
  steps:
    - {op: shuffle, buffer: 128}
    - {op: batch, size: 16}
model: {kind: mlp, hidden: [8]}
optimizer: {name: SGD, lr: 0.1}
train: {steps: 6, log_every: 3}
"""


@pytest.fixture
def cli():
    """``cli(*args)`` -> the CliRunner result of ``csrun *args`` (stdout, stderr apart)."""
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)
    return invoke


@pytest.fixture
def tiny(tmp_path):
    """Path of a tiny valid config."""
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY)
    return path
