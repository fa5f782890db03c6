"""csrun on a GPU against plain PyTorch on the same GPU, side by side in one process.

For each model (an MLP 1024-4096x3 at batch 1024, an MLP 784-512-512 at batch 256, a
ResNet-18-sized conv net at batch 64 and 112 px, a 6-layer 512-wide transformer), in
interleaved rounds, synchronized (``torch.cuda.synchronize()`` around every timed block):

* ``plain``: the model ``.to("cuda")``, Adam, the usual loop;
* ``csrun_gpu_params``: one GPU replica, parameters on the GPU (TF's default with one GPU);
* ``csrun_cpu_params``: one GPU replica, parameters on the CPU (TF's default with 2+ GPUs,
  and how a model larger than the GPU trains), Adam ``fused=True`` on the CPU;

each variant's step time, its ratio to plain in the same round (median and 95% interval
over rounds), and its peak GPU memory. Measured in the same run: the PCIe bound (the
model's parameters to the GPU and its gradients back, at the pinned bandwidth measured
now) and the CPU optimizer alone (torch's Adam, ``foreach`` and ``fused=True``, on CPU
parameters). Last, a model whose parameters and Adam state exceed a GPU memory cap
(``torch.cuda.set_per_process_memory_fraction``) trains with its parameters on the CPU
(in a child process, so the cap binds nothing else).

    python benchmarks/gpu.py                      # all models, JSON to benchmarks/gpu.json
    python benchmarks/gpu.py --models mlp4096 --rounds 21
    python benchmarks/gpu.py --device cpu --quick # no GPU: the same code on tiny models

Without CUDA (and without ``--device cpu``) it says so and exits 0 having measured
nothing; the JSON then holds ``{"skipped": ...}``. Targets (issue 36): one GPU replica with
parameters on the GPU >= 0.97x plain on every model.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import csrun.core as cs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from targets import GPU_REPLICA_TARGET, median_interval, verdict  # noqa: E402
import offload  # noqa: E402  (its GPU section: parameters and Adam on the CPU)

NO_CUDA = ("no CUDA device here: nothing to measure (benchmarks/gpu.py measures csrun on a "
           "GPU; --device cpu runs the same code on tiny models, as a smoke test)")


# -- models ------------------------------------------------------------------------------
class BasicBlock(nn.Module):
    """ResNet's two 3x3 convolutions with BatchNorm and a shortcut."""

    def __init__(self, inp: int, out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(inp, out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out)
        self.conv2 = nn.Conv2d(out, out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out)
        self.short = nn.Sequential()
        if stride != 1 or inp != out:
            self.short = nn.Sequential(nn.Conv2d(inp, out, 1, stride, bias=False),
                                       nn.BatchNorm2d(out))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(y)) + self.short(x))


def resnet18(classes: int = 1000, width: int = 64) -> nn.Module:
    """ResNet-18's layout (torchvision's, written out: torchvision may be absent)."""
    layers = [nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
              nn.MaxPool2d(3, 2, 1)]
    inp = width
    for i, out in enumerate([width, 2 * width, 4 * width, 8 * width]):
        layers += [BasicBlock(inp, out, 1 if i == 0 else 2), BasicBlock(out, out, 1)]
        inp = out
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(inp, classes)]
    return nn.Sequential(*layers)


class Transformer(nn.Module):
    """Token embedding, pre-norm encoder layers (dropout 0.1), mean-pooled class head."""

    def __init__(self, vocab: int, width: int, layers: int, classes: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, max(1, width // 64), 4 * width,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def mlp(sizes: list[int]) -> nn.Module:
    layers: list = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


# name -> (build, batch(batch_size, generator) -> (x, y), batch size); "tiny" for --device cpu
def _image(size: int):
    return lambda n, g: (torch.randn(n, 3, size, size, generator=g),
                         torch.randint(0, 1000, (n,), generator=g))


def _features(width: int, classes: int):
    return lambda n, g: (torch.randn(n, width, generator=g),
                         torch.randint(0, classes, (n,), generator=g))


def _tokens(vocab: int, length: int, classes: int):
    return lambda n, g: (torch.randint(0, vocab, (n, length), generator=g),
                         torch.randint(0, classes, (n,), generator=g))


MODELS = {
    "mlp4096": (lambda: mlp([1024, 4096, 4096, 4096, 10]), _features(1024, 10), 1024),
    "mlp512": (lambda: mlp([784, 512, 512, 10]), _features(784, 10), 256),
    "resnet18": (lambda: resnet18(), _image(112), 64),
    "transformer": (lambda: Transformer(16000, 512, 6, 10), _tokens(16000, 128, 10), 32),
}
TINY = {
    "mlp4096": (lambda: mlp([16, 32, 32, 32, 10]), _features(16, 10), 8),
    "mlp512": (lambda: mlp([12, 8, 8, 10]), _features(12, 10), 8),
    "resnet18": (lambda: resnet18(classes=1000, width=4), _image(16), 4),
    "transformer": (lambda: Transformer(50, 16, 2, 10), _tokens(50, 8, 10), 4),
}


# -- the loops ---------------------------------------------------------------------------
def _data(spec: tuple, steps: int, device: str) -> list:
    _, batch, size = spec
    g = torch.Generator().manual_seed(0)
    return [tuple(t.to(device) for t in batch(size, g)) for _ in range(steps)]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out, y, reduction="sum") / len(y)


def plain_loop(build: Callable, data: list, device: str) -> Callable[[], None]:
    """The usual loop: the model on the device, Adam (torch's default kernels there)."""
    torch.manual_seed(0)
    model = build().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)

    def run() -> None:
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            _loss(model(x), y).backward()
            opt.step()
    return run


def csrun_loop(build: Callable, data: list, compute: str, parameter: str,
               copy: bool = False, **adam) -> Callable[[], None]:
    """One replica on ``compute``, parameters on ``parameter``; the loss reduced as a
    user of ``strategy.run`` does."""
    strategy = cs.CentralStorageStrategy([compute], parameter,
                                         options=cs.StrategyOptions(copy_parameters=copy))
    torch.manual_seed(0)
    with strategy.scope():
        model = build()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, **adam)

    def replica(x, y):
        loss = _loss(model(x), y)
        loss.backward()
        return loss.detach()

    def run() -> None:
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            strategy.reduce("SUM", strategy.run(replica, args=(x, y)))
            opt.step()
    return run


VARIANTS = ("plain", "csrun_gpu_params", "csrun_cpu_params")


def make_variant(name: str, build: Callable, data: list, device: str) -> Callable[[], None]:
    """One of :data:`VARIANTS`. On a CPU machine the parameters "on the CPU" take the copy
    path (``copy_parameters=True``), the path GPU replicas take, so its code runs."""
    gpu = device == "cuda"
    if name == "plain":
        return plain_loop(build, data, device)
    compute = "GPU:0" if gpu else "CPU:0"
    if name == "csrun_gpu_params":
        return csrun_loop(build, data, compute, compute)
    return csrun_loop(build, data, compute, "CPU:0", copy=not gpu, fused=True)


def variants(spec: tuple, data: list, device: str) -> dict[str, Callable[[], None]]:
    return {name: make_variant(name, spec[0], data, device) for name in VARIANTS}


# -- timing ------------------------------------------------------------------------------
def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], None]) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def interleaved(loops: dict, steps: int, rounds: int) -> dict:
    """Each round runs every variant once, starting one variant later each round; per
    variant the median step time and the median (95% interval) of its paired ratio
    plain time / its time, round by round."""
    for fn in loops.values():  # warm-up: kernels, allocator, optimizer state, csrun's leaves
        fn()
    times: dict = {k: [] for k in loops}
    names = list(loops)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(timed(loops[name]) / steps)
    out = {}
    for name, values in times.items():
        ratios = [p / v for p, v in zip(times["plain"], values)]
        out[name] = {"step_ms": 1e3 * statistics.median(values),
                     "ratio_vs_plain": statistics.median(ratios),
                     "ratio_ci95": median_interval(ratios)}
    return out


def peak_memory(spec: tuple, data: list, device: str) -> dict:
    """Each variant alone on the GPU: the most memory it held (MiB) over its warm-up and
    one pass ({} on a CPU)."""
    if device != "cuda":
        return {}
    peaks = {}
    for name in VARIANTS:
        gc.collect()  # the last variant's model, optimizer and strategy
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        loop = make_variant(name, spec[0], data, device)
        loop()
        loop()
        _sync()
        peaks[name] = torch.cuda.max_memory_allocated() / 2**20
        del loop
    return peaks


# -- the bounds --------------------------------------------------------------------------
def pcie_bandwidth(size: int = 256 << 20) -> dict:
    """GB/s host->device and device->host between pinned memory and the GPU (median of
    5 copies of ``size`` bytes)."""
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    out = {}
    for name, copy in (("h2d_GBps", lambda: dev.copy_(host, non_blocking=True)),
                       ("d2h_GBps", lambda: host.copy_(dev, non_blocking=True))):
        copy()
        out[name] = size / statistics.median(timed(copy) for _ in range(5)) / 1e9
    return out


def pcie_bound_ms(params: int, bandwidth: dict) -> float:
    """The least time a step with parameters on the CPU spends on the bus: every
    parameter to the GPU and every gradient back (fp32)."""
    size = 4 * params
    return 1e3 * (size / (bandwidth["h2d_GBps"] * 1e9) + size / (bandwidth["d2h_GBps"] * 1e9))


def cpu_adam_ms(build: Callable, repeats: int) -> dict:
    """torch's Adam alone on the model's CPU parameters (gradients in place): ``foreach``
    and ``fused=True``, median ms per step."""
    torch.manual_seed(0)
    model = build()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    out = {}
    for name, kind in (("foreach", {"foreach": True}), ("fused", {"fused": True})):
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, **kind)
        opt.step()  # its state made
        out[name] = 1e3 * statistics.median(timed(opt.step) for _ in range(repeats))
    return out


# -- a model bigger than the GPU allows ---------------------------------------------------
def large_model(width: int, layers: int, batch: int, steps: int, device: str,
                cap_bytes: int | None) -> dict:
    """An MLP whose parameters, gradients and Adam state (16 bytes a parameter) exceed
    ``cap_bytes`` of GPU memory, trained with its parameters on the CPU (the GPU holds a
    copy of the parameters and the gradients: 8 bytes a parameter), and the plain loop
    tried under the same cap. On a CPU (``device="cpu"``) the same code runs uncapped,
    through the copy path."""
    if cap_bytes is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total))
    build = lambda: mlp([width] * (layers + 1))  # noqa: E731
    params = (width * width + width) * layers
    data = _data((build, _features(width, width), batch), steps, device)
    out = {"params": params, "adam_state_and_grads_gib": 16 * params / 2**30,
           "cap_gib": None if cap_bytes is None else cap_bytes / 2**30}
    loop = make_variant("csrun_cpu_params", build, data, device)
    loop()  # warm-up: state, pinned buffers
    out["csrun_cpu_params_step_ms"] = 1e3 * timed(loop) / steps
    if device == "cuda":
        out["csrun_cpu_params_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    del loop
    gc.collect()
    out["plain"] = _try_plain(build, data, device)
    return out


def _try_plain(build: Callable, data: list, device: str) -> str:
    """Whether the plain loop trains under the cap ("out of memory" is the expected)."""
    if device == "cuda":
        torch.cuda.empty_cache()
    try:
        loop = plain_loop(build, data, device)
        loop()
        _sync()
    except torch.OutOfMemoryError:
        return "out of memory"
    return "trained"


# -- the run -----------------------------------------------------------------------------
def measure_model(name: str, spec: tuple, device: str, rounds: int, steps: int,
                  bandwidth: dict | None) -> dict:
    data = _data(spec, steps, device)
    params = sum(p.numel() for p in spec[0]().parameters())
    out: dict = {"params": params, "batch": spec[2]}
    out["peak_gpu_mib"] = peak_memory(spec, data, device)
    gc.collect()
    out["variants"] = interleaved(variants(spec, data, device), steps, rounds)
    out["cpu_adam_ms"] = cpu_adam_ms(spec[0], repeats=max(3, rounds))
    if bandwidth is not None:
        out["pcie_bound_ms"] = pcie_bound_ms(params, bandwidth)
        # what a step with parameters on the CPU cannot beat: the GPU's own step, the bus,
        # or the CPU optimizer, whichever is longest (they can overlap, not shrink)
        floor = max(out["variants"]["plain"]["step_ms"], out["pcie_bound_ms"],
                    out["cpu_adam_ms"]["fused"])
        out["cpu_params_floor_ms"] = floor
        out["cpu_params_vs_floor"] = out["variants"]["csrun_cpu_params"]["step_ms"] / floor
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def judge(result: dict) -> list[dict]:
    """Issue 36's GPU target: one GPU replica with parameters on the GPU >= 0.97x plain."""
    out = []
    for name, model in result["models"].items():
        entry = model["variants"]["csrun_gpu_params"]
        out.append({"what": f"{name} csrun_gpu_params / plain",
                    "target": f">= {GPU_REPLICA_TARGET}", "median": entry["ratio_vs_plain"],
                    "ci95": entry["ratio_ci95"],
                    "verdict": verdict(entry["ratio_ci95"], GPU_REPLICA_TARGET, at_least=True)})
    return out


def measure(args) -> dict:
    device = args.device
    specs = TINY if device == "cpu" else MODELS
    result: dict = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu",
                    "torch": torch.__version__, "rounds": args.rounds,
                    "steps_per_round": args.steps, "models": {}}
    bandwidth = pcie_bandwidth() if device == "cuda" else None
    result["pcie"] = bandwidth
    for name in args.models:
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        result["models"][name] = measure_model(name, specs[name], device, args.rounds,
                                               args.steps, bandwidth)
    if args.cap_gib is not None:
        print("a model over the memory cap ...", file=sys.stderr, flush=True)
        result["large_model"] = capped_run(args)
    if device == "cuda" and args.offload:
        print("parameters on the CPU at PCIe speed (benchmarks/offload.py) ...",
              file=sys.stderr, flush=True)
        result["offload"] = offload.offload_section(args.rounds, args.steps)
    result["targets"] = judge(result)
    return result


def capped_run(args) -> dict:
    """:func:`large_model`, in a child process on a GPU (the cap is process-wide and
    stays), in this one on a CPU (tiny, uncapped)."""
    if args.device == "cpu":
        return large_model(16, 3, 4, 2, "cpu", None)
    child = subprocess.run([sys.executable, __file__, "--large-child", str(args.cap_gib)],
                           capture_output=True, text=True)
    if child.returncode != 0:
        return {"error": child.stderr.strip().splitlines()[-1:]}
    return json.loads(child.stdout)


def report(result: dict) -> str:
    lines = [f"{result['device']}, torch {result['torch']}, {result['rounds']} interleaved "
             f"rounds of {result['steps_per_round']} steps"]
    if result.get("pcie"):
        bw = result["pcie"]
        lines.append(f"PCIe (pinned): {bw['h2d_GBps']:.1f} GB/s to the GPU, "
                     f"{bw['d2h_GBps']:.1f} GB/s back")
    lines.append(f"{'model':12s} {'variant':18s} {'ms/step':>9s} {'plain/it':>9s} "
                 f"{'(95% CI)':>15s} {'peak MiB':>9s}")
    for name, model in result["models"].items():
        for variant, v in model["variants"].items():
            ci = v["ratio_ci95"]
            interval = f"{ci[0]:.3f}..{ci[1]:.3f}" if ci else "-"
            peak = model["peak_gpu_mib"].get(variant)
            lines.append(f"{name:12s} {variant:18s} {v['step_ms']:9.3f} "
                         f"{v['ratio_vs_plain']:9.3f} {interval:>15s} "
                         f"{'-' if peak is None else f'{peak:.0f}':>9s}")
        adam = model["cpu_adam_ms"]
        extra = (f"; PCIe bound {model['pcie_bound_ms']:.2f} ms, CPU params step / "
                 f"max(plain, PCIe, fused Adam) = {model['cpu_params_vs_floor']:.2f}"
                 if "pcie_bound_ms" in model else "")
        lines.append(f"{'':12s} {model['params'] / 1e6:.1f}M parameters; CPU Adam alone: "
                     f"foreach {adam['foreach']:.2f} ms, fused {adam['fused']:.2f} ms{extra}")
    large = result.get("large_model")
    if large:
        lines.append(f"over the cap: {json.dumps(large)}")
    if result.get("offload"):  # offload.py's table of its GPU section
        lines.append(offload.report({"torch": result["torch"],
                                     "cpu_threads": torch.get_num_threads(),
                                     "rounds": result["rounds"],
                                     "steps": result["steps_per_round"],
                                     "gpu": result["offload"]}))
    for t in result["targets"]:
        ci = t["ci95"]
        interval = "no 95% interval" if ci is None else f"95% CI {ci[0]:.3f}..{ci[1]:.3f}"
        lines.append(f"target {t['what']} {t['target']}: median {t['median']:.3f} "
                     f"({interval}): {t['verdict']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--steps", type=int, default=10, help="training steps per round")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                        help="cpu: tiny models through the same code (no GPU needed)")
    parser.add_argument("--cap-gib", type=float, default=6.5,
                        help="GPU memory cap for the model over it (0: skip that part)")
    parser.add_argument("--json", type=Path, default=Path("benchmarks/gpu.json"))
    parser.add_argument("--no-offload", dest="offload", action="store_false",
                        help="skip benchmarks/offload.py's GPU section (parameters and "
                        "Adam on the CPU against the PCIe and CPU-Adam bounds)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 steps")
    parser.add_argument("--large-child", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.large_child is not None:  # the child of capped_run
        cap = int(args.large_child * 2**30)
        # 30 layers of 4096: 503M parameters, 7.5 GiB of parameters, gradients and Adam
        # state. With the parameters on the CPU the GPU holds a copy of the parameters
        # and the gradients, and at the gradients' hand-over one flat copy more: 12 bytes
        # a parameter, 5.6 GiB, which the default cap of 6.5 GiB leaves room for
        print(json.dumps(large_model(4096, 30, 256, 3, "cuda", cap)))
        return 0
    if args.quick:
        args.rounds, args.steps = 2, 2
    if args.cap_gib == 0:
        args.cap_gib = None
    args.json.parent.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(NO_CUDA)
        args.json.write_text(json.dumps({"skipped": NO_CUDA}, indent=2))
        return 0
    result = measure(args)
    print(report(result))
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
