"""What the user wrote reaches the terminal escaped, as values always were (``repr``):
a config key, a dotted path, an override's key, a file name, a path in the config, a
warning or an exception of user code. A raw ESC, CR, BEL or bidi override in them could
set the terminal's title, clear it, or hide and reorder what follows (issue 30). The
JSON result keeps them as they are, in valid JSON."""

from __future__ import annotations

import io
import json
import sys
import types
import uuid
from pathlib import Path

import pytest
from rich.console import Console

from csrun.cli.render import View
from csrun.core.runner.launch import LaunchPlan, launch
from tests.helpers.tiny_config import tiny_config

# what each hostile character would do on a terminal, and how csrun shows it
HOSTILE = {"\x1b]0;PWNED\x07": r"\x1b]0;PWNED\x07",  # sets the window title
           "\x1b[2J": r"\x1b[2J",  # clears the screen
           "\r": r"\r",  # returns to the line's start: what follows hides the key
           "\x07": r"\x07",  # rings the bell
           "\u202e": r"\u202e",  # right-to-left override: the line reads backwards
           "\n": r"\n"}  # in a key: a line of csrun's own, forged
KEYS = sorted(HOSTILE)


def _raw(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on (line breaks are csrun's)."""
    return sorted({c for c in text if not c.isprintable() and c != "\n"})


def _quoted(text: str) -> str:
    """``text`` as a double-quoted YAML scalar (its escapes read back as ``text``)."""
    return json.dumps(text)


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("command", ["validate", "train"])
@pytest.mark.parametrize("hostile", KEYS, ids=lambda h: ascii(h))
def test_keys_in_the_file_are_escaped(hostile, command, cli, folder):
    key = f"st{hostile}eps"
    Path("c.yaml").write_text(tiny_config().replace(
        "train: {steps: 40, log_every: 10}",
        f"train: {{steps: 40, log_every: 10, {_quoted(key)}: 3}}") +
        f"{_quoted('ch' + hostile + 'eckpoint')}: {{}}\n")
    done = cli(command, "c.yaml", "--json", "out.json")
    assert done.exit_code == 2
    assert _raw(done.stdout + done.stderr) == []
    assert f"c.yaml:10: train.st{HOSTILE[hostile]}eps: unknown key" in done.stderr
    assert f"ch{HOSTILE[hostile]}eckpoint: unknown section" in done.stderr
    assert "did you mean 'checkpoint'?" in done.stderr
    problems = json.loads(Path("out.json").read_text())["problems"]  # kept as written
    assert sorted(p["path"] for p in problems) == sorted([f"train.{key}",
                                                          f"ch{hostile}eckpoint"])


@pytest.mark.parametrize("hostile", KEYS, ids=lambda h: ascii(h))
def test_override_keys_are_escaped(hostile, cli, folder):
    Path("c.yaml").write_text(tiny_config())
    done = cli("validate", "c.yaml", f"train.st{hostile}eps=4", f"model.hidden.x{hostile}y=1",
               f"tra{hostile}in.steps=2", f"model.a{hostile}b=[5]", f"model.a{hostile}b.0.c=1",
               "--json", "-")
    assert done.exit_code == 2
    assert _raw(done.stderr) == []
    shown = HOSTILE[hostile]
    for line in (f"train.st{shown}eps: unknown key", f"tra{shown}in: unknown section",
                 f"'x{shown}y' is not an index",
                 f"model.a{shown}b.0 is a value (5), not a section"):
        assert line in done.stderr
    result = json.loads(done.stdout)  # --json - stays valid JSON
    assert f"tra{hostile}in" in [p["path"] for p in result["problems"]]


def test_file_names_are_escaped(cli, folder):
    name = "ev\x1b[2Jil.yaml"
    Path(name).write_text(tiny_config())
    done = cli("validate", name)
    assert done.exit_code == 0 and _raw(done.stdout) == []
    assert r"ok: ev\x1b[2Jil.yaml is valid" in done.stdout
    done = cli("validate", "ev\x1b[2Jli.yaml")
    assert done.exit_code == 2 and _raw(done.stderr) == []
    assert r"did you mean 'ev\x1b[2Jil.yaml'?" in done.stderr
    Path(name).write_text(tiny_config("train.steps=x"))
    done = cli("validate", name)
    assert done.exit_code == 2 and _raw(done.stderr) == []
    assert r"ev\x1b[2Jil.yaml:10: train.steps" in done.stderr


def test_paths_in_a_run_are_escaped(cli, folder):
    Path("c.yaml").write_text(tiny_config("train={steps: 2, log_every: 1}") +
                              "checkpoint: {dir: \"c\\x1b]0;T\\x07k\\u202e\", every_steps: 1, "
                              "export: safetensors}\n")
    done = cli("train", "c.yaml", "--json", "out.json", "--metrics", "m\x1b[2J.jsonl")
    assert done.exit_code == 0, done.stderr
    assert _raw(done.stdout + done.stderr) == []
    assert r"metrics        m\x1b[2J.jsonl" in done.stdout
    assert r"checkpoint: step 2 -> c\x1b]0;T\x07k\u202e/ckpt-00000002.pt" in done.stdout
    assert r"exported the final weights to c\x1b]0;T\x07k\u202e/model.safetensors" in \
        done.stdout
    result = json.loads(Path("out.json").read_text())
    assert result["checkpoint"]["last"] == "c\x1b]0;T\x07k\u202e/ckpt-00000002.pt"


USER_CODE = '''\
import warnings
from torch import nn

warnings.warn("bad\\x1b[2J\\rwarning")


class Model(nn.Module):
    def __init__(self):
        raise ValueError("no\\x1b]0;PWNED\\x07 model\\u202e")
'''


def test_warnings_and_exceptions_of_user_code_are_escaped(cli, folder, monkeypatch):
    monkeypatch.syspath_prepend(str(folder))
    module = f"user_{uuid.uuid4().hex[:8]}"  # a fresh name: imported (and warned) anew
    Path(f"{module}.py").write_text(USER_CODE)
    Path("c.yaml").write_text(tiny_config(f"model={{kind: import, target: '{module}:Model'}}"))
    done = cli("validate", "c.yaml")
    assert done.exit_code == 2
    assert _raw(done.stderr) == []
    assert r"UserWarning: bad\x1b[2J\rwarning" in done.stderr
    assert r"ValueError: no\x1b]0;PWNED\x07 model\u202e" in done.stderr
    sys.modules.pop(module, None)


class _StandInPlan(LaunchPlan):
    """A launch whose tasks run ``scripts[task]`` (Python) instead of ``csrun train``."""

    scripts: dict

    def command(self, task):
        return [sys.executable, "-c", self.scripts.get(task, "")]


@pytest.mark.process  # the job's tasks are processes
@pytest.mark.timeout(60)
def test_the_last_lines_of_a_failed_task_are_escaped(tmp_path):
    plan = _StandInPlan("c.yaml", [], {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"]},
                        "worker:0", False, tmp_path / "logs",
                        types.SimpleNamespace(strategy=types.SimpleNamespace(timeout_s=5)))
    plan.scripts = {"worker:0": "import sys; print('gone\\x1b]0;PWNED\\x07\\r', "
                                "file=sys.stderr); sys.exit(1)"}
    view = View()
    view.out = view.err = Console(file=io.StringIO(), width=200)
    view.launch_summary(launch(plan))
    shown = view.err.file.getvalue()
    assert r"gone\x1b]0;PWNED\x07" in shown and _raw(shown) == []


FAILS_IN_TRAINING = '''\
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(6, 3)

    def forward(self, x):
        if x.device.type != "meta":  # in training, not in the config check
            raise ValueError("lost\\x1b[2J\\rin training\\u202e")
        return self.layer(x)
'''


def test_a_failure_of_user_code_in_training_is_escaped(cli, folder, monkeypatch):
    monkeypatch.syspath_prepend(str(folder))
    module = f"user_{uuid.uuid4().hex[:8]}"
    Path(f"{module}.py").write_text(FAILS_IN_TRAINING)
    Path("c.yaml").write_text(tiny_config(f"model={{kind: import, target: '{module}:Model'}}",
                                          "train.steps=2"))
    done = cli("train", "c.yaml", "--json", "-")
    assert done.exit_code == 1
    assert _raw(done.stderr) == []
    assert r"ValueError: lost\x1b[2J\rin training\u202e" in done.stderr
    assert "lost\x1b[2J\rin training\u202e" in json.loads(done.stdout)["error"]
