"""Bad user code through the CLI: exit 2 before training when preflight can know, exit 1
during it, each naming the config key and the user's file:line, without a traceback."""

import uuid

import pytest

USER_CODE = '''
import torch
from torch import nn
from torch.utils.data import Dataset


class Items(Dataset):
    def __len__(self):
        return 12
    def __getitem__(self, i):
        if i == 9:
            raise ValueError("row 9 is damaged")
        return torch.full((4,), float(i)), i % 3


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)
    def forward(self, x):
        return self.lin(x) if x.sum() >= 0 else self.lin(-x)


def no_model():
    raise RuntimeError("cannot build")
'''

def line_of(text: str) -> int:
    return USER_CODE.splitlines().index(text) + 1


DAMAGED = '            raise ValueError("row 9 is damaged")'
CONFIG = """
strategy: {compute_devices: [CPU:0, CPU:1]}
dataset:
  source: {kind: import, target: "usercli13:Items"}
  steps: [{op: batch, size: 4}]
model: {kind: import, target: "usercli13:Branchy", loss: cross_entropy}
train: {epochs: 1}
"""


@pytest.fixture
def project(tmp_path, monkeypatch):
    # a module name per test: sys.modules keeps what an earlier test imported
    name = f"u13_{uuid.uuid4().hex[:6]}"
    (tmp_path / f"{name}.py").write_text(USER_CODE)
    (tmp_path / "run.yaml").write_text(CONFIG.replace("usercli13", name))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("CSRUN_TRACEBACK", raising=False)
    return name


def test_validate_notes_the_cpu_check_of_an_untraceable_model(cli, project):
    result = cli("validate", "run.yaml")
    assert result.exit_code == 0, result.stderr
    assert "note: model: not checked on the meta device" in result.stdout
    assert "checked on CPU with one real batch of 2 examples" in result.stdout


def test_a_failure_known_before_training_exits_2_naming_key_and_line(cli, project):
    result = cli("train", "run.yaml", f"model.target={project}:no_model")
    assert result.exit_code == 2, result.stderr
    line = line_of('    raise RuntimeError("cannot build")')
    assert "model.target" in result.stderr and f"{project}.py:{line}" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_failure_during_training_exits_1_naming_key_and_line(cli, project):
    result = cli("train", "run.yaml")
    assert result.exit_code == 1
    assert f"dataset.source.target: {project}:Items[9] failed: ValueError: row 9 is " \
           f"damaged (at {project}.py:{line_of(DAMAGED)})" in result.stderr
    assert "Traceback" not in result.stderr and "CSRUN_TRACEBACK=1" in result.stderr


def test_the_traceback_on_request(cli, project, monkeypatch):
    monkeypatch.setenv("CSRUN_TRACEBACK", "1")
    assert "Traceback" in cli("train", "run.yaml").stderr
