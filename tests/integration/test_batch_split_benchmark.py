"""benchmarks/batch_split.py (even against balanced split) runs end to end, so that it
cannot rot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # the benchmark runs as a script

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_batch_split_benchmark_runs(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "batch_split.py"),
                           "--rounds", "2", "--steps", "3", "--warmup", "9", "--json",
                           str(tmp_path / "r.json")], capture_output=True, text=True,
                          timeout=280, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    cpu = result["sections"]["cpu_mlp_784_512_512"]
    assert set(cpu) == {"fastest_alone", "even", "balanced"}
    assert all(v["examples_per_s"] > 0 for v in cpu.values())
    assert cpu["even"]["shares"] == [128, 128] and sum(cpu["balanced"]["shares"]) == 256
    assert cpu["balanced"]["target"]["verdict"] == "too few rounds"  # 2 rounds: no interval
    assert "target balanced / fastest alone >= 1.0" in done.stdout
