"""Outputs that fail while written (round 2, item 10): a full disk under ``--metrics`` or
``--json`` fails the run (exit 1) naming the option and the file; a ``--metrics`` line is
never left torn, and one torn by a crash is dropped before a resumed run appends."""

from __future__ import annotations

import errno
import json
import os

import pytest
from typer.testing import CliRunner

from csrun.cli.main import app
from csrun.core.runner.metrics import MetricSinks, OutputError

full_disk = pytest.mark.skipif(not os.path.exists("/dev/full") or
                               not os.access("/dev", os.W_OK),
                               reason="needs /dev/full in a writable /dev")


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@full_disk
@pytest.mark.parametrize("command, option", [("train", "--metrics"), ("train", "--json"),
                                             ("validate", "--json")])
def test_a_full_disk_names_the_option_and_the_file(command, option, tiny):
    done = _invoke(command, tiny, option, "/dev/full")
    assert done.exit_code == 1, done.output
    assert f"{option}: cannot write '/dev/full': No space left on device" in done.stderr
    assert "Traceback" not in done.stderr and "CSRUN_TRACEBACK" not in done.stderr


class _FillsUp:
    """A raw file on a disk that fills after ``left`` bytes: the write that crosses the
    limit writes what fits, the next one fails with ENOSPC (as write(2) does)."""

    def __init__(self, file, left: int):
        self._file, self.left = file, left

    def write(self, data) -> int:
        if self.left <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written = self._file.write(bytes(data[:self.left]))
        self.left -= written
        return written

    def __getattr__(self, name):
        return getattr(self._file, name)


def test_a_failed_metrics_write_leaves_whole_lines(tmp_path):
    path = tmp_path / "m.jsonl"
    sinks = MetricSinks(str(path))
    sinks.write({"step": 1, "loss": 1.0})
    sink = sinks._sinks[0]
    sink._file = _FillsUp(sink._file, 10)  # part of the next line fits
    with pytest.raises(OutputError, match=f"--metrics: cannot write {str(path)!r}: No "
                                          "space left"):
        sinks.write({"step": 2, "loss": 0.5})
    sinks.close()
    assert path.read_text() == '{"step": 1, "loss": 1.0}\n'


def test_resume_drops_a_torn_last_metrics_line(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    common = [tiny, "checkpoint.dir=ck", "checkpoint.every_steps=3", "--metrics", "m.jsonl"]
    assert _invoke("train", *common, "train.steps=3").exit_code == 0
    with open("m.jsonl", "a") as f:
        f.write('{"step": 4, "epoch": 0, "lo')  # a crash mid-line
    done = _invoke("train", *common, "train.steps=6", "--resume")
    assert done.exit_code == 0, done.stderr
    steps = [json.loads(line)["step"] for line in open("m.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]
