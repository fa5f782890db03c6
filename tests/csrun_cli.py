"""How the test-suite starts a real ``csrun`` process (shared by the integration and the
reliability tests; ``tests/`` is on ``sys.path`` through its conftest)."""

import shutil
import sys
from pathlib import Path


def csrun_command() -> list[str]:
    """The installed ``csrun`` script beside this Python (else ``python -m``)."""
    script = Path(sys.executable).with_name("csrun")
    if script.exists():
        return [str(script)]
    found = shutil.which("csrun")
    return [found] if found else [sys.executable, "-m", "csrun.cli"]
