"""Fixtures of the integration tests: real ``csrun`` processes on tiny configs."""

import os
import subprocess
from pathlib import Path

import pytest
from csrun_cli import csrun_command

REPO = Path(__file__).resolve().parents[2]

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


def child_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(csrun_command()[0]).parent}{os.pathsep}{env.get('PATH', '')}"
    env.pop("CSRUN_TRACEBACK", None)
    return env


@pytest.fixture
def csrun(tmp_path):
    """``csrun(*args, timeout=...)`` runs the real CLI in ``tmp_path``; returns the
    CompletedProcess (text stdout and stderr)."""
    def run(*args, timeout=300, cwd=tmp_path):
        return subprocess.run(csrun_command() + [str(a) for a in args], cwd=cwd,
                              env=child_env(), capture_output=True, text=True,
                              timeout=timeout)
    return run


@pytest.fixture
def spawn(tmp_path):
    """``spawn(*args)`` starts the real CLI in ``tmp_path`` without waiting (a Popen)."""
    def start(*args, cwd=tmp_path):
        return subprocess.Popen(csrun_command() + [str(a) for a in args], cwd=cwd,
                                env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    return start


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
