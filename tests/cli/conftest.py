"""Fixtures of the CLI tests: Typer's CliRunner and tiny configs on disk."""

import pytest
from typer.testing import CliRunner

from csrun.cli.main import app
from tests.helpers.tiny_config import tiny_config

# 2 logical CPU replicas, 6 steps
TINY = tiny_config("~strategy.parameter_device", "dataset.source.features=4",
                   "model.hidden=[8]", "optimizer={name: SGD, lr: 0.1}",
                   "train={steps: 6, log_every: 3}")


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
