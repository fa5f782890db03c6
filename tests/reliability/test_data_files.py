"""Data files: a missing, unreadable or malformed file, wrong shapes or dtypes -> a clear
error (exit 2, ``dataset.source.*``, the file named) before training starts."""

from __future__ import annotations

import errno
import os
import pickle
import zipfile
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import csrun.core.data.sources as sources
from csrun.cli.main import app
from tests.helpers.broken_configs import VALID, block_yaml


def _npz(path, **arrays):
    np.savez(path, **arrays)


def _truncated(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])


X, Y = np.ones((12, 3)), np.arange(12) % 3


def _write(tmp: Path, case: str) -> Path:  # noqa: C901 - one small writer per case
    """Write the data file of ``case`` into ``tmp``; returns its path."""
    path = tmp / {"csv": "d.csv", "npy": "d.npy", "txt": "d.txt"}.get(
        case.split("_")[0], "d.npz")
    if case == "npz_missing":
        return tmp / "nothing-here.npz"
    if case == "npz_directory":
        path.mkdir()
    elif case == "txt_extension":
        path.write_text("1,2,0\n")
    elif case == "npz_garbage":
        path.write_bytes(os.urandom(200))
    elif case in ("npz_truncated", "npz_truncated_end"):
        _npz(path, x=X, y=Y)
        _truncated(path, 0.5 if case == "npz_truncated" else 0.97)
    elif case == "npz_member_is_a_pickle":
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("x.npy", pickle.dumps([1, 2]))
            z.writestr("y.npy", pickle.dumps([1, 2]))
    elif case == "npz_missing_key":
        _npz(path, features=X, y=Y)
    elif case == "npz_scalars":
        _npz(path, x=np.float32(1), y=np.int64(0))
    elif case == "npz_1d_features":
        _npz(path, x=np.ones(12), y=Y)
    elif case == "npz_rows_differ":
        _npz(path, x=X, y=Y[:-1])
    elif case == "npz_no_rows":
        _npz(path, x=np.ones((0, 3)), y=np.zeros(0))
    elif case == "npz_no_features":
        _npz(path, x=np.ones((12, 0)), y=Y)
    elif case in ("npz_complex", "npz_strings", "npz_bool", "npz_datetime"):
        x = {"npz_complex": X * 1j, "npz_strings": X.astype(str),
             "npz_bool": X.astype(bool),
             "npz_datetime": np.full((12, 3), np.datetime64("2024-01-01"))}[case]
        _npz(path, x=x, y=Y)
    elif case == "npz_nan_feature":
        x = X.copy()
        x[5, 1] = np.nan
        _npz(path, x=x, y=Y)
    elif case == "npz_inf_target":
        _npz(path, x=X, y=np.where(np.arange(12) == 7, np.inf, 1.0))
    elif case == "npz_beyond_float32":
        _npz(path, x=X * 1e300, y=Y)
    elif case == "npz_negative_labels":
        _npz(path, x=X, y=Y - 1)
    elif case == "npz_huge_label":
        _npz(path, x=X, y=np.where(np.arange(12) == 0, 10**11, Y))
    elif case == "npy_garbage":
        path.write_bytes(b"not numpy at all" * 10)
    elif case == "npy_truncated":
        np.save(path, np.ones((12, 4)))
        _truncated(path, 0.8)
    elif case == "npy_object_array":
        np.save(path, np.array([{"a": 1}, 2], dtype=object), allow_pickle=True)
    elif case == "npy_3d":
        np.save(path, np.ones((12, 2, 2)))
    elif case == "npy_one_column":
        np.save(path, np.ones((12, 1)))
    elif case == "csv_ragged":
        path.write_text("1,2,0\n3,4\n")
    elif case == "csv_text_cell":
        path.write_text("a,b,label\n1,x,0\n")
    elif case == "csv_empty":
        path.write_text("")
    elif case == "csv_header_only":
        path.write_text("a,b,label\n")
    elif case == "csv_not_utf8":
        path.write_bytes("caf\u00e9,b,label\n1,2,0\n".encode("latin-1"))
    elif case == "csv_binary":
        path.write_bytes(b"\x00\x01\x02" * 50)
    elif case == "csv_unknown_column":
        path.write_text("a,b,label\n1,2,0\n3,4,1\n")
    else:
        raise AssertionError(case)
    return path


# case -> (the path of the problem, what its message says)
CASES = {
    "npz_missing": ("dataset.source.path", "not found"),
    "npz_directory": ("dataset.source.path", "is a directory, not a data file"),
    "txt_extension": ("dataset.source.path", "is not a .npz, .npy or .csv file"),
    "npz_garbage": ("dataset.source.path", "is not a .npz (a zip of .npy arrays"),
    "npz_truncated": ("dataset.source.path", "cannot read"),
    "npz_truncated_end": ("dataset.source.path", "cannot read"),
    "npz_member_is_a_pickle": ("dataset.source.path", "must be .npy arrays inside"),
    "npz_missing_key": ("dataset.source.features_key", "has no array 'x'"),
    "npz_scalars": ("dataset.source.path", "features need the shape (examples, features"),
    "npz_1d_features": ("dataset.source.path", "got (12,) and (12,)"),
    "npz_rows_differ": ("dataset.source.path", "12 feature rows and 11 targets"),
    "npz_no_rows": ("dataset.source.path", "must match and not be empty"),
    "npz_no_features": ("dataset.source.path", "the examples have no features"),
    "npz_complex": ("dataset.source.path", "dtype complex128; they must be real numbers"),
    "npz_strings": ("dataset.source.path", "dtype <U32; they must be real numbers"),
    "npz_bool": ("dataset.source.path", "dtype bool; they must be real numbers"),
    "npz_datetime": ("dataset.source.path", "dtype datetime64[D]"),
    "npz_nan_feature": ("dataset.source.path", "1 NaN or infinite value(s)"),
    "npz_inf_target": ("dataset.source.path", "the first in row 7"),
    "npz_beyond_float32": ("dataset.source.path", "beyond float32's range"),
    "npz_negative_labels": ("dataset.source.task", "whole, non-negative class labels"),
    "npz_huge_label": ("model.hidden", "100000000001 outputs"),
    "npy_garbage": ("dataset.source.path", "is not a .npy"),
    "npy_truncated": ("dataset.source.path", "cannot read"),
    "npy_object_array": ("dataset.source.path", "Object arrays cannot be loaded"),
    "npy_3d": ("dataset.source.path", "must be a 2-D table"),
    "npy_one_column": ("dataset.source.path", "at least 2 columns"),
    "csv_ragged": ("dataset.source.path", "the number of columns changed"),
    "csv_text_cell": ("dataset.source.path", "could not convert string 'x'"),
    "csv_empty": ("dataset.source.path", "has no data rows"),
    "csv_header_only": ("dataset.source.path", "has no data rows"),
    "csv_not_utf8": ("dataset.source.path", "UnicodeDecodeError"),
    "csv_binary": ("dataset.source.path", "is not a .csv"),
    "csv_unknown_column": ("dataset.source.target_column", "no column named 'lable'"),
}


def _override(path: Path, case: str) -> list[str]:
    extra = ", task: classification" if case == "npz_negative_labels" else ""
    extra += ", target_column: lable" if case == "csv_unknown_column" else ""
    return [f"dataset.source={{kind: file, path: '{path}'{extra}}}", "model.hidden=[4]"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_data_file_is_a_clear_config_error(case, tmp_path, validate):
    path = _write(tmp_path, case)
    outcome = validate(_config(tmp_path), *_override(path, case))
    field, says = CASES[case]
    assert outcome.exit_code == 2, outcome.stderr
    found = [p for p in outcome.problems if p["path"] == field]
    assert found and says in found[0]["message"], outcome.problems
    if field == "dataset.source.path" and case != "npz_missing":
        assert path.name in found[0]["message"]  # which file


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(block_yaml(VALID))
    return path


def test_an_unreadable_data_file(tmp_path, validate, monkeypatch):
    path = tmp_path / "d.npz"
    _npz(path, x=X, y=Y)
    path.chmod(0)
    if os.geteuid() == 0:  # root reads anything: fail the read as it fails for a user
        real_open = open

        def refusing(file, *args, **kwargs):
            if Path(file) == path:
                raise PermissionError(errno.EACCES, "Permission denied", str(file))
            return real_open(file, *args, **kwargs)
        monkeypatch.setattr(sources, "open", refusing, raising=False)
    outcome = validate(_config(tmp_path), *_override(path, "npz"))
    assert outcome.exit_code == 2
    assert "cannot read" in outcome.problems[0]["message"] and \
        "Permission denied" in outcome.problems[0]["message"]
    assert "permissions" in outcome.problems[0]["hint"]


def test_a_pickled_object_array_is_not_executed(tmp_path, validate):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    path = tmp_path / "d.npy"
    np.save(path, np.array([Payload(), 1], dtype=object), allow_pickle=True)
    np.load(path, allow_pickle=True)  # the payload works: unpickling it writes the marker
    assert marker.exists()
    marker.unlink()
    outcome = validate(_config(tmp_path), *_override(path, "npy"))
    assert outcome.exit_code == 2 and not marker.exists()


@pytest.mark.parametrize("case", ["npz_nan_feature", "npz_truncated", "csv_ragged",
                                  "npz_missing"])
def test_data_errors_stop_train_before_it_starts(case, tmp_path, monkeypatch):
    path = _write(tmp_path, case)
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(app, ["train", str(_config(tmp_path)), *_override(path, case),
                                    "checkpoint.dir=ck", "--metrics", "m.jsonl"],
                              catch_exceptions=False)
    assert done.exit_code == 2 and "nothing ran" in done.stderr
    assert "dataset.source" in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""  # no run started, no step logged
    assert not (tmp_path / "m.jsonl").exists() and not (tmp_path / "ck").exists()
