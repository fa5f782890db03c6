"""``sys.exit`` (any code, or a message) in user code that a config check calls: an
import of a model, dataset, collate, loss, map or optimizer target, a constructor, a
dataset factory, the first batch. It is the config's problem (exit 2, naming the key
and what happened), not csrun's own exit (it was exit 1, "user code exited")."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from tests.helpers.tiny_config import tiny_config

USER_CODE = '''\
import sys
import torch
from torch import nn



def EXIT():
    {exit}
    pass


if "{where}" == "import":
    EXIT()


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        if "{where}" == "constructor":
            EXIT()
        self.layer = nn.Linear(6, 3)

    def forward(self, x):
        if "{where}" == "forward":
            EXIT()
        return self.layer(x)


class Data(torch.utils.data.Dataset):
    def __init__(self):
        if "{where}" == "factory":
            EXIT()

    def __len__(self):
        if "{where}" == "len":
            EXIT()
        return 8

    def __getitem__(self, i):
        if "{where}" == "getitem":
            EXIT()
        return torch.zeros(6), i % 3


def collate(items):
    if "{where}" == "collate":
        EXIT()
    return torch.utils.data.default_collate(items)


def loss(model, batch):
    if "{where}" == "loss":
        EXIT()
    return nn.functional.cross_entropy(model(batch[0]), batch[1], reduction="none")
'''
EXITS = {"sys.exit(0)": "sys.exit(0)", "sys.exit(3)": "sys.exit(3)",
         "sys.exit()": "sys.exit(None)", "raise SystemExit('no --data given')":
         "sys.exit('no --data given')"}
# where the exit is -> the key blamed and the words naming what exited
WHERES = {"import": ("model.target", "importing module"),
          "constructor": ("model.target", ":Model(**kwargs) exited"),
          "forward": ("model", "the model on a real batch of 2 examples exited"),
          "factory": ("dataset.source.target", ":Data(**kwargs) exited"),
          "len": ("dataset.source.target", "len() of"),
          "getitem": ("dataset.source.target", "reading the first examples"),
          "collate": ("dataset.collate", ":collate on the first"),
          "loss": ("model", "exited")}


@pytest.fixture
def user_config(tmp_path, monkeypatch):
    """``user_config(exit, where)`` -> a config whose model, dataset, collate and loss
    are a fresh user module that runs ``exit`` at ``where``."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(exit: str, where: str) -> Path:
        module = f"user_{uuid.uuid4().hex[:8]}"  # a fresh name: none is in sys.modules
        (tmp_path / f"{module}.py").write_text(USER_CODE.format(exit=exit, where=where))
        model = f"model={{kind: import, target: '{module}:Model'"
        if where == "import":  # only the model names the module
            overrides = [model + "}"]
        else:
            overrides = [model + f", loss: '{module}:loss'}}",
                         f"dataset={{source: {{kind: import, target: '{module}:Data'}}, "
                         f"collate: '{module}:collate', steps: [{{op: batch, size: 4}}]}}"]
        config = tmp_path / "user.yaml"
        config.write_text(tiny_config(*overrides, "train.steps=2"))
        return config
    return write


@pytest.mark.parametrize("exit", sorted(EXITS))
@pytest.mark.parametrize("command", ["validate", "train"])
def test_an_exit_at_import_is_a_config_problem(exit, command, cli, user_config):
    config = user_config(exit, "import")
    done = cli(command, config, "checkpoint.dir=ck", "--json", "out.json")
    assert done.exit_code == 2, done.stderr
    result = json.loads(Path("out.json").read_text())
    assert result["status"] == "invalid"
    [problem] = result["problems"]
    assert problem["path"] == "model.target"
    assert problem["message"].startswith("importing module 'user_")
    assert f"exited: {EXITS[exit]} (at user_" in problem["message"]
    assert "if __name__ == '__main__'" in problem["hint"]
    assert "model.target: importing module" in done.stderr


@pytest.mark.parametrize("where", sorted(set(WHERES) - {"import"}))
def test_an_exit_in_checked_user_code_is_a_config_problem(where, cli, user_config):
    done = cli("validate", user_config("sys.exit(4)", where), "--json", "out.json")
    assert done.exit_code == 2, done.stderr
    problems = json.loads(Path("out.json").read_text())["problems"]
    key, words = WHERES[where]
    assert any(p["path"] == key and words in p["message"] and "sys.exit(4)" in p["message"]
               for p in problems), problems


IMPORTERS = {  # a key naming user code -> the override that points it at the module
    "dataset.source.target": "dataset.source={{kind: import, target: '{m}:Data'}}",
    "dataset.collate": "dataset={{source: {{kind: import, target: '{m}_data:Data'}}, "
                       "collate: '{m}:collate', steps: [{{op: batch, size: 4}}]}}",
    "model.loss": "model.loss={m}:loss",
    "dataset.steps.0.fn": "dataset.steps.0={{op: map, fn: '{m}:parse'}}",
    "optimizer.target": "optimizer={{target: '{m}:Opt', lr: 0.1}}"}


@pytest.mark.parametrize("key", sorted(IMPORTERS))
def test_an_exit_at_the_import_of_any_target_names_its_key(key, cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = f"user_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text("import sys\nsys.exit(5)\n")
    (tmp_path / f"{module}_data.py").write_text(USER_CODE.format(exit="", where=""))
    (tmp_path / "user.yaml").write_text(tiny_config(IMPORTERS[key].format(m=module)))
    done = cli("validate", "user.yaml", "--json", "out.json")
    assert done.exit_code == 2, done.stderr
    problems = json.loads(Path("out.json").read_text())["problems"]
    assert [(p["path"], p["message"]) for p in problems] == [
        (key, f"importing module '{module}' exited: sys.exit(5) (at {module}.py:2)")]


OPTIMIZER = '''\
import sys
import torch


class Opt(torch.optim.SGD):
    def __init__(self, params, lr):
        {body}
'''


@pytest.mark.parametrize("body, says", [
    ("sys.exit(7)", "exited: sys.exit(7) (at {m}.py:7)"),
    ("raise RuntimeError('no such device')", "failed: RuntimeError: no such device "
                                             "(at {m}.py:7)")])
def test_a_failing_optimizer_class_is_a_config_problem(body, says, cli, tmp_path,
                                                       monkeypatch):
    """optimizer.target's constructor: anything but TypeError, ValueError and KeyError
    ended in the unexpected-error path (exit 1, not naming optimizer.target)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = f"user_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{module}.py").write_text(OPTIMIZER.format(body=body))
    (tmp_path / "user.yaml").write_text(tiny_config(f"optimizer={{target: '{module}:Opt', "
                                                    "lr: 0.1}"))
    done = cli("validate", "user.yaml", "--json", "out.json")
    assert done.exit_code == 2, done.stderr
    problems = json.loads(Path("out.json").read_text())["problems"]
    assert [(p["path"], p["message"]) for p in problems] == [
        ("optimizer.target", f"{module}:Opt(params, lr, **kwargs) " + says.format(m=module))]


def test_torch_optimizer_options_that_clash_are_a_config_problem(cli, tmp_path):
    """Adam's RuntimeError for fused and foreach together (exit 1 as an unexpected error)."""
    (tmp_path / "c.yaml").write_text(tiny_config())
    done = cli("validate", tmp_path / "c.yaml", "optimizer.kwargs={fused: true, foreach: true}")
    assert done.exit_code == 2
    assert "optimizer.kwargs: Adam(params, lr, **kwargs) failed: RuntimeError: `fused` and " \
        "`foreach` cannot be `True` together." in done.stderr
