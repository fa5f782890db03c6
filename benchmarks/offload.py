"""Parameters on the CPU, compute elsewhere: csrun's bucketed copy path against its bounds.

Two sections, each measured side by side in one process, variants interleaved in rounds
(each round starts one variant later), the report giving the median ms per step, the
best round, and the median of the paired ratios with its 95% interval:

* **cpu** (any machine): logical CPU replicas with ``copy_parameters`` -- the copy path a
  GPU replica takes -- with buckets (``bytes_per_pack`` at its default) against one copy
  per dtype (``bytes_per_pack=0``, the path before buckets), 1 and 2 replicas, fused Adam.
* **gpu** (when CUDA is present; :func:`offload_section` is what ``benchmarks/gpu.py``
  calls): parameters and Adam on the CPU, compute on ``cuda:0``, for the MLP 1024-4096x3
  (batch 1024, 38M parameters) and a 6-layer 512-wide transformer (27M). In the same
  rounds: the plain GPU step (everything on the GPU), the PCIe transfer (the parameters
  in and the gradients out, pinned), torch's fused CPU Adam alone, and csrun's step with
  buckets and with one copy. The target: csrun's step within 1.2x of the largest of the
  first three.

    python benchmarks/offload.py                  # both sections (gpu only with CUDA)
    python benchmarks/offload.py --quick          # a smoke run
    python benchmarks/offload.py --sections cpu --rounds 21 --json /tmp/offload.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import csrun.core as cs
from csrun.core.distribute.buckets import DEFAULT_BYTES_PER_PACK

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from targets import median_interval, verdict  # noqa: E402

GPU_TARGET = 1.2  # csrun's step / max(plain GPU step, PCIe transfer, fused CPU Adam)


# -- models ---------------------------------------------------------------------------------
def mlp(widths: tuple, classes: int) -> nn.Module:
    layers: list = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(widths[-1], classes))


class Transformer(nn.Module):
    """6 pre-norm encoder layers, 512 wide, 8 heads, an 8192-token vocabulary and an
    untied head: 27M parameters."""

    def __init__(self, vocab=8192, width=512, layers=6, seq=256):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq, width))
        layer = nn.TransformerEncoderLayer(width, 8, 4 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens) + self.position))


# name -> (build, batch(device) -> (input, target), loss)
def _classes(shape, classes, batch):
    def make(device):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(batch, *shape, generator=g)
        return x.to(device), torch.randint(0, classes, (batch,), generator=g).to(device)
    return make


def _tokens(batch, seq=256, vocab=8192):
    def make(device):
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, vocab, (batch, seq), generator=g)
        return x.to(device), torch.roll(x, -1, 1).to(device)
    return make


def _lm_loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


MODELS = {
    # the CPU section's: 10.5M parameters, 2 buckets at the default size
    "mlp2048": (lambda: mlp((1024, 2048, 2048, 2048), 10), _classes((1024,), 10, 64),
                F.cross_entropy),
    # a smoke run's: 0.4M parameters
    "mlp512": (lambda: mlp((256, 512, 512), 10), _classes((256,), 10, 32), F.cross_entropy),
    # issue 36's: 38M parameters, batch 1024
    "mlp4096": (lambda: mlp((1024, 4096, 4096, 4096), 10), _classes((1024,), 10, 1024),
                F.cross_entropy),
    "transformer": (Transformer, _tokens(32), _lm_loss),
}


# -- steps ------------------------------------------------------------------------------------
def plain_step(name: str, device: str) -> Callable[[], None]:
    """The plain loop on one device: parameters, fused Adam and data all there."""
    build, data, loss_fn = MODELS[name]
    torch.manual_seed(0)
    model = build().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    x, y = data(device)

    def step():
        loss_fn(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return step


def csrun_step(name: str, compute: list, parameter: str, **options) -> Callable[[], None]:
    """``run`` (forward and backward on each replica) then fused Adam on the parameter
    device, with ``copy_parameters`` on CPU replicas."""
    build, data, loss_fn = MODELS[name]
    strategy = cs.CentralStorageStrategy(compute, parameter,
                                         options=cs.StrategyOptions(**options))
    with strategy.scope():
        torch.manual_seed(0)
        model = build()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4, fused=True)
    devices = strategy.extended.torch_devices
    x, y = data("cpu")
    xs, ys = x.tensor_split(len(devices)), y.tensor_split(len(devices))
    xs = [a.to(d) for a, d in zip(xs, devices)]
    ys = [b.to(d) for b, d in zip(ys, devices)]
    n = len(x)

    def replica():
        r = cs.get_replica_context().replica_id_in_sync_group
        (loss_fn(model(xs[r]), ys[r]) * (len(xs[r]) / n)).backward()

    def step():
        strategy.run(replica)
        opt.step()
        opt.zero_grad()
    step.strategy = strategy
    return step


def transfer_step(name: str) -> Callable[[], None]:
    """The PCIe bound of one step: every parameter to the GPU and every gradient back,
    one pinned copy each way."""
    nbytes = sum(p.numel() * p.element_size() for p in MODELS[name][0]().parameters())
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    back = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def step():
        device.copy_(host, non_blocking=True)
        back.copy_(device, non_blocking=True)
    return step


def cpu_adam_step(name: str) -> Callable[[], None]:
    """torch's fused CPU Adam alone over the model's parameters (gradients given)."""
    torch.manual_seed(0)
    params = [p.detach().requires_grad_() for p in MODELS[name][0]().parameters()]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = torch.optim.Adam(params, lr=1e-4, fused=True)
    return opt.step


# -- timing ----------------------------------------------------------------------------------
def timed(fn: Callable[[], None], steps: int) -> float:
    """ms per step of ``steps`` calls, synchronized."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e3


def interleaved(variants: dict, rounds: int, steps: int) -> dict:
    """ms per step of each variant, ``rounds`` interleaved rounds (each round starting
    one variant later, so drift and position hit all alike)."""
    for fn in variants.values():  # warm-up: allocators, threads, kernels, optimizer state
        timed(fn, 2)
    times: dict = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(timed(variants[name], steps))
    return times


def summary(times: list, base: list | None = None) -> dict:
    out = {"ms": statistics.median(times), "best_ms": min(times), "rounds_ms": times}
    if base is not None:
        ratios = [t / b for t, b in zip(times, base)]
        out.update(ratio=statistics.median(ratios), ratio_ci95=median_interval(ratios),
                   best_ratio=min(times) / min(base))
    return out


# -- sections --------------------------------------------------------------------------------
def cpu_section(rounds: int, steps: int, replicas=(1, 2), model: str = "mlp2048",
                bytes_per_pack: int = DEFAULT_BYTES_PER_PACK) -> dict:
    """Buckets against one copy per dtype on logical CPU replicas with copy_parameters:
    the ratio is buckets / one copy (below 1: buckets faster)."""
    out: dict = {"model": model, "bytes_per_pack": bytes_per_pack, "replicas": {}}
    for r in replicas:
        devices = [f"CPU:{i}" for i in range(r)]
        buckets = csrun_step(model, devices, "CPU:0", copy_parameters=True,
                             bytes_per_pack=bytes_per_pack)
        variants = {"one_copy": csrun_step(model, devices, "CPU:0", copy_parameters=True,
                                           bytes_per_pack=0),
                    "buckets": buckets}
        times = interleaved(variants, rounds, steps)
        mirror = buckets.strategy.extended.store.mirror(0)
        out["replicas"][r] = {"buckets_per_replica": len(mirror.buckets),
                              "one_copy": summary(times["one_copy"]),
                              "buckets": summary(times["buckets"], times["one_copy"])}
    return out


def offload_section(rounds: int, steps: int, models=("mlp4096", "transformer")) -> dict:
    """On ``cuda:0`` with parameters and Adam on the CPU: csrun's step against the plain
    GPU step, the PCIe transfer and fused CPU Adam, measured in the same rounds.
    ``benchmarks/gpu.py`` calls this; each model's ``ratio`` is csrun's step over the
    largest of the three (the target: at most 1.2)."""
    out: dict = {"device": torch.cuda.get_device_name(0), "target": GPU_TARGET, "models": {}}
    for name in models:
        variants = {"plain_gpu": plain_step(name, "cuda"), "pcie": transfer_step(name),
                    "cpu_adam": cpu_adam_step(name),
                    "csrun": csrun_step(name, ["GPU:0"], "CPU:0"),
                    "csrun_one_copy": csrun_step(name, ["GPU:0"], "CPU:0", bytes_per_pack=0)}
        times = interleaved(variants, rounds, steps)
        bound = [max(a, b, c) for a, b, c in
                 zip(times["plain_gpu"], times["pcie"], times["cpu_adam"])]
        result = {k: summary(v) for k, v in times.items()}
        result["bound"] = summary(bound)
        for k in ("csrun", "csrun_one_copy"):
            result[k] = summary(times[k], bound)
        result["verdict"] = verdict(result["csrun"]["ratio_ci95"], GPU_TARGET, at_least=False)
        params = sum(p.numel() for p in MODELS[name][0]().parameters())
        result["parameters"] = params
        out["models"][name] = result
    return out


def report(result: dict) -> str:
    lines = [f"torch {result['torch']}, {result['cpu_threads']} CPU threads, "
             f"{result['rounds']} interleaved rounds of {result['steps']} steps"]
    cpu = result.get("cpu")
    if cpu:
        lines.append(f"\ncpu: {cpu['model']}, logical CPU replicas, copy_parameters, fused "
                     f"Adam; buckets of {cpu['bytes_per_pack']:,} bytes vs one copy")
        lines.append(f"{'replicas':>9} {'buckets':>8} {'one copy ms':>12} {'buckets ms':>11} "
                     f"{'ratio (95% CI)':>22} {'best/best':>10}")
        for r, row in cpu["replicas"].items():
            b = row["buckets"]
            ci = b["ratio_ci95"]
            ci_text = f"{ci[0]:.3f}..{ci[1]:.3f}" if ci else "n/a"
            lines.append(f"{r:>9} {row['buckets_per_replica']:>8} "
                         f"{row['one_copy']['ms']:>12.1f} {b['ms']:>11.1f} "
                         f"{b['ratio']:>8.3f} ({ci_text:>12}) {b['best_ratio']:>10.3f}")
    gpu = result.get("gpu")
    if gpu:
        lines.append(f"\ngpu: {gpu['device']}; parameters and fused Adam on the CPU; "
                     f"target csrun <= {gpu['target']}x max(plain, PCIe, CPU Adam)")
        lines.append(f"{'model':>12} {'plain':>7} {'PCIe':>7} {'CPU Adam':>9} {'csrun':>7} "
                     f"{'one copy':>9} {'ratio':>7} verdict")
        for name, m in gpu["models"].items():
            lines.append(f"{name:>12} {m['plain_gpu']['ms']:>7.2f} {m['pcie']['ms']:>7.2f} "
                         f"{m['cpu_adam']['ms']:>9.2f} {m['csrun']['ms']:>7.2f} "
                         f"{m['csrun_one_copy']['ms']:>9.2f} {m['csrun']['ratio']:>7.2f} "
                         f"{m['verdict']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=5, help="training steps per round")
    parser.add_argument("--sections", nargs="+", default=["cpu", "gpu"], choices=["cpu", "gpu"])
    parser.add_argument("--replicas", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--cpu-model", default="mlp2048", choices=list(MODELS))
    parser.add_argument("--bytes-per-pack", type=int, default=DEFAULT_BYTES_PER_PACK,
                        help="the cpu section's bucket size")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2 steps")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps = 2, 2
    result: dict = {"python": platform.python_version(), "torch": torch.__version__,
                    "cpu_threads": torch.get_num_threads(), "rounds": args.rounds,
                    "steps": args.steps}
    if "cpu" in args.sections:
        result["cpu"] = cpu_section(args.rounds, args.steps, args.replicas, args.cpu_model,
                                    args.bytes_per_pack)
    if "gpu" in args.sections:
        if torch.cuda.is_available():
            result["gpu"] = offload_section(args.rounds, args.steps)
        else:
            print("gpu: no CUDA device here; section skipped")
    print(report(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
