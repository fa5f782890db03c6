"""benchmarks/gpu.py cannot rot on a machine without a GPU: its code runs here on tiny
models (``--device cpu``), its models are the sizes it names, and without CUDA it says
so and exits 0."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu.py"
_spec = importlib.util.spec_from_file_location("csrun_benchmark_gpu", _PATH)
gpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu)


def _parameters(name: str) -> int:
    with torch.device("meta"):  # no memory, no time
        return sum(p.numel() for p in gpu.MODELS[name][0]().parameters())


def test_the_models_are_the_sizes_the_issue_measured():
    assert _parameters("mlp4096") == 1024 * 4096 + 2 * 4096 * 4096 + 4096 * 10 + 3 * 4096 + 10
    assert _parameters("mlp512") == 784 * 512 + 512 * 512 + 512 * 10 + 512 + 512 + 10
    assert 11.6e6 < _parameters("resnet18") < 11.8e6  # torchvision's resnet18: 11.69M
    assert 26e6 < _parameters("transformer") < 28e6
    with torch.device("meta"):
        out = gpu.MODELS["resnet18"][0]()(torch.empty(2, 3, 112, 112))
        tokens = gpu.MODELS["transformer"][1](2, torch.Generator())[0]
        assert gpu.MODELS["transformer"][0]()(tokens.to("meta")).shape == (2, 10)
    assert out.shape == (2, 1000)


@pytest.fixture
def one_thread():
    """Tiny convolutions on two OpenMP threads of a busy machine crawl; one is enough."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_its_code_runs_on_a_cpu(tmp_path, capsys, one_thread):
    path = tmp_path / "gpu.json"
    assert gpu.main(["--device", "cpu", "--quick", "--models", "mlp512", "transformer",
                     "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert set(result["models"]) == {"mlp512", "transformer"}
    for model in result["models"].values():
        assert set(model["variants"]) == set(gpu.VARIANTS)
        assert model["variants"]["plain"]["ratio_vs_plain"] == 1.0
        assert all(v["step_ms"] > 0 for v in model["variants"].values())
        assert model["cpu_adam_ms"]["fused"] > 0 and model["cpu_adam_ms"]["foreach"] > 0
    assert result["large_model"]["plain"] == "trained"  # uncapped on a CPU
    assert result["large_model"]["csrun_cpu_params_step_ms"] > 0
    assert [t["verdict"] for t in result["targets"]] == ["too few rounds"] * 2
    out = capsys.readouterr().out
    assert "csrun_cpu_params" in out and "target transformer csrun_gpu_params / plain" in out


def test_without_cuda_it_says_so_and_exits_0(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path = tmp_path / "gpu.json"
    assert gpu.main(["--json", str(path)]) == 0
    assert "no CUDA device here" in capsys.readouterr().out
    assert "no CUDA" in json.loads(path.read_text())["skipped"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_one_quick_model(tmp_path):
    path = tmp_path / "gpu.json"
    assert gpu.main(["--quick", "--models", "mlp512", "--cap-gib", "0",
                     "--json", str(path)]) == 0
    model = json.loads(path.read_text())["models"]["mlp512"]
    assert set(model["peak_gpu_mib"]) == set(gpu.VARIANTS)
    assert model["pcie_bound_ms"] > 0 and model["cpu_params_vs_floor"] > 0


def test_it_runs_offloads_gpu_section(monkeypatch):
    calls = []
    monkeypatch.setattr(gpu.offload, "offload_section",
                        lambda rounds, steps: calls.append((rounds, steps)) or {
                            "device": "x", "target": 1.2, "models": {}})
    monkeypatch.setattr(gpu, "measure_model", lambda *a: {})
    monkeypatch.setattr(gpu, "pcie_bandwidth", lambda: None)
    monkeypatch.setattr(gpu, "judge", lambda result: [])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "x")
    args = gpu.argparse.Namespace(device="cuda", rounds=3, steps=4, models=[], cap_gib=None,
                                  offload=True)
    result = gpu.measure(args)
    assert calls == [(3, 4)] and result["offload"]["target"] == 1.2
    assert "target csrun <= 1.2x" in gpu.report(result)
