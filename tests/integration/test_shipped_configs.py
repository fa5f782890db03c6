"""Every shipped config validates; the CPU ones train end to end; GPU ones on a GPU."""

import json
import re
from pathlib import Path

import pytest
import torch
import yaml

from csrun.core.runner.preflight import load_config
from csrun.core.config.problems import ConfigError
from csrun.core.runner.train import train

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.yaml"))
NAMES = [c.stem for c in CONFIGS]
# One task's view of a loopback cluster, for validating parameter-server configs.
TF_CONFIG = json.dumps({"cluster": {"worker": ["127.0.0.1:2223", "127.0.0.1:2224"],
                                    "ps": ["127.0.0.1:2222"]},
                        "task": {"type": "worker", "index": 0}})


def is_parameter_server(path: Path) -> bool:
    strategy = yaml.safe_load(path.read_text()).get("strategy") or {}
    return strategy.get("kind") == "parameter_server"


PS_CONFIGS = [c for c in CONFIGS if is_parameter_server(c)]


def gpus_needed(path: Path) -> int:
    devices = (yaml.safe_load(path.read_text()).get("strategy") or {}).get("compute_devices")
    if devices is None:  # TF's default: every GPU; the header says how many it needs
        match = re.search(r"Needs: (one|two|\d+)", path.read_text())
        return {"one": 1, "two": 2}.get(match.group(1), 0) if match else 0
    return sum(1 for d in devices if d.upper().startswith(("GPU", "CUDA", "/GPU")))


def test_there_are_examples_of_each_kind():
    assert {"quickstart", "single_device", "per_replica", "mixed_cpu_gpu",
            "multi_gpu", "ps_local"} <= set(NAMES)


@pytest.mark.parametrize("path", CONFIGS, ids=NAMES)
def test_header_says_what_it_shows_needs_and_how_to_run_it(path):
    header = path.read_text().split("\n\n")[0] + path.read_text().split("\n\n")[1]
    assert f"csrun train configs/{path.name}" in header
    assert "Shows:" in header and "Needs:" in header


def names_gpus(path: Path) -> bool:
    strategy = yaml.safe_load(path.read_text()).get("strategy") or {}
    return gpus_needed(path) > 0 and strategy.get("compute_devices") is not None


@pytest.mark.parametrize("path", CONFIGS, ids=NAMES)
def test_shipped_config_validates(path):
    if is_parameter_server(path):  # a cluster task: valid with a TF_CONFIG, not without
        load_config(path, environ={"TF_CONFIG": TF_CONFIG})
        with pytest.raises(ConfigError) as info:
            load_config(path, environ={})
        (problem,) = info.value.problems
        assert problem.path == "strategy.cluster" and "csrun launch" in problem.hint
        return
    if not names_gpus(path) or gpus_needed(path) <= torch.cuda.device_count():
        load_config(path)  # TF's default placement is valid anywhere (CPU:0 without GPUs)
        return
    with pytest.raises(ConfigError) as info:  # no GPU here: only the devices may be wrong
        load_config(path)
    assert all(p.path.startswith("strategy") or "GPU" in p.message
               for p in info.value.problems), info.value
    load_config(path, ["strategy.compute_devices=[CPU:0,CPU:1]"])


@pytest.mark.process
@pytest.mark.parametrize("path", [c for c in CONFIGS if gpus_needed(c) == 0 and
                                  c.stem != "quickstart" and c not in PS_CONFIGS],
                         ids=lambda c: c.stem)
def test_cpu_config_trains_end_to_end(path, csrun, tmp_path):
    done = csrun("train", path, "--json", "r.json")
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["status"] == "completed" and result["metrics"]["eval_accuracy"] > 0.9


@pytest.mark.process
@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", PS_CONFIGS, ids=lambda c: c.stem)
def test_parameter_server_config_trains_via_launch(path, csrun, tmp_path):
    """1 ps + 2 workers as the header says: the loss falls, every task exits 0, the
    variables live on the ps, both workers' updates reach it, the holdout is learnt."""
    header = path.read_text().split("\n\n")[0]
    assert f"csrun launch configs/{path.name} --workers 2 --ps 1" in header
    done = csrun("launch", path, "--workers", "2", "--ps", "1", "--json", "r.json",
                 "--logs", "logs", timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr
    launched = json.loads((tmp_path / "r.json").read_text())
    assert launched["status"] == "completed" and launched["chief"] == "worker:0"
    assert {t["task"]: t["exit_code"] for t in launched["tasks"]} == \
        {"ps:0": 0, "worker:0": 0, "worker:1": 0}
    result = launched["result"]
    losses = result["losses"]
    assert sum(losses[-10:]) < 0.25 * sum(losses[:10])
    assert result["metrics"]["eval_accuracy"] > 0.9, result["metrics"]
    cluster = result["cluster"]
    assert set(cluster["variables"].values()) == {"/job:ps/replica:0/task:0/device:CPU:0"}
    assert cluster["updates"] == {"worker:0": result["steps"], "worker:1": result["steps"]}
    assert cluster["global_step"] == 2 * result["steps"] and cluster["lost_workers"] == []
    assert "[worker:1]" in done.stdout and "csrun launch: completed" in done.stdout


@pytest.mark.process
def test_quickstart_trains_to_a_meaningful_accuracy(csrun, tmp_path):
    """(How long it takes, against the README's "under a minute": benchmarks/
    shipped_configs.py.)"""
    done = csrun("train", CONFIGS[NAMES.index("quickstart")], "--json", "q.json")
    assert done.returncode == 0, done.stderr
    result = json.loads((tmp_path / "q.json").read_text())
    assert result["strategy"]["compute_devices"] == ["CPU:0", "CPU:1"]
    assert result["metrics"]["eval_accuracy"] > 0.9, result["metrics"]
    assert "held out: accuracy" in done.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("path", [c for c in CONFIGS if gpus_needed(c) > 0],
                         ids=lambda c: c.stem)
def test_gpu_config_trains_on_gpus(path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if gpus_needed(path) > torch.cuda.device_count():
        pytest.skip(f"needs {gpus_needed(path)} GPUs, {torch.cuda.device_count()} here")
    result = train(load_config(path, ["train.epochs=2"]))
    assert result.status == "completed" and result.metrics["eval_accuracy"] > 0.5
