"""What a new user meets first (issue 27): ``python -m csrun``, ``csrun.core.__version__``,
a config run from another folder finding the package beside it, and what an iterable
dataset with a holdout is told."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.process
def test_python_m_csrun_runs_the_command():
    done = subprocess.run([sys.executable, "-m", "csrun", "--version"], capture_output=True,
                          text=True, timeout=120, cwd="/")
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"csrun {importlib.metadata.version('csrun')}\n"


def test_csrun_stays_a_namespace_package():
    spec = importlib.util.find_spec("csrun")
    assert spec.origin in (None, "namespace")  # no csrun/__init__.py anywhere
    assert importlib.util.find_spec("csrun.__main__") is not None


def test_csrun_core_has_the_installed_version():
    import csrun.core
    assert csrun.core.__version__ == importlib.metadata.version("csrun")


PACKAGE = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x)
'''
CONFIG = """
strategy: {compute_devices: [CPU:0, CPU:1]}
dataset:
  source: {kind: synthetic, examples: 64, features: 4, classes: 3}
  steps: [{op: batch, size: 16}]
model: {kind: import, target: "NAME.nets:Net"}
train: {steps: 2}
"""


def _project(root: Path) -> tuple[Path, str]:
    """``root/configs/run.yaml`` naming a package beside it, ``root/configs/<name>``."""
    name = f"beside_{uuid.uuid4().hex[:8]}"  # a name per test: sys.modules keeps modules
    package = root / "configs" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "nets.py").write_text(PACKAGE)
    (root / "configs" / "run.yaml").write_text(CONFIG.replace("NAME", name))
    return root / "configs" / "run.yaml", name


def test_a_package_beside_the_config_is_found_from_another_folder(cli, tmp_path,
                                                                   monkeypatch):
    config, name = _project(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the test leaves sys.path as it was
    result = cli("validate", "configs/run.yaml")
    assert result.exit_code == 0, result.stderr
    beside = str(config.parent.resolve())
    cwd = next(i for i, entry in enumerate(sys.path) if entry in ("", os.getcwd()))
    assert sys.path.index(beside) == cwd + 1  # right after the current folder
    other = tmp_path / "other"
    (other / "configs").mkdir(parents=True)
    (other / "configs" / "x.yaml").write_text(CONFIG.replace("NAME", name + "_missing"))
    result = cli("validate", other / "configs" / "x.yaml")
    assert result.exit_code == 2
    assert "in the current folder or in the config file's folder?" in result.stderr
    assert beside not in sys.path  # an earlier config's folder does not linger


def test_the_shipped_example_runs_from_the_repository_root(cli, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    result = cli("validate", "examples/text_classifier.yaml")
    assert result.exit_code == 0, result.stderr


STREAM = '''
import torch
from torch.utils.data import IterableDataset


class Stream(IterableDataset):
    def __iter__(self):
        for i in range(64):
            yield torch.full((4,), float(i)), i % 3
'''


def test_an_iterable_dataset_with_a_holdout_is_told_why(cli, tmp_path, monkeypatch):
    name = f"stream_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(STREAM)
    (tmp_path / "it.yaml").write_text(CONFIG.replace(
        "{kind: synthetic, examples: 64, features: 4, classes: 3}",
        f'{{kind: import, target: "{name}:Stream"}}\n  holdout: 0.25')
        .replace("NAME.nets:Net", f"{name}:Stream"))
    monkeypatch.chdir(tmp_path)
    result = cli("validate", "it.yaml")
    assert result.exit_code == 2
    assert "dataset.holdout: an IterableDataset has no length" in result.stderr
    assert "holds out 0 of 0" not in result.stderr
