"""benchmarks/offload.py runs end to end (its CPU section, quick) so that it cannot rot."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # the benchmark runs as a script

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_quick_offload_benchmark_writes_table_and_json(tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "offload.py"), "--quick", "--sections",
         "cpu", "gpu", "--cpu-model", "mlp512", "--bytes-per-pack", "100000",
         "--json", str(tmp_path / "r.json")],
        capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    for r in ("1", "2"):
        row = result["cpu"]["replicas"][r]
        assert row["buckets_per_replica"] == 4  # 0.4M parameters in 100 kB buckets: 4
        assert row["one_copy"]["ms"] > 0 and row["buckets"]["ratio"] > 0
        assert len(row["buckets"]["rounds_ms"]) == 2
    assert "buckets of 100,000 bytes vs one copy" in done.stdout
    if "gpu" not in result:  # no CUDA here: the section says so
        assert "gpu: no CUDA device here" in done.stdout
