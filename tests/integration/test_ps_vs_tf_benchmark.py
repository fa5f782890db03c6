"""benchmarks/ps_vs_tf.py (csrun's parameter servers against TensorFlow's): its data are
the same for both frameworks and each worker's share is its part of every global batch;
bad arguments are refused before anything starts; at tiny size its csrun side runs end
to end and says plainly when TensorFlow is not measured. (Its TensorFlow side needs a
Python with tensorflow, which the test environment has not.)"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "ps_vs_tf.py"


def bench():
    spec = importlib.util.spec_from_file_location("ps_vs_tf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_data_repeat_and_each_worker_reads_its_part_of_every_global_batch(tmp_path):
    b = bench()
    tables, hotness = [50, 20, 9, 16], [3, 2, 2, 1]
    data = b.examples(tables, hotness, 24, 1.1, seed=3)
    again = b.examples(tables, hotness, 24, 1.1, seed=3)
    assert all(np.array_equal(data[k], again[k]) for k in data)
    for t, (rows, most) in enumerate(zip(tables, hotness)):
        ids, lengths = data[f"ids{t}"], data[f"len{t}"]
        assert ids.shape == (24, most) and 0 <= ids.min() and ids.max() < rows
        assert 1 <= lengths.min() and lengths.max() <= most
        assert not ids[np.arange(most)[None, :] >= lengths[:, None]].any()  # padding is 0
    b.write_shares(tmp_path, data, batch=8, workers=2)
    shares = [b.read_share(tmp_path / f"w{w}", 4, hotness) for w in range(2)]
    for k in data:  # batch i of worker w: examples 8i + 4w .. 8i + 4w + 3
        rebuilt = np.concatenate([np.concatenate([s[k][4 * i:4 * i + 4] for s in shares])
                                  for i in range(3)])
        assert np.array_equal(rebuilt, data[k]), k


@pytest.mark.parametrize("argv, message", [
    (["--grid", "2"], "--grid: cells are WORKERSxPS"),
    (["--grid", "0x1"], "needs a worker and a ps"),
    (["--grid", "3x1", "--batch", "64"], "does not split over 3 workers"),
    (["--hotness", "1,2"], "--hotness: 4 counts"),
    (["--warmup", "0"], "--warmup must be at least 1"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        bench().main(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_spy_without_py_spy_is_refused_before_any_task_starts(tmp_path, monkeypatch, capsys):
    # a spy that failed to start once left its job's tasks running: now nothing starts
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(SystemExit) as exited:
        bench().main(["--spy", str(tmp_path / "spy")])
    assert exited.value.code == 2
    assert "--spy needs py-spy" in capsys.readouterr().err
    assert not (tmp_path / "spy").exists()


def test_tfs_lookup_form_reaches_its_tasks_and_only_the_two_forms_are_taken(capsys):
    b = bench()
    with pytest.raises(SystemExit):
        b.main(["--tf-form", "dense"])
    assert "invalid choice: 'dense'" in capsys.readouterr().err
    args = argparse.Namespace(tables=[4, 4, 4, 4], hotness=[1, 1, 1, 1], batch=8, steps=1,
                              warmup=1, lr=0.1, shards=2, tf_form="padded", profile=None)
    argv = b.task_argv("python", "tf-chief", args, 2, [])
    assert argv[argv.index("--tf-form") + 1] == "padded"


def test_without_tf_python_tensorflow_is_not_measured_and_it_says_so():
    version, note = bench().tf_available(None)
    assert version is None and "no --tf-python given" in note


@pytest.mark.process
def test_a_python_without_tensorflow_is_said_plainly(tmp_path):
    b = bench()
    version, note = b.tf_available(str(tmp_path / "no-python"))
    assert version is None and note.startswith("TensorFlow not measured:")
    version, note = b.tf_available(sys.executable)  # the test venv has no tensorflow
    assert version is None and "cannot import tensorflow" in note


@pytest.mark.process
@pytest.mark.timeout(600)
def test_the_csrun_side_runs_at_tiny_size_and_reports_tf_not_measured(tmp_path):
    out = tmp_path / "r.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--grid", "2x1",
                           "--steps", "3", "--json", str(out)],
                          capture_output=True, text=True, timeout=560, cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "TensorFlow not measured: no --tf-python given" in done.stdout
    result = json.loads(out.read_text())
    assert result["tensorflow"] is None and result["settings"]["tables"] == [4000, 400, 100, 60]
    assert isinstance(result["environment"], dict) and result["machine"]
    [pair] = result["cells"]["2x1"]["rounds"]
    assert set(pair) == {"csrun"}
    run = pair["csrun"]
    assert run["examples_per_s"] > 0 and run["load_before"] >= 0 and run["load_after"] >= 0
    assert [t["verdict"] for t in result["targets"]] == ["TensorFlow not measured"]
