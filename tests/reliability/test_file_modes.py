"""Every file csrun writes follows the umask (0666 less it, directories 0777 less it), as
any program's output does: checkpoints and exports were 0600 whatever the umask said
(``tempfile.mkstemp``), so a group sharing a run's folder could not read them, and a
umask of 077 was the only setting they obeyed. The writes stay atomic (temp + rename)."""

from __future__ import annotations

import os
import stat
import sys
import types
from pathlib import Path

import pytest
from typer.testing import CliRunner

from csrun.cli.main import app
from csrun.core.runner.launch import LaunchPlan, launch
from tests.helpers.tiny_config import tiny_config


@pytest.fixture
def umask():
    """``umask(mask)`` sets the process's umask for the test (restored after)."""
    before = os.umask(0o022)
    os.umask(before)
    yield os.umask
    os.umask(before)


def _modes(folder: Path, skip: set[str]) -> dict[str, int]:
    return {str(p.relative_to(folder)): stat.S_IMODE(p.lstat().st_mode)
            for p in sorted(folder.rglob("*")) if p.name not in skip}


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002], ids=lambda m: f"umask {m:03o}")
def test_checkpoints_exports_and_results_follow_the_umask(mask, umask, tmp_path,
                                                          monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("tiny.yaml").write_text(tiny_config("train.steps=4", "checkpoint={dir: out/ck, "
                                             "every_steps: 2, export: safetensors}"))
    umask(mask)
    done = CliRunner().invoke(app, ["train", "tiny.yaml", "--json", "out/r.json",
                                    "--metrics", "out/m.jsonl"], catch_exceptions=False)
    assert done.exit_code == 0, done.stderr
    modes = _modes(tmp_path, skip={"tiny.yaml"})
    files = {name for name in modes if Path(name).is_file()}
    assert {"out/ck/ckpt-00000004.pt", "out/ck/ckpt-00000004.json",
            "out/ck/model.safetensors", "out/r.json", "out/m.jsonl"} <= files, modes
    assert not [name for name in modes if name.endswith(".tmp")]  # renamed into place
    assert {name: mode for name, mode in modes.items() if name in files} == \
        {name: 0o666 & ~mask for name in files}
    assert {name: mode for name, mode in modes.items() if name not in files} == \
        {name: 0o777 & ~mask for name in modes if name not in files}


class _StandInPlan(LaunchPlan):
    """A launch whose tasks run a line of Python instead of ``csrun train``."""

    def command(self, task):
        return [sys.executable, "-c", "print('ok')"]


@pytest.mark.process  # the job's tasks are processes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mask", [0o022, 0o077], ids=lambda m: f"umask {m:03o}")
def test_launch_logs_follow_the_umask(mask, umask, tmp_path):
    umask(mask)
    plan = _StandInPlan("c.yaml", [], {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},
                        "worker:0", False, tmp_path / "logs",
                        types.SimpleNamespace(strategy=types.SimpleNamespace(timeout_s=5)))
    assert launch(plan).status == "completed"
    modes = _modes(tmp_path, skip=set())
    assert modes.pop("logs") == 0o777 & ~mask
    assert "worker-0.stdout.log" in " ".join(modes)
    assert set(modes.values()) == {0o666 & ~mask}, modes
