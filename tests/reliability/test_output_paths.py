"""Output paths that would destroy an input or each other, or block forever: refused with
exit 2 before anything is written (round 2, items 2 and 7)."""

from __future__ import annotations

import os

import pytest
from typer.testing import CliRunner

from csrun.cli.main import app


def _invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.mark.parametrize("option", ["--json", "--metrics", "--plot"])
def test_an_output_that_is_the_config_file_is_refused(option, tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = tiny.read_text()
    # the same file under another spelling: ./ and a symlink
    os.symlink(tiny, tmp_path / "link.yaml")
    for spelling in (f"./{tiny.name}", "link.yaml"):
        done = _invoke("train", tiny, option, spelling)
        assert done.exit_code == 2, done.output
        assert f"{option}: {spelling!r} is the config file" in done.stderr, done.stderr
        assert tiny.read_text() == before


def test_validate_json_onto_its_own_config_is_refused(tiny):
    before = tiny.read_text()
    done = _invoke("validate", tiny, "--json", tiny)
    assert done.exit_code == 2 and "is the config file" in done.stderr
    assert tiny.read_text() == before


def test_two_outputs_on_one_file_are_refused(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    done = _invoke("train", tiny, "--json", "out.json", "--metrics", "./out.json")
    assert done.exit_code == 2
    assert "--json: 'out.json' is also the --metrics file" in done.stderr, done.stderr
    assert not (tmp_path / "out.json").exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command, option", [("validate", "--json"), ("train", "--json"),
                                             ("train", "--metrics")])
def test_a_named_pipe_as_an_output_is_refused_not_waited_on(command, option, tiny, tmp_path):
    """Opening a FIFO for writing blocks until a reader comes: it would hang forever."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    done = _invoke(command, tiny, option, fifo)
    assert done.exit_code == 2
    assert f"{option}: {str(fifo)!r} is a named pipe" in done.stderr, done.stderr
