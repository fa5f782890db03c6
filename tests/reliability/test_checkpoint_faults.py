"""Checkpoint faults: a full disk never corrupts the previous checkpoint; a truncated or
corrupted one is detected (size, SHA-256) with a clear error; one from another model or
config is refused naming what differs. Exit code 1, never a traceback."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from csrun.cli.main import app
from csrun.core.runner.checkpoint import CheckpointError, CheckpointManager
from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.train import train
from tests.helpers.tiny_config import TINY

RUN = ["checkpoint.dir=ck", "checkpoint.every_steps=4", "checkpoint.keep=2",
       "train.steps=12"]


class _FullDisk:
    """A file on a disk with ``budget[0]`` bytes left: a write past them fails with
    ENOSPC after writing what fits, as ``write(2)`` does."""

    def __init__(self, file, budget: list):
        self._file, self._budget = file, budget

    def write(self, data) -> int:
        data = bytes(data)
        room = max(self._budget[0], 0)
        if len(data) > room:
            self._file.write(data[:room])
            self._budget[0] = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._budget[0] -= len(data)
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._file.close()


@pytest.fixture
def disk(monkeypatch):
    """``disk(bytes_left)``: from now on, files opened for writing by ``os.fdopen`` (the
    checkpoint writer's temp files) share that many bytes of space."""
    real_fdopen = os.fdopen

    def fill_at(left: int):
        budget = [left]

        def fdopen(fd, mode="r", *args, **kwargs):
            file = real_fdopen(fd, mode, *args, **kwargs)
            return _FullDisk(file, budget) if "w" in mode else file
        monkeypatch.setattr(os, "fdopen", fdopen)
    return fill_at


def _listing(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("fraction", [0.0, 0.3, 0.99, 1.0, 1.0005])
def test_a_full_disk_leaves_the_previous_checkpoint_as_it_was(fraction, tmp_path, disk):
    manager = CheckpointManager(tmp_path / "ck", 3, {"model.kind": "mlp"})
    manager.save(1, {"step": 1, "w": torch.arange(1000.0)})
    before = _listing(tmp_path / "ck")
    payload = {"step": 2, "w": torch.zeros(1000)}
    size = len(before["ckpt-00000001.pt"])  # about what the next payload needs
    disk(int(size * fraction))  # 1.0 and more: the payload fits, its manifest does not
    with pytest.raises(CheckpointError) as info:
        manager.save(2, payload)
    message = str(info.value)
    assert "cannot write a checkpoint to" in message and "(step 2)" in message
    assert "No space left on device" in message
    assert "the newest complete one, ckpt-00000001.pt, is intact" in message
    assert _listing(tmp_path / "ck") == before  # no temp file, no half checkpoint
    loaded, manifest = manager.load_latest()
    assert manifest["step"] == 1 and loaded["w"].equal(torch.arange(1000.0))


def test_a_failing_fsync_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    manager = CheckpointManager(tmp_path / "ck", 3, {})
    manager.save(1, {"step": 1})
    before = _listing(tmp_path / "ck")

    def fsync(fd):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CheckpointError, match="Input/output error"):
        manager.save(2, {"step": 2})
    assert _listing(tmp_path / "ck") == before


def _config(*overrides):
    return load_config_text(TINY, "tiny.yaml", [*RUN, *overrides])


def test_a_run_that_fills_the_disk_stops_and_resumes_where_it_was(tmp_path, monkeypatch,
                                                                   disk):
    monkeypatch.chdir(tmp_path)
    clean = train(_config("checkpoint.dir=clean"))
    saved = []

    def fill_after_two(event):  # the disk fills up after the checkpoints of steps 4 and 8
        if type(event).__name__ == "CheckpointSaved":
            saved.append(event.step)
            if len(saved) == 2:
                disk(2000)
    with pytest.raises(CheckpointError) as info:
        train(_config(), on_event=fill_after_two)
    assert "(step 12)" in str(info.value) and "No space left" in str(info.value)
    assert "ckpt-00000008.pt, is intact" in str(info.value)
    monkeypatch.undo()  # space again
    monkeypatch.chdir(tmp_path)
    resumed = train(_config(), resume=True)
    assert resumed.checkpoint["resumed_from_step"] == 8
    assert resumed.params_sha256 == clean.params_sha256


@pytest.fixture
def trained(tmp_path, monkeypatch):
    """A run with checkpoints at steps 8 and 12 in ``ck``; returns its JSON result."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY)
    done, result = _cli("train", "tiny.yaml", *RUN)
    assert done.exit_code == 0, done.stderr
    shutil.copytree(tmp_path / "ck", tmp_path / "ck-good")
    return result


def _cli(*args):
    done = CliRunner().invoke(app, [*args, "--json", "r.json"], catch_exceptions=False)
    return done, json.loads(Path("r.json").read_text())


def _flip_middle_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


DAMAGE = {  # how -> (what it does to the newest checkpoint, what the error says)
    "truncated": (lambda p: p.write_bytes(p.read_bytes()[:len(p.read_bytes()) // 2]),
                  "is truncated or damaged"),
    "emptied": (lambda p: p.write_bytes(b""), "is truncated or damaged: 0 bytes"),
    "one bit flipped": (_flip_middle_byte, "is corrupted: its SHA-256 does not match"),
    "zeroed": (lambda p: p.write_bytes(bytes(p.stat().st_size)),
               "is corrupted: its SHA-256 does not match"),
    "payload deleted": (lambda p: p.unlink(), "is missing"),
    "manifest torn": (lambda p: p.with_suffix(".json").write_text('{"format": 1, "st'),
                      "manifest 'ck/ckpt-00000012.json' is unreadable"),
    "manifest redirected": (lambda p: p.with_suffix(".json").write_text(json.dumps(
        {**json.loads(p.with_suffix(".json").read_text()), "file": "../tiny.yaml"})),
                            "is malformed (bad file)"),
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_checkpoint_is_detected_and_the_older_one_still_works(how, trained,
                                                                        tmp_path):
    damage, says = DAMAGE[how]
    damage(tmp_path / "ck" / "ckpt-00000012.pt")
    done, result = _cli("train", "tiny.yaml", *RUN, "train.steps=16", "--resume")
    assert done.exit_code == 1 and result["status"] == "failed"
    assert says in result["error"], result["error"]
    assert "1 older checkpoint(s) remain in 'ck': delete this one to resume from the " \
        "previous" in result["error"]
    assert "Traceback" not in done.stderr and says in done.stderr
    for name in ("ckpt-00000012.pt", "ckpt-00000012.json"):  # as the advice says
        (tmp_path / "ck" / name).unlink(missing_ok=True)
    done, resumed = _cli("train", "tiny.yaml", *RUN, "--resume")
    assert done.exit_code == 0 and resumed["checkpoint"]["resumed_from_step"] == 8
    assert resumed["params_sha256"] == trained["params_sha256"]


@pytest.mark.parametrize("change, differs", [
    ("model.hidden=[32]", "model.hidden.0: checkpoint 16, now 32"),
    ("model={kind: linear}", 'model.kind: checkpoint "mlp", now "linear"'),
    ("optimizer.name=SGD", 'optimizer.name: checkpoint "Adam", now "SGD"'),
    ("optimizer.lr=0.5", "optimizer.lr: checkpoint 0.01, now 0.5"),
    ("train.seed=1", "train.seed: checkpoint 0, now 1"),
    ("strategy.compute_devices=[CPU:0]", "strategy.replicas: checkpoint 2, now 1"),
    ("dataset.source.examples=97", "dataset.source.examples: checkpoint 96, now 97"),
    ("dataset.steps.1.size=8", "dataset.steps.1.size: checkpoint 16, now 8"),
])
def test_a_checkpoint_of_another_model_or_config_is_refused_naming_what_differs(
        change, differs, trained, tmp_path):
    done, result = _cli("train", "tiny.yaml", *RUN, change, "--resume")
    assert done.exit_code == 1 and result["status"] == "failed"
    assert "ckpt-00000012.pt' is from a different run" in result["error"]
    assert differs in result["error"] and "Traceback" not in done.stderr
    assert _listing(tmp_path / "ck") == _listing(tmp_path / "ck-good")  # untouched


def test_what_may_change_on_resume_does(trained):
    done, result = _cli("train", "tiny.yaml", *RUN, "train.steps=16", "train.log_every=3",
                        "checkpoint.every_steps=5", "--resume")
    assert done.exit_code == 0 and result["checkpoint"]["resumed_from_step"] == 12
    assert result["steps"] == 16


def test_another_models_weights_under_a_matching_manifest_are_refused(trained, tmp_path):
    """A payload from another model, its manifest made to match (size, checksum,
    identity): loading the weights fails, and says so."""
    path = tmp_path / "ck" / "ckpt-00000012.pt"
    payload = torch.load(path, weights_only=True)
    payload["model"] = torch.nn.Linear(6, 3).state_dict()
    torch.save(payload, path)
    from csrun.core.runner.digests import file_sha256
    manifest = json.loads(path.with_suffix(".json").read_text())
    manifest.update(bytes=path.stat().st_size, sha256=file_sha256(path))
    path.with_suffix(".json").write_text(json.dumps(manifest))
    done, result = _cli("train", "tiny.yaml", *RUN, "--resume")
    assert done.exit_code == 1
    assert "does not fit this model and optimizer" in result["error"]
    assert "Missing key(s) in state_dict" in result["error"]
