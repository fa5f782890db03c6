"""Real ``csrun`` processes for the reliability tests: the command, its environment, and
the tiny config they train."""

from __future__ import annotations

import os
from pathlib import Path

from csrun_cli import csrun_command  # noqa: F401 - the tests import it from here

HERE = Path(__file__).resolve().parent

# A tiny run for the training tests: 2 logical CPU replicas, a few steps a second.
TINY = """\
strategy: {compute_devices: [CPU:0, CPU:1], parameter_device: CPU:0}
dataset:
  source: {kind: synthetic, examples: 96, features: 6, classes: 3}
  holdout: 0.25
  steps:
    - {op: shuffle, buffer: 128}
    - {op: batch, size: 16}
model: {kind: mlp, hidden: [16]}
optimizer: {name: Adam, lr: 0.01}
train: {steps: 40, log_every: 10}
"""


def child_env() -> dict:
    """This environment, with this folder on PYTHONPATH (configs may name
    ``injected_faults:...`` models) and without CSRUN_TRACEBACK (tests look for none)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    env.pop("CSRUN_TRACEBACK", None)
    return env
