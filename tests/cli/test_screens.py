"""Every screen csrun shows, on terminals 60, 80 and 120 columns wide (issue 27): no line
is wider than the terminal, and lines break only between words.

A screen is rendered twice through the CLI: on a terminal of the width under test, and
without one, very wide, where nothing wraps (the reference). Every word on the terminal
must be a word of the reference: a word split across lines (``TF_C|ONFIG``) leaves two
pieces that are not; and every word of the reference must be on the terminal, whole.
Training is run once and its events replayed, so both renderings show the same numbers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pytest
from rich.cells import cell_len
from typer.testing import CliRunner

from csrun.cli import entry
from csrun.cli.main import app
from csrun.core.runner.events import RunResult
from csrun.core.runner.launch import LaunchResult, TaskExited, TaskOutput, TaskStarted
from csrun.core.runner.session import Outputs
from csrun.core.runner.train import train_from_file

TINY = """\
strategy: {compute_devices: [CPU:0, CPU:1]}
dataset:
  source: {kind: synthetic, examples: 96, features: 4, classes: 3}
  holdout: 0.25
  steps:
    - {op: shuffle, buffer: 128}
    - {op: batch, size: 16}
model: {kind: mlp, hidden: [8]}
optimizer: {name: SGD, lr: 0.1}
train: {steps: 6, log_every: 3}
"""
PS_TINY = TINY.replace("{compute_devices: [CPU:0, CPU:1]}",
                       "{kind: parameter_server, compute_devices: [CPU:0]}")

WIDTHS = (60, 80, 120)
_CONTROL = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")
_DRAWING = re.compile(r"^[\u2500-\u259f]+$")  # table rules, bars, sparklines
_EDGES = ",;:()[]'\""
_DIGEST = re.compile(r"^[0-9a-f]{8,}…$")
_PROGRESS = re.compile(r"^train .* ETA ")  # the progress bar's line


def _environ(width: int | None, env: dict | None) -> dict:
    """A terminal ``width`` wide (None: no terminal, wide: nothing wrapped)."""
    terminal = {"COLUMNS": str(width), "FORCE_COLOR": "1", "TTY_COMPATIBLE": "1"} if width \
        else {"COLUMNS": "1000", "FORCE_COLOR": None, "TTY_COMPATIBLE": None}
    return {"TF_CONFIG": None, "CSRUN_TRACEBACK": None, "CSRUN_COLUMNS": None, **terminal,
            **(env or {})}


def _render(args, width: int | None, env: dict | None = None) -> str:
    """stdout + stderr of ``csrun *args`` (through Typer's CliRunner)."""
    done = CliRunner().invoke(app, [str(a) for a in args], env=_environ(width, env),
                              catch_exceptions=False)
    return done.stdout + done.stderr


def _render_process(args, width: int | None, env: dict | None = None) -> str:
    """The same from a ``csrun`` process: help is laid out by click, whose width the
    CliRunner fixes at 80 columns."""
    environ = {k: v for k, v in {**os.environ, **_environ(width, env)}.items()
               if v is not None}
    done = subprocess.run([sys.executable, "-m", "csrun.cli", *map(str, args)], env=environ,
                          capture_output=True, text=True, timeout=120)
    return done.stdout + done.stderr


def _lines(text: str) -> list[str]:
    """What a terminal shows: escape codes dropped, a live display's redraws
    (``\\r``) as lines of their own."""
    return [line.rstrip() for line in re.split(r"[\r\n]", _CONTROL.sub("", text))]


def _words(lines) -> list[str]:
    words = (w.strip(_EDGES) for line in lines for w in line.split())
    return [w for w in words if w and not _DRAWING.match(w)]


def check_screen(args, *, env=None, lacking=(), progress=False, render=_render) -> None:
    """``csrun *args`` at every width: lines fit and words are whole. ``lacking``: words
    a narrow layout may leave out (a table's headers); ``progress``: the progress bar's
    redraws are checked for width only (they show times)."""
    reference = set(_words(_lines(render(args, None, env))))
    for width in WIDTHS:
        lines = _lines(render(args, width, env))
        wide = [line for line in lines if cell_len(line) > width]
        assert not wide, f"{width} columns: lines too wide:\n" + "\n".join(wide)
        shown = [line for line in lines if not (progress and _PROGRESS.match(line))]
        words = _words(shown)
        split = [w for w in words if w not in reference and not _abbreviated(w, reference)]
        assert not split, f"{width} columns: split words {split}:\n" + "\n".join(lines)
        lost = reference - set(words) - set(lacking)
        lost = {w for w in lost if not any(_abbreviated(s, {w}) for s in words)}
        assert not lost, f"{width} columns: words lost {lost}:\n" + "\n".join(lines)


def _abbreviated(word: str, reference) -> bool:
    """``5a5322fcbe…``: a digest shortened on purpose on a narrow terminal."""
    return bool(_DIGEST.match(word)) and any(r.startswith(word[:-1]) for r in reference)


# -- a training run, recorded once and replayed ------------------------------------------
@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """``(config path, events, result)`` of a tiny run, with relative paths (a long
    temporary folder would be the only thing a narrow terminal has to cut)."""
    folder = tmp_path_factory.mktemp("screens")
    (folder / "tiny.yaml").write_text(TINY)
    events: list = []
    with contextlib.chdir(folder):
        result = train_from_file("tiny.yaml", ["checkpoint.dir=ck", "train.log_every=3"],
                                 outputs=Outputs(), on_event=events.append)
    return folder, events, result


@pytest.fixture
def replay(recorded, monkeypatch):
    """The run's events and result, given to the CLI's ``train`` as a run would."""
    folder, events, result = recorded
    monkeypatch.chdir(folder)
    replayed = {"result": result, "events": list(events)}

    def train(config, overrides, *, resume, outputs, on_event, stop=None):
        for event in replayed["events"]:
            if isinstance(event, _Warn):
                warnings.warn(event.message, RuntimeWarning)
            else:
                on_event(event)
        return replayed["result"]
    monkeypatch.setattr("csrun.core.runner.train.train_from_file", train)
    return replayed


def test_train(replay):
    check_screen(["train", "tiny.yaml", "--metrics", "m.jsonl"], progress=True)


def test_train_interrupted_by_ctrl_c(replay):
    replay["result"] = dataclasses.replace(replay["result"], status="interrupted",
                                           signal="SIGINT")
    check_screen(["train", "tiny.yaml"], progress=True)
    shown = _render(["train", "tiny.yaml"], 60)
    assert "(continue with --resume)" in _lines(shown)[-2], shown  # whole, on one line


def test_a_warning_during_the_run(replay):
    events = list(replay["events"])
    replay["events"][:] = [_Warn("replicas drew random numbers from torch's global CPU "
                                 "generator (dropout); csrun runs this strategy's replicas "
                                 "in order from now on"), *events]
    check_screen(["train", "tiny.yaml"], progress=True)
    assert "warning: RuntimeWarning: replicas drew" in _render(["train", "tiny.yaml"], None)


class _Warn:
    """An event that warns as it is replayed, as the engine does during a step."""

    def __init__(self, message: str):
        self.message = message


@pytest.mark.parametrize("raised", [KeyboardInterrupt(), RuntimeError("x " * 80)])
def test_ctrl_c_before_training_and_a_long_failure(tmp_path, monkeypatch, raised):
    def train(*args, **kwargs):
        raise raised
    monkeypatch.setattr("csrun.core.runner.train.train_from_file", train)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY)
    check_screen(["train", "tiny.yaml"])


def test_ctrl_c_while_csrun_starts(monkeypatch):
    """The first instant's Ctrl-C line (standard library only: rich is not loaded)."""
    message = "interrupted (SIGINT) while no training step ran; nothing to save"
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    for width in WIDTHS:
        monkeypatch.setenv("COLUMNS", str(width))
        lines = entry.fitted(message).splitlines()
        assert max(map(len, lines)) <= width
        assert " ".join(line.strip() for line in lines) == message


def test_validate_errors(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY.replace("kind: mlp", "kind: mpl"))
    check_screen(["validate", "tiny.yaml", "strategy.kind=parameter_server",
                  "optimizer.lr=-1", "--json", "tiny.yaml"])


def test_validate_ok(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY)
    check_screen(["validate", "tiny.yaml"])


def test_inspect_devices():
    # a narrow terminal lists the devices without the table's headers
    check_screen(["inspect-devices"], lacking={"device", "TF", "name", "torch", "kind",
                                                "memory", "model", "capability"})
    shown = "\n".join(_lines(_render(["inspect-devices"], 60)))
    assert "/job:localhost/replica:0/task:0/device:CPU:0" in shown


@pytest.mark.process
@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["launch", "--help"],
                                  ["validate", "--help"], ["inspect-devices", "--help"]])
def test_help(args):
    check_screen(args, render=_render_process)


# -- launch: the tasks' lines behind their prefix -----------------------------------------
def test_launch(replay, monkeypatch):
    """The launcher gives each task the width its prefix leaves (the task lays its own
    tables out for it) and wraps the tasks' longer lines behind the prefix."""
    pathlib.Path("ps.yaml").write_text(PS_TINY)  # in the replay's folder
    asked = []

    def job(plan, on_event, stop, received, environ=None):
        asked.append(environ)
        task_screen = _render(["train", "tiny.yaml"], None, environ)
        for n, task in enumerate(plan.tasks):
            on_event(TaskStarted(task, f"127.0.0.1:{4000 + n}", 100 + n, task == plan.chief,
                                 "out.log", "err.log"))
        for line in task_screen.splitlines():
            on_event(TaskOutput(plan.chief, "stdout", line))
        on_event(TaskOutput("ps:0", "stderr", "a long stderr line " * 8))
        for task in plan.tasks:
            on_event(TaskExited(task, 0, 2.0))
        return LaunchResult("completed", 0, plan.chief, [
            {"task": t, "pid": 1, "exit_code": 0, "stdout": None, "stderr": None}
            for t in plan.tasks], None, [], None, None, {}, None, plan.cluster, 3.0)
    monkeypatch.setattr("csrun.core.runner.launch.launch", job)
    check_screen(["launch", "ps.yaml", "--workers", "2", "--ps", "1", "--logs", "logs"])
    room = str(120 - len("[worker:0] "))  # the widest task name, and a space
    assert asked[-1] == {"COLUMNS": room, "CSRUN_COLUMNS": room}
    assert asked[0] == {"COLUMNS": str(1000 - len("[worker:0] "))}  # no terminal


def test_a_result_is_a_run_result(recorded):
    assert isinstance(recorded[2], RunResult) and recorded[2].checkpoint["last"]
