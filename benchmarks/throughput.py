"""csrun against plain PyTorch, measured side by side in one process.

Every round runs each variant for ``--steps`` training steps in turn (plain, csrun with 1,
2 and 4 logical CPU replicas, ...; each round starts with the next variant), so drift of
the machine hits all variants alike; the report gives the median examples/s of each
variant and the median over rounds of the paired ratio csrun / plain of the same round.

    python benchmarks/throughput.py                 # full run, table + JSON + PNG
    python benchmarks/throughput.py --quick         # a smoke run (CI uses it)
    python benchmarks/throughput.py --reference     # also hand-written threaded loops
    python benchmarks/throughput.py --only engine   # the engine's cost alone (issue 36)

Also measured: the engine's own cost per step (an empty replica function through ``run``
and ``reduce``), the input path (a distributed dataset against a plain DataLoader over the
same data) and, when CUDA is present, the per-step parameter/gradient transfer time
against the PCIe bound and one GPU step against plain PyTorch on that GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import csrun.core as cs

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from targets import TF_CSS_MLP_EXAMPLES_PER_S, judge, median_interval  # noqa: E402

# Measured as a user runs: with none of these set. Any that is set is reported (and
# --clean-env reruns the benchmark without them).
RUNTIME_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                     "KMP_BLOCKTIME", "OMP_DYNAMIC", "OMP_PROC_BIND", "CSRUN_OPENMP_TEAM")

MODELS = {
    "mlp": dict(shape=(784,), classes=10, batch=256),
    "convnet": dict(shape=(1, 28, 28), classes=10, batch=128),
    # Not run by default: 162 small parameters, where per-parameter costs show
    "deep": dict(shape=(64,), classes=10, batch=128),
    # Not run by default: the MLP with dropout 0.2 after each hidden layer (every replica
    # draws from its own generator)
    "mlp_dropout": dict(shape=(784,), classes=10, batch=256),
}
DEFAULT_MODELS = ["mlp", "convnet"]


def build(name: str) -> nn.Module:
    if name == "mlp":  # 784-512-512-10: about 4 MFLOP per example for forward+backward
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                             nn.Linear(512, 10))
    if name == "mlp_dropout":
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Dropout(0.2),
                             nn.Linear(512, 512), nn.ReLU(), nn.Dropout(0.2), nn.Linear(512, 10))
    if name == "deep":  # 40 x (Linear 64-64, LayerNorm, ReLU) + a head: 162 parameters
        blocks = [m for _ in range(40) for m in (nn.Linear(64, 64), nn.LayerNorm(64), nn.ReLU())]
        return nn.Sequential(*blocks, nn.Linear(64, 10))
    return nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(16, 32, 3),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(32 * 5 * 5, 10))


def batches(name: str, steps: int, device="cpu") -> list:
    spec = MODELS[name]
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(spec["batch"], *spec["shape"], generator=g).to(device),
             torch.randint(0, spec["classes"], (spec["batch"],), generator=g).to(device))
            for _ in range(steps)]


def plain_loop(name: str, data: list, device="cpu",
               wrap: Callable[[nn.Module], nn.Module] = lambda model: model
               ) -> Callable[[], None]:
    """The plain PyTorch loop, its model wrapped by ``wrap`` (a DataParallel) if given."""
    torch.manual_seed(0)
    model = wrap(build(name).to(device))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def run() -> None:
        losses = []
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.stack(losses).sum().item()
    return run


def csrun_loop(name: str, data: list, devices: list[str], parameter: str,
               **options) -> Callable[[], None]:
    strategy = cs.CentralStorageStrategy(devices, parameter,
                                         options=cs.StrategyOptions(**options))
    torch.manual_seed(0)
    with strategy.scope():
        model = build(name)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    dist = strategy.experimental_distribute_dataset(data)

    def step(x, y, n):
        loss = F.cross_entropy(model(x), y, reduction="sum") / n
        loss.backward()
        return loss.detach()

    def run() -> None:
        losses = []
        for x, y in dist:
            opt.zero_grad(set_to_none=True)
            n = MODELS[name]["batch"]
            losses.append(strategy.reduce("SUM", strategy.run(step, args=(x, y, n))))
            opt.step()
        torch.stack(losses).sum().item()
    return run


def hand_threads_loop(name: str, data: list, replicas: int) -> Callable[[], None]:
    """What ``replicas`` CPU replicas can do without csrun: a hand-written loop that runs
    each share of the batch on its own thread (intra-op threads split among them), on
    copies of the model whose parameters share the central storage, then sums the
    gradients with one ``_foreach_add_`` per replica and steps once. No checks, no
    contexts, no TF semantics: the ceiling this machine allows csrun with that many
    replicas (``--reference``)."""
    from concurrent.futures import ThreadPoolExecutor

    from csrun.core.distribute.openmp_team import find_team
    pool = ThreadPoolExecutor(max(1, replicas - 1))  # persistent threads, as csrun's
    # where each replica's share is one thread, the replicas run as the caller's OpenMP
    # team (a member per thread, the rest on the pool), as csrun's (docs/performance.md,
    # "OpenMP spinning")
    team = find_team() if torch.get_num_threads() // replicas <= 1 else None
    torch.manual_seed(0)
    model = build(name)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    copies = [build(name) for _ in range(replicas)]
    for copy in copies:
        for leaf, central in zip(copy.parameters(), model.parameters()):
            leaf.data = central.data  # shares storage: no broadcast needed on one device
    share = max(1, torch.get_num_threads() // replicas)
    n = MODELS[name]["batch"]

    def replica(i: int, x, y, out: list) -> None:
        torch.set_num_threads(share)
        for leaf in copies[i].parameters():
            leaf.grad = None
        loss = F.cross_entropy(copies[i](x), y, reduction="sum") / n
        loss.backward()
        out[i] = loss.detach()

    def run() -> None:
        losses, threads = [], torch.get_num_threads()
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            xs, ys, out = x.chunk(replicas), y.chunk(replicas), [None] * replicas
            if team is not None:
                beside: list = []  # replicas beyond the team's members, on the pool
                _, error = team.run(
                    [lambda i=i: replica(i, xs[i], ys[i], out) for i in range(replicas)],
                    spare=lambda i, member: beside.append(pool.submit(member)), size=threads)
                for done in beside:
                    done.result()
                if error is not None:
                    raise error
            else:
                pending = [pool.submit(replica, i, xs[i], ys[i], out)
                           for i in range(1, replicas)]
                replica(0, xs[0], ys[0], out)
                for done in pending:
                    done.result()
            torch.set_num_threads(threads)
            with torch.no_grad():
                centrals = list(model.parameters())
                for central, leaf in zip(centrals, copies[0].parameters()):
                    central.grad = leaf.grad
                for copy in copies[1:]:
                    torch._foreach_add_([c.grad for c in centrals],
                                        [leaf.grad for leaf in copy.parameters()])
            opt.step()
            losses.append(sum(out))
        torch.stack(losses).sum().item()
    weakref.finalize(run, pool.shutdown, wait=False)  # its threads end with the loop
    return run


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def interleaved(variants: dict, examples: int, rounds: int) -> dict:
    """Run the variants in turn, ``rounds`` times; return their rates and paired ratios."""
    for fn in variants.values():  # warm-up: allocator, threads, kernels
        fn()
    rates: dict = {k: [] for k in variants}
    names = list(variants)
    for r in range(rounds):
        # each round starts one variant later: a fixed order gave identical loops a 3%
        # difference by position alone (plain vs a second plain, 31 rounds)
        for name in names[r % len(names):] + names[:r % len(names)]:
            rates[name].append(examples / timed(variants[name]))
    base = rates["plain"]
    out = {}
    for name, values in rates.items():
        ratios = [v / b for v, b in zip(values, base)]
        out[name] = {"examples_per_s": statistics.median(values),
                     "ratio_vs_plain": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "ratio_ci95": median_interval(ratios)}
    return out


def engine_overhead(replicas: int, steps: int, rounds: int) -> list[float]:
    """µs per step of an empty replica function through run + reduce, one per round.

    The report gives their median and the best round, because a VM's speed can swing by
    half within seconds: the median is what a run sees, the best round what the code
    costs when the machine is at full speed."""
    strategy = cs.CentralStorageStrategy([f"CPU:{i}" for i in range(replicas)], "CPU:0")
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group)))

    def empty(x):
        return x

    def loop():
        for _ in range(steps):
            strategy.reduce("SUM", strategy.run(empty, args=(value,)))
    loop()
    return [timed(loop) / steps * 1e6 for _ in range(rounds)]


def input_path(replicas: int, rounds: int) -> dict:
    """Examples/s of iterating a distributed DataLoader vs the same plain DataLoader."""
    g = torch.Generator().manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(16384, 784, generator=g),
                                             torch.randint(0, 10, (16384,), generator=g))
    loader = torch.utils.data.DataLoader(dataset, batch_size=256)
    strategy = cs.CentralStorageStrategy([f"CPU:{i}" for i in range(replicas)], "CPU:0")
    dist = strategy.experimental_distribute_dataset(loader)

    def drain(iterable):
        return lambda: [None for _ in iterable]
    return interleaved({"plain": drain(loader), "csrun": drain(dist)}, len(dataset), rounds)


def gpu_section(rounds: int, steps: int) -> dict:
    """Transfer time per step against the PCIe bound, and one GPU step vs plain."""
    out: dict = {"device": torch.cuda.get_device_name(0)}
    size = 256 << 20
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    seconds = statistics.median(timed(lambda: dev.copy_(host, non_blocking=True))
                                for _ in range(5))
    out["h2d_GBps"] = size / seconds / 1e9
    data = batches("mlp", steps, "cuda")
    variants = {"plain": plain_loop("mlp", data, "cuda"),
                "csrun_gpu_params": csrun_loop("mlp", data, ["GPU:0"], "GPU:0"),
                "csrun_cpu_params": csrun_loop("mlp", data, ["GPU:0"], "CPU:0")}
    out["steps"] = interleaved(variants, steps * MODELS["mlp"]["batch"], rounds)
    params = sum(p.numel() * 4 for p in build("mlp").parameters())
    out["bytes_per_step"] = 2 * params  # parameters to the GPU, gradients back
    out["pcie_bound_ms"] = out["bytes_per_step"] / (out["h2d_GBps"] * 1e9) * 1e3
    plain_ms = 1e3 * MODELS["mlp"]["batch"] / out["steps"]["plain"]["examples_per_s"]
    cpu_ms = 1e3 * MODELS["mlp"]["batch"] / out["steps"]["csrun_cpu_params"]["examples_per_s"]
    out["transfer_overhead_ms"] = cpu_ms - plain_ms
    return out


def plain_rate(after_csrun: bool, steps: int) -> float:
    """Examples/s of the plain MLP loop in this (fresh) process, optionally after csrun
    has trained 2 concurrent replicas in it (the best of 5 timed passes)."""
    data = batches("mlp", steps)
    if after_csrun:
        loop = csrun_loop("mlp", data, ["CPU:0", "CPU:1"], "CPU:0")
        for _ in range(5):
            loop()
    plain = plain_loop("mlp", data)
    plain()
    return steps * MODELS["mlp"]["batch"] / min(timed(plain) for _ in range(5))


def plain_after_csrun(pairs: int, steps: int) -> dict:
    """Does csrun slow the user's own code in its process? Fresh processes, alternately
    plain only and plain after csrun's replicas, ``pairs`` of each: the median of the
    paired ratios after / alone, with its 95% interval."""
    def child(after: bool) -> float:
        out = subprocess.run([sys.executable, __file__, "--plain-child",
                              "after" if after else "alone", "--steps", str(steps)],
                             capture_output=True, text=True, check=True)
        return float(out.stdout.split()[-1])
    ratios = []
    for i in range(pairs):  # the first of each pair alternates too
        first = child(i % 2 == 1)
        second = child(i % 2 == 0)
        after, alone = (first, second) if i % 2 else (second, first)
        ratios.append(after / alone)
    return {"ratio": statistics.median(ratios), "ratio_ci95": median_interval(ratios),
            "ratios": ratios}


def measure(args) -> dict:
    if args.only == "engine":
        return measure_engine(args)
    result: dict = {"python": platform.python_version(), "torch": torch.__version__,
                    "cpu_threads": torch.get_num_threads(), "rounds": args.rounds,
                    "environment": {k: os.environ[k] for k in RUNTIME_VARIABLES
                                    if k in os.environ},
                    "steps_per_round": args.steps, "models": {}}
    for name in args.models:
        data = batches(name, args.steps)
        variants = {"plain": plain_loop(name, data)}
        for r in args.replicas:
            variants[f"csrun_R{r}"] = csrun_loop(name, data, [f"CPU:{i}" for i in range(r)],
                                                 "CPU:0")
            if args.reference and r > 1:
                variants[f"hand_R{r}"] = hand_threads_loop(name, data, r)
        examples = args.steps * MODELS[name]["batch"]
        result["models"][name] = interleaved(variants, examples, args.rounds)
    result.update(engine_figures(args))
    result["input_path_R2"] = input_path(2, args.rounds)
    if args.plain_check:
        result["plain_after_csrun"] = plain_after_csrun(args.plain_check, args.steps)
    if torch.cuda.is_available():
        result["gpu"] = gpu_section(args.rounds, args.steps)
    result["targets"] = judge(result)
    return result


def engine_figures(args) -> dict:
    """Issue 36's measure: best of 7 rounds of 1,000 empty steps (the best round is what
    the code costs when the machine is at full speed; the median what a run sees)."""
    overhead = {f"R{r}": engine_overhead(r, args.overhead_steps, args.overhead_rounds)
                for r in args.replicas}
    return {"engine_overhead_us": {k: statistics.median(v) for k, v in overhead.items()},
            "engine_overhead_best_us": {k: min(v) for k, v in overhead.items()},
            "engine_overhead_rounds_us": overhead}


def measure_engine(args) -> dict:
    """``--only engine``: the engine's cost per empty step, nothing else."""
    result = {"python": platform.python_version(), "torch": torch.__version__,
              "cpu_threads": torch.get_num_threads(), "only": "engine", "models": {},
              "environment": {k: os.environ[k] for k in RUNTIME_VARIABLES
                              if k in os.environ}}
    result.update(engine_figures(args))
    result["targets"] = judge(result)
    return result


def report_engine(result: dict) -> str:
    best = result["engine_overhead_best_us"]
    lines = [f"torch {result['torch']}, {result['cpu_threads']} CPU threads",
             "engine overhead per step (empty fn, run + reduce), median (best round): "
             + ", ".join(f"{k} {v:.1f} ({best[k]:.1f}) µs"
                         for k, v in result["engine_overhead_us"].items())]
    if result["environment"]:
        lines.append(f"NOTE: measured with {result['environment']} set; a user sets none "
                     "(--clean-env)")
    return "\n".join(lines + [_target_line(t) for t in result["targets"]])


def report(result: dict) -> str:
    if result.get("only") == "engine":
        return report_engine(result)
    lines = [f"torch {result['torch']}, {result['cpu_threads']} CPU threads, "
             f"{result['rounds']} interleaved rounds of {result['steps_per_round']} steps",
             f"{'model':10s} {'variant':12s} {'examples/s':>12s} {'csrun/plain':>12s} "
             f"{'(min..max)':>14s}"]
    for model, variants in result["models"].items():
        for name, v in variants.items():
            lines.append(f"{model:10s} {name:12s} {v['examples_per_s']:12.0f} "
                         f"{v['ratio_vs_plain']:12.3f} "
                         f"{v['ratio_min']:6.3f}..{v['ratio_max']:.3f}")
    best = result["engine_overhead_best_us"]
    lines.append("engine overhead per step (empty fn, run + reduce), median (best round): "
                 + ", ".join(f"{k} {v:.1f} ({best[k]:.1f}) µs"
                             for k, v in result["engine_overhead_us"].items()))
    path = result["input_path_R2"]
    lines.append(f"input path, 2 replicas: csrun {path['csrun']['examples_per_s']:.0f} ex/s vs "
                 f"DataLoader {path['plain']['examples_per_s']:.0f} ex/s "
                 f"(ratio {path['csrun']['ratio_vs_plain']:.3f})")
    r2 = result["models"].get("mlp", {}).get("csrun_R2")
    if r2:
        lines.append(f"mlp csrun_R2 {r2['examples_per_s']:.0f} ex/s = "
                     f"{r2['examples_per_s'] / TF_CSS_MLP_EXAMPLES_PER_S:.2f}x TensorFlow's "
                     f"CentralStorageStrategy ({TF_CSS_MLP_EXAMPLES_PER_S} ex/s on this VM)")
    if "plain_after_csrun" in result:
        check = result["plain_after_csrun"]
        lines.append(f"plain loop after csrun / alone, fresh processes: "
                     f"{check['ratio']:.3f} over {len(check['ratios'])} pairs")
    if result["environment"]:
        lines.append(f"NOTE: measured with {result['environment']} set; a user sets none "
                     "(--clean-env)")
    lines += [_target_line(t) for t in result["targets"]]
    if "gpu" in result:
        gpu = result["gpu"]
        lines.append(f"GPU {gpu['device']}: H2D {gpu['h2d_GBps']:.1f} GB/s; transfer overhead "
                     f"{gpu['transfer_overhead_ms']:.3f} ms/step vs PCIe bound "
                     f"{gpu['pcie_bound_ms']:.3f} ms; steps: " + ", ".join(
                         f"{k} {v['ratio_vs_plain']:.3f}x" for k, v in gpu["steps"].items()))
    return "\n".join(lines)


def _target_line(target: dict) -> str:
    ci = target["ci95"]
    stat = target.get("stat", "median")
    interval = "no 95% interval" if ci is None else f"95% CI {ci[0]:.3f}..{ci[1]:.3f}"
    if stat == "best":
        return (f"target {target['what']} {target['target']}: {target['median']:.1f}: "
                f"{target['verdict']}")
    return (f"target {target['what']} {target['target']}: {stat} {target['median']:.3f} "
            f"({interval}): {target['verdict']}")


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(result["models"])
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.5), squeeze=False)
    for ax, model in zip(axes[0], models):
        variants = result["models"][model]
        names = list(variants)
        ratios = [variants[n]["ratio_vs_plain"] for n in names]
        # error bars: the 95% interval of each median (none when too few rounds)
        cis = [variants[n].get("ratio_ci95") or (r, r) for n, r in zip(names, ratios)]
        ax.bar(names, ratios, yerr=[[r - lo for r, (lo, _) in zip(ratios, cis)],
                                    [hi - r for r, (_, hi) in zip(ratios, cis)]], capsize=3,
               color=["grey" if n == "plain" else "tab:orange"
                      if n.startswith("hand_") else "tab:blue" for n in names])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{model}: throughput / plain PyTorch (95% CI)")
        ax.set_ylim(0, max(1.1, max(hi for _, hi in cis) * 1.05))
        for i, r in enumerate(ratios):
            ax.text(i, 0.05, f"{r:.2f}", ha="center", color="white")  # clear of the bars
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=10, help="training steps per round")
    parser.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=list(MODELS))
    parser.add_argument("--replicas", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--only", choices=["all", "engine"], default="all",
                        help="engine: measure only the engine's cost per empty step "
                             "(run + reduce of an identity function, --overhead-rounds "
                             "rounds of --overhead-steps steps for each of --replicas); its "
                             "JSON goes to benchmarks/engine_overhead.json unless --json "
                             "is given, and it draws no chart")
    parser.add_argument("--json", type=Path, default=None,
                        help="where the JSON result goes (default benchmarks/results.json)")
    parser.add_argument("--plot", type=Path, default=Path("docs/performance.png"))
    parser.add_argument("--overhead-rounds", type=int, default=7,
                        help="rounds of the engine's cost per empty step")
    parser.add_argument("--overhead-steps", type=int, default=1000,
                        help="empty steps per round of the engine's cost")
    parser.add_argument("--quick", action="store_true",
                        help="2 rounds of 2 steps (the engine's cost: 2 rounds of 200)")
    parser.add_argument("--reference", action="store_true",
                        help="also run a hand-written threaded loop per replica count "
                             "(hand_R2, ...): what the cores allow without csrun")
    parser.add_argument("--plain-check", type=int, default=0, metavar="PAIRS",
                        help="also time the plain loop in fresh processes, alone and after "
                             "csrun, PAIRS times each: is the user's own code slowed?")
    parser.add_argument("--clean-env", action="store_true",
                        help="rerun this benchmark with the OpenMP/MKL variables above unset")
    parser.add_argument("--plain-child", choices=["alone", "after"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plain_child:
        print(plain_rate(args.plain_child == "after", args.steps))
        return 0
    if args.clean_env:
        env = {k: v for k, v in os.environ.items() if k not in RUNTIME_VARIABLES}
        rest = [a for a in (sys.argv[1:] if argv is None else argv) if a != "--clean-env"]
        return subprocess.run([sys.executable, __file__, *rest], env=env).returncode
    if args.quick:
        args.rounds, args.steps = 2, 2
        args.overhead_rounds, args.overhead_steps = 2, 200
    if args.json is None:
        args.json = Path("benchmarks/engine_overhead.json" if args.only == "engine"
                         else "benchmarks/results.json")
    result = measure(args)
    print(report(result))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    if args.only == "all" and plot(result, args.plot):
        print(f"chart: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
