"""Checkpoints: atomic files, a checksum manifest, safe loading, clear refusals."""

import json
import pickle

import pytest
import torch

from csrun.core.runner.checkpoint import CheckpointError, CheckpointManager


def manager(tmp_path, keep=2, **identity):
    return CheckpointManager(tmp_path / "ck", keep, identity or {"model.kind": "mlp"})


def test_save_writes_payload_and_manifest_and_keeps_the_newest(tmp_path):
    m = manager(tmp_path)
    for step in (1, 2, 3):
        m.save(step, {"step": step, "w": torch.full((2,), float(step))})
    names = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert names == ["ckpt-00000002.json", "ckpt-00000002.pt",
                     "ckpt-00000003.json", "ckpt-00000003.pt"]  # no temp files left
    manifest = json.loads((tmp_path / "ck" / "ckpt-00000003.json").read_text())
    assert manifest["step"] == 3 and len(manifest["sha256"]) == 64
    payload, loaded = m.load_latest()
    assert payload["w"].tolist() == [3.0, 3.0] and loaded["step"] == 3


def test_no_checkpoint_is_none(tmp_path):
    assert manager(tmp_path).load_latest() is None


def test_corrupted_payload_is_refused(tmp_path):
    m = manager(tmp_path)
    m.save(1, {"step": 1})
    path = m.save(2, {"step": 2, "w": torch.zeros(100)})
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupted: its SHA-256") as info:
        m.load_latest()
    assert "1 older checkpoint(s) remain" in str(info.value)


def test_truncated_payload_is_refused(tmp_path):
    m = manager(tmp_path)
    path = m.save(5, {"step": 5, "w": torch.zeros(100)})
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="truncated"):
        m.load_latest()


def test_a_checkpoint_of_another_run_names_what_differs(tmp_path):
    manager(tmp_path, **{"model.hidden.0": 64, "train.seed": 0}).save(1, {"step": 1})
    other = manager(tmp_path, **{"model.hidden.0": 128, "train.seed": 0})
    with pytest.raises(CheckpointError) as info:
        other.load_latest()
    assert "model.hidden.0: checkpoint 64, now 128" in str(info.value)
    assert "train.seed" not in str(info.value)


@pytest.mark.filterwarnings("ignore:Detected pickle protocol")
def test_unpickling_code_is_refused(tmp_path):
    m = manager(tmp_path)
    path = m.save(1, {"step": 1})

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path.write_bytes(pickle.dumps({"step": 1, "x": Evil()}))  # and a matching manifest:
    manifest_path = path.with_suffix(".json")
    manifest = json.loads(manifest_path.read_text())
    from csrun.core.runner.digests import file_sha256
    manifest.update(bytes=path.stat().st_size, sha256=file_sha256(path))
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="cannot be loaded safely"):
        m.load_latest()


def test_a_broken_manifest_is_refused(tmp_path):
    m = manager(tmp_path)
    path = m.save(1, {"step": 1})
    path.with_suffix(".json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable"):
        m.load_latest()
    path.with_suffix(".json").write_text(json.dumps({"step": 1}))
    with pytest.raises(CheckpointError, match="lacks"):
        m.load_latest()


def test_an_unwritable_directory_is_a_clear_error(tmp_path):
    (tmp_path / "file").write_text("")
    m = CheckpointManager(tmp_path / "file" / "ck", 1, {})
    with pytest.raises(CheckpointError, match="cannot write a checkpoint"):
        m.save(1, {"step": 1})
