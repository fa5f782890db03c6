"""The command line itself: output paths that cannot be written are refused before a run
starts (not after it), and bytes that are not UTF-8 in arguments are refused politely."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from csrun.cli.main import app


@pytest.mark.parametrize("option, where, says", [
    ("--json", "a_dir", "'a_dir' is a directory"),
    ("--json", "a_file/r.json", "'a_file' is a file, not a directory"),
    ("--metrics", "a_dir", "'a_dir' is a directory"),
    ("--metrics", "a_file/m.jsonl", "'a_file' is a file, not a directory"),
    ("--tensorboard", "a_file", "'a_file' is a file, not a directory"),
])
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(
        option, where, says, tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("")
    done = CliRunner().invoke(app, ["train", str(tiny), "checkpoint.dir=ck", option, where],
                              catch_exceptions=False)
    assert done.exit_code == 2 and f"{option}: {says}" in done.stderr
    assert "nothing ran" in done.stderr and done.stdout == ""
    assert not (tmp_path / "ck").exists()


def test_json_to_a_new_folder_is_fine(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(app, ["validate", str(tiny), "--json", "new/sub/r.json"],
                              catch_exceptions=False)
    assert done.exit_code == 0
    assert json.loads((tmp_path / "new" / "sub" / "r.json").read_text())["status"] == "valid"


@pytest.mark.process
@pytest.mark.timeout(120)
@pytest.mark.parametrize("arguments, says", [
    ([b"train.steps=\xff", b"\xff=1"], ["character U+DCFF is not allowed",
                                         "unknown section"]),
    ([b"\xfe\xff.yaml"], ["not found"]),
])
def test_arguments_that_are_not_utf8_are_refused(arguments, says, tiny, csrun):
    """A real process: Python hands undecodable bytes on as surrogates; csrun refuses
    them and still prints its message."""
    config = [] if arguments[0].endswith(b".yaml") else [str(tiny).encode()]
    done = csrun("validate", *config, *arguments)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert all(text in done.stderr for text in says), done.stderr
