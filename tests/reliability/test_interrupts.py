"""Ctrl-C at any moment (round 2, item 9): exit 130, one line on stderr, the ``--json``
result when one was asked for, never a traceback. Before: one while torch imported
printed a 40-line traceback and no JSON; one while the config loaded was reported as a
second Ctrl-C ("aborted"); one while the process exited (atexit) printed a traceback.
Moments that a timer cannot hit are made deterministic by a user module that writes a
marker file and then waits."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.helpers.cli import child_env
from tests.helpers.tiny_config import TINY

pytestmark = pytest.mark.process  # csrun processes, interrupted

USER_MODULE = '''\
import atexit, os, pathlib, time
from torch import nn

def _mark(name):
    pathlib.Path(name).write_text("")

if os.environ.get("WAIT_AT") == "load":  # imported while the config is checked
    _mark("loading")
    time.sleep(60)
if os.environ.get("WAIT_AT") == "exit":
    atexit.register(lambda: (_mark("exiting"), time.sleep(3)))

def Model():
    return nn.Linear(6, 3)
'''


def _env(tmp_path, **extra):
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    return {**env, **extra}


def _wait_for(path, process, seconds=120):
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"no {path.name} in time"
        time.sleep(0.05)


def _user_config(tmp_path):
    (tmp_path / "user_module.py").write_text(USER_MODULE)
    config = tmp_path / "user.yaml"
    config.write_text(TINY.replace("model: {kind: mlp, hidden: [16]}",
                                   "model: {kind: import, target: 'user_module:Model'}"))
    return config


def _check_one_line(process, tmp_path, status="interrupted"):
    out, err = process.communicate(timeout=60)
    assert process.returncode == 130, (process.returncode, err)
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert len(err.strip().splitlines()) == 1 and "interrupted" in err, err
    assert "second Ctrl-C" not in err and "aborted" not in err, err
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["status"] == status and result["exit_code"] == 130


@pytest.mark.timeout(180)
def test_ctrl_c_while_torch_imports(spawn, tiny, tmp_path):
    process = spawn("train", tiny, "--json", "out.json")
    time.sleep(0.5)  # torch takes seconds to import
    process.send_signal(signal.SIGINT)
    _check_one_line(process, tmp_path)


@pytest.mark.timeout(180)
def test_a_first_ctrl_c_while_the_config_loads_is_not_a_second(spawn, tmp_path):
    process = spawn("train", _user_config(tmp_path), "--json", "out.json",
                    env=_env(tmp_path, WAIT_AT="load"))
    _wait_for(tmp_path / "loading", process)
    process.send_signal(signal.SIGINT)
    _check_one_line(process, tmp_path)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_while_the_process_exits(spawn, tmp_path, signum):
    process = spawn("train", _user_config(tmp_path), "--json", "out.json",
                    env=_env(tmp_path, WAIT_AT="exit"))
    _wait_for(tmp_path / "exiting", process)
    process.send_signal(signum)
    out, err = process.communicate(timeout=60)
    # the run had completed: it exits so (SIGTERM said "no training step ran", 143)
    assert process.returncode == 0, err
    assert "no training step ran" not in err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    assert json.loads((tmp_path / "out.json").read_text())["status"] == "completed"
