"""The throughput benchmark runs end to end (a quick run) and writes what the docs read."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process  # the benchmarks run as scripts

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_quick_benchmark_writes_table_and_json(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--quick",
                           "--models", "mlp", "deep", "--replicas", "1", "2", "--reference", "--json",
                           str(tmp_path / "r.json"), "--plot", str(tmp_path / "p.png")],
                          capture_output=True, text=True, timeout=280, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "csrun_R2" in done.stdout and "engine overhead" in done.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    mlp = result["models"]["mlp"]
    assert set(mlp) == {"plain", "csrun_R1", "csrun_R2", "hand_R2"}
    assert set(result["models"]["deep"]) == set(mlp)
    assert mlp["plain"]["ratio_vs_plain"] == 1.0
    assert all(v["examples_per_s"] > 0 for v in mlp.values())
    assert set(result["engine_overhead_us"]) == {"R1", "R2"}
    assert all(0 < result["engine_overhead_best_us"][k] <= v
               for k, v in result["engine_overhead_us"].items())
    assert result["input_path_R2"]["csrun"]["examples_per_s"] > 0
    # two rounds cannot give a 95% interval: every target says so instead of a verdict
    judged = {t["what"]: t for t in result["targets"]}
    best = {"engine overhead R1, best of 2 rounds (µs per step)",
            "engine overhead R2, best of 2 rounds (µs per step)"}
    assert set(judged) == {"mlp csrun_R1 / plain", "mlp csrun_R2 / plain",
                           "engine overhead R2 (µs per step)"} | best
    assert all(t["ci95"] is None and t["verdict"] == "too few rounds"
               for what, t in judged.items() if what not in best)
    assert all(judged[what]["verdict"] in ("met", "missed") for what in best)
    assert len(result["engine_overhead_rounds_us"]["R2"]) == 2
    assert "target mlp csrun_R2 / plain >= 0.95" in done.stdout
    assert "TensorFlow's CentralStorageStrategy" in done.stdout


@pytest.mark.timeout(300)
def test_plain_check_and_clean_env_run(tmp_path):
    """--plain-check times the plain loop in fresh processes; --clean-env drops the
    OpenMP variables a user would not set (and the report names any that stay set)."""
    import os
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    args = [sys.executable, str(ROOT / "benchmarks" / "throughput.py"), "--quick", "--models",
            "mlp", "--replicas", "2", "--plain-check", "1", "--json", str(tmp_path / "r.json"),
            "--plot", str(tmp_path / "p.png")]
    dirty = subprocess.run(args, capture_output=True, text=True, timeout=280, cwd=tmp_path,
                           env=env)
    assert dirty.returncode == 0, dirty.stderr
    assert "NOTE: measured with {'OMP_WAIT_POLICY': 'PASSIVE'}" in dirty.stdout
    clean = subprocess.run(args + ["--clean-env"], capture_output=True, text=True,
                           timeout=280, cwd=tmp_path, env=env)
    assert clean.returncode == 0, clean.stderr
    assert "NOTE" not in clean.stdout
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["environment"] == {}
    check = result["plain_after_csrun"]
    assert len(check["ratios"]) == 1 and check["ratio"] > 0
    assert "plain loop after csrun / alone" in {t["what"] for t in result["targets"]}


def test_runner_overhead_benchmark_runs(tmp_path):
    """benchmarks/runner_overhead.py in a tiny mode, so that it cannot rot."""
    import importlib.util
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "runner_overhead.py"
    spec = importlib.util.spec_from_file_location("runner_overhead", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--rounds", "1", "--steps", "3", "--json", str(tmp_path / "o.json")]) == 0
    result = json.loads((tmp_path / "o.json").read_text())
    assert result["median_ratio"] > 0 and result["target"] == 1.05
    assert result["ci95"] is None and result["verdict"] == "too few rounds"  # 1 round
    assert module.main(["--processes", "2", "--rounds", "1", "--steps", "2", "--json",
                        str(tmp_path / "p.json")]) == 0
    pooled = json.loads((tmp_path / "p.json").read_text())
    assert [row["process"] for row in pooled["rounds"]] == [0, 1]
    assert len(pooled["process_medians"]) == 2
    # pooled rounds look independent; processes differ more: every process must agree
    assert module.pooled_verdict((1.00, 1.03), [1.01, 1.02]) == "met"
    assert module.pooled_verdict((1.00, 1.03), [1.01, 1.06]) == "inconclusive"
    assert module.pooled_verdict((1.06, 1.08), [1.07, 1.04]) == "inconclusive"
    assert module.pooled_verdict((1.06, 1.08), [1.07]) == "missed"


def _benchmark(tmp_path, script, *args):
    """Run benchmarks/SCRIPT with ``args`` and ``--json``: its JSON result."""
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *args, "--json",
                           str(tmp_path / "r.json")], capture_output=True, text=True,
                          timeout=280, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    return json.loads((tmp_path / "r.json").read_text()), done.stdout


@pytest.mark.timeout(300)
def test_soak_benchmark_runs(tmp_path):
    """benchmarks/soak.py (the soaks' step time) in a short mode, so that it cannot rot."""
    result, out = _benchmark(tmp_path, "soak.py", "--steps", "50")
    assert [loop["loop"] for loop in result["loops"]] == ["engine", "runner"]
    for loop in result["loops"]:
        assert loop["early_ms"] > 0 and loop["late_ms"] > 0 and loop["target"] == "< 1.5"
        assert loop["verdict"] == ("met" if loop["slowdown"] < 1.5 else "missed")
    assert "reference steps" in out


@pytest.mark.timeout(300)
def test_bad_configs_benchmark_runs(tmp_path):
    """benchmarks/bad_configs.py (how long a refusal takes) in its quick mode."""
    result, out = _benchmark(tmp_path, "bad_configs.py", "--quick")
    names = [case["case"] for case in result["cases"]]
    assert any(n.startswith("corpus/") for n in names) and "alias bomb 12**14" in names
    assert "nesting '[' x20000" in names
    assert {case["exit_code"] for case in result["cases"]} <= {0, 2}
    assert result["slowest"]["seconds"] == max(case["seconds"] for case in result["cases"])
    assert result["target_s"] == 10.0 and "target < 10 s each" in out


@pytest.mark.timeout(300)
def test_shipped_configs_benchmark_runs(tmp_path):
    """benchmarks/shipped_configs.py (each shipped config's time) on the quickstart."""
    result, out = _benchmark(tmp_path, "shipped_configs.py", "--configs", "quickstart")
    [row] = result["configs"]
    assert row["config"] == "quickstart" and row["command"] == "train quickstart.yaml"
    assert row["seconds"] > 0 and result["target_s"] == 60.0
    assert "quickstart: " in out and "target < 60 s" in out


@pytest.mark.timeout(300)
def test_data_parallel_benchmark_runs(tmp_path):
    """benchmarks/data_parallel.py (DataParallel vs plain, strategy.run, DDP) in a tiny
    mode, so that it cannot rot."""
    result, out = _benchmark(tmp_path, "data_parallel.py", "--rounds", "2", "--steps", "2")
    assert {"plain", "data_parallel", "strategy_run", "ddp"} <= set(result["variants"])
    assert all(v["examples_per_s"] > 0 for v in result["variants"].values())
    assert result["target"]["data_parallel >="] == 0.85
    assert "data_parallel / strategy_run" in out


@pytest.mark.timeout(300)
def test_ps_embeddings_benchmark_runs(tmp_path):
    """benchmarks/ps_embeddings.py (embedding tables on parameter servers) with tiny
    tables, so that it cannot rot: every measure's figures, the bound, the targets."""
    result, out = _benchmark(tmp_path, "ps_embeddings.py", "--quick", "--grid", "1x1")
    rows_served = result["features"]["serve_embedding_rows"]
    assert set(result) >= {"date", "command", "machine", "bytes", "speed", "links", "memory",
                           "targets"}
    for measure in ("bytes", "speed", "memory"):
        dense = result[measure]["dense"]
        assert dense["examples_per_s"] > 0 and dense["bytes_per_step"] > 0
        # whole tables move far more than the rows a step touches
        assert dense["bytes_per_step"] > dense["bound_bytes_per_step"] > 0
        assert 0 < dense["unique_rows_per_step"] <= dense["lookups_per_step"]
        assert dense["worker_memory"]["peak"] >= dense["worker_memory"]["steady"] > 0
        rows = result[measure]["rows"]
        if rows_served:
            assert rows["examples_per_s"] > 0 and rows["bytes_per_step"] > 0
            assert rows["bound_bytes_per_step"] > 0 and rows["bytes_source"] == "transfer_stats"
        else:
            assert "serve_embedding_rows" in rows["skipped"]
    assert result["memory"]["dense"]["tables"] == [8389]  # 8,388,608 rows x --quick's 0.001
    links = result["links"]
    if "skipped" not in links:
        [cell] = links["rows"]
        assert (cell["workers"], cell["ps"]) == (1, 1)
        assert cell["bound_examples_per_s"] > 0 and cell["of_bound"] > 0
    judged = {t["what"]: t for t in result["targets"]}
    assert len(judged) == 2
    for t in judged.values():
        assert t["verdict"] in ("met", "missed") if rows_served else t["value"] is None
    assert "target examples/s rows served / whole tables (1M x 32) >= 20" in out


@pytest.mark.timeout(300)
def test_only_engine_measures_the_engine_alone(tmp_path):
    """--only engine: the engine's cost per empty step and its targets, nothing else
    (no models, no input path, no chart), as issue 36's figures are re-measured."""
    result, out = _benchmark(tmp_path, "throughput.py", "--quick", "--only", "engine",
                             "--replicas", "1", "2")
    assert result["only"] == "engine" and result["models"] == {}
    assert "input_path_R2" not in result and not (tmp_path / "docs").exists()
    assert [len(result["engine_overhead_rounds_us"][k]) for k in ("R1", "R2")] == [2, 2]
    best = {t["what"] for t in result["targets"] if t.get("stat") == "best"}
    assert best == {"engine overhead R1, best of 2 rounds (µs per step)",
                    "engine overhead R2, best of 2 rounds (µs per step)"}
    assert "engine overhead per step" in out and "target engine overhead R2" in out
