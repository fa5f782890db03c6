"""How the tests start the real ``csrun`` CLI as a process: its command and environment."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def csrun_command() -> list[str]:
    """The installed ``csrun`` script beside this Python (else ``python -m``)."""
    script = Path(sys.executable).with_name("csrun")
    if script.exists():
        return [str(script)]
    found = shutil.which("csrun")
    return [found] if found else [sys.executable, "-m", "csrun.cli"]


def child_env() -> dict:
    """This environment for a ``csrun`` process: ``csrun`` first on PATH (scripts call it
    by name), the repository first on PYTHONPATH (configs may name
    ``tests.helpers.injected_faults:...`` models), and no CSRUN_TRACEBACK (tests look for
    none)."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(csrun_command()[0]).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(
        os.pathsep)
    env.pop("CSRUN_TRACEBACK", None)
    return env
