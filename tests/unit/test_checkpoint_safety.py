"""Nothing a user saved is deleted before what replaces it is durable, a run never saves
into (or prunes) another folder than the one it claimed, a manifest is read only when it
is a small regular file, and a resume with other step settings says so."""

from __future__ import annotations

import errno
import json
import os
import threading

import pytest

from csrun.core.runner import checkpoint as checkpoint_module
from csrun.core.runner.checkpoint import CheckpointError
from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.train import train

TINY = """\
strategy: {compute_devices: [CPU:0, CPU:1]}
dataset:
  source: {kind: synthetic, examples: 64, features: 4, classes: 3}
  steps: [{op: batch, size: 8}]
model: {kind: linear}
train: {steps: 12}
checkpoint: {every_steps: 4, keep: 2}
"""


def config(folder, *overrides):
    return load_config_text(TINY, None, [f"checkpoint.dir={folder}", *overrides])


def notices(events) -> list[str]:
    return [e.message for e in events if type(e).__name__ == "Notice"]


def names(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("ckpt-"))


# -- a run that starts over --------------------------------------------------------------
def test_a_fresh_run_keeps_an_earlier_runs_checkpoints_until_its_own_is_written(
        tmp_path, monkeypatch):
    train(config(tmp_path, "train.steps=300", "checkpoint.every_steps=100"))
    earlier = names(tmp_path)
    assert earlier[-2:] == ["ckpt-00000300.json", "ckpt-00000300.pt"]

    def full(path, write):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(checkpoint_module, "write_atomic", full)
    with pytest.raises(CheckpointError, match="No space left"):
        train(config(tmp_path))
    assert names(tmp_path) == earlier  # nothing of the earlier run was deleted


def test_a_fresh_run_replaces_an_earlier_runs_newer_checkpoints(tmp_path):
    train(config(tmp_path, "train.steps=300", "checkpoint.every_steps=100"))
    events = []
    train(config(tmp_path), on_event=events.append)
    assert names(tmp_path) == ["ckpt-00000008.json", "ckpt-00000008.pt",
                               "ckpt-00000012.json", "ckpt-00000012.pt"]
    assert any("replaced 2 checkpoint(s) of an earlier run" in n for n in notices(events))


# -- a checkpoint.dir that is a symlink -----------------------------------------------
def test_a_retargeted_symlink_does_not_move_the_runs_saves(tmp_path):
    mine, theirs, link = tmp_path / "mine", tmp_path / "theirs", tmp_path / "link"
    mine.mkdir()
    train(config(theirs))  # another run's checkpoints
    before = {p.name: p.read_bytes() for p in theirs.iterdir()}
    link.symlink_to(mine)
    events = []

    def retarget(event):
        events.append(event)
        if type(event).__name__ == "CheckpointSaved" and event.step == 4:
            (tmp_path / "new").symlink_to(theirs)
            os.replace(tmp_path / "new", link)  # ln -sfn theirs link
    result = train(config(link), on_event=retarget)
    assert {p.name: p.read_bytes() for p in theirs.iterdir()} == before
    assert names(mine) == ["ckpt-00000008.json", "ckpt-00000008.pt",
                           "ckpt-00000012.json", "ckpt-00000012.pt"]
    assert result.checkpoint["last"] == str(mine.resolve() / "ckpt-00000012.pt")
    assert any("now leads elsewhere" in n and str(mine.resolve()) in n
               for n in notices(events))


# -- manifests that are not small regular files -----------------------------------------
@pytest.mark.timeout(60)
@pytest.mark.parametrize("plant", ["fifo", "device", "nested", "huge"])
def test_a_bad_newest_manifest_is_refused_naming_it(tmp_path, plant):
    train(config(tmp_path))
    newest = tmp_path / "ckpt-99999999.json"
    if plant == "fifo":
        os.mkfifo(newest)  # opening it would wait for a writer forever
    elif plant == "device":
        newest.symlink_to("/dev/zero")  # reading it would never end
    elif plant == "nested":
        newest.write_text("[" * 100_000 + "]" * 100_000)
    else:
        with open(newest, "wb") as f:
            f.truncate(checkpoint_module.MANIFEST_MAX_BYTES + 1)
    with pytest.raises(CheckpointError) as caught:
        train(config(tmp_path), resume=True)
    assert str(newest) in str(caught.value) and "older checkpoint(s) remain" in str(caught.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["ckpt-00000099.json", "ckpt-00000012.pt"])
def test_a_name_swapped_for_a_fifo_after_it_was_looked_at_does_not_block(
        tmp_path, monkeypatch, name):
    """A FIFO put at a checkpoint's name between the look (stat) and the open: the open
    is non-blocking and the descriptor is looked at again, so the resume is refused
    naming it at once (an open for reading used to wait for a writer forever)."""
    train(config(tmp_path))
    swapped = tmp_path / name
    if name.endswith(".json"):  # a newer manifest, as a forger would copy one
        text = (tmp_path / "ckpt-00000012.json").read_text()
        swapped.write_text(text.replace("ckpt-00000012.pt", "ckpt-00000099.pt"))
    regular = os.stat(swapped)
    swapped.unlink()
    os.mkfifo(swapped)
    real_stat = os.stat

    def looked_at_before_the_swap(path, *args, **kwargs):
        return regular if str(path) == str(swapped) else real_stat(path, *args, **kwargs)
    monkeypatch.setattr(checkpoint_module.os, "stat", looked_at_before_the_swap)
    caught: list = []
    resume = threading.Thread(target=lambda: caught.append(_refusal(tmp_path)), daemon=True)
    resume.start()
    resume.join(20)
    if resume.is_alive():  # blocked in the open: let it go, then fail
        os.close(os.open(swapped, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"the resume blocked opening the FIFO {name}")
    assert str(swapped) in caught[0] and "is not a regular file" in caught[0], caught


def _refusal(folder) -> str:
    try:
        train(config(folder), resume=True)
    except CheckpointError as exc:
        return str(exc)
    return "not refused"


# -- step settings changed on resume -----------------------------------------------------
@pytest.mark.parametrize("changed, said", [
    ("train.accumulate_steps=2", "train.accumulate_steps 2 (the checkpoint's run had 1)"),
    ("train.grad_clip_norm=0.5", "train.grad_clip_norm 0.5 (the checkpoint's run had None)")])
def test_a_resume_with_other_step_settings_says_so(tmp_path, changed, said):
    def stop_at(step):
        stop = threading.Event()
        return stop, lambda e: (events.append(e),
                                stop.set() if getattr(e, "step", 0) == step else None)
    events = []
    stop, on_event = stop_at(5)
    train(config(tmp_path), stop=stop, on_event=on_event)
    stop, on_event = stop_at(7)
    train(config(tmp_path), resume=True, stop=stop, on_event=on_event)  # the same: no word
    assert not any("uninterrupted run" in n for n in notices(events))
    train(config(tmp_path, changed), resume=True, on_event=events.append)
    assert any(said in n and "differ from those of an uninterrupted run" in n
               for n in notices(events)), notices(events)
