"""Replicas of unequal speed: TF's even split against csrun's balanced split (issue 36).

    python benchmarks/batch_split.py                 # 9 rounds of 20 steps, table + JSON
    python benchmarks/batch_split.py --rounds 3 --steps 5 --json out.json  # a smoke run

Every round runs each variant for ``--steps`` training steps in turn (each round starting
one variant later), and the report gives the median over rounds of each variant's
paired ratio to ``fastest_alone`` of the same round (> 1: faster than it):

* CPU (always): two logical CPU replicas, one intra-op thread each, where replica 1 runs
  its forward ``--slow`` times (the extra ones without grad): a replica of deliberately
  unequal speed. ``fastest_alone`` is replica 0 alone on one thread (its own share of
  the machine); ``even`` and ``balanced`` split each batch of the MLP 784-512-512-10.
* GPU (when CUDA is present), the issue's setup: parameters on the CPU, ``fastest_alone``
  is ``[GPU:0]``, ``even`` and ``balanced`` are ``[GPU:0, CPU:0]``; for the MLP
  784-512-512 at batch 256 and 1024-4096x3 at batch 1024, Adam.

Each variant's strategy and model are built once and warmed up for ``--warmup`` steps, so
the balanced split has measured its replicas before the rounds start; the report also
gives the shares it settled on. Target: ``balanced`` >= ``fastest_alone`` (never slower),
and above it where the second replica adds throughput.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

import csrun.core as cs
from csrun.core.distribute.batch_split import even_sizes

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from targets import BATCH_SPLIT_TARGET, verdict  # noqa: E402
from throughput import interleaved  # noqa: E402


class SlowReplica(nn.Module):
    """An MLP whose forward runs ``slow`` times on replica 1 (the last ``slow - 1``
    without grad): that replica does more work per example than the others."""

    def __init__(self, widths: tuple, slow: int):
        super().__init__()
        layers = []
        for a, b in zip(widths[:-1], widths[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        self.net = nn.Sequential(*layers[:-1])
        self.slow = slow

    def forward(self, x):
        context = cs.get_replica_context()
        if context is not None and context.replica_id_in_sync_group == 1:
            with torch.no_grad():
                for _ in range(self.slow - 1):
                    self.net(x)
        return self.net(x)


def _data(widths: tuple, batch: int, steps: int) -> list:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(batch, widths[0], generator=g),
             torch.randint(0, widths[-1], (batch,), generator=g)) for _ in range(steps)]


def _loop(devices: list, parameter: str, split: str, widths: tuple, slow: int, batch: int,
          steps: int, optimizer: str, threads: int | None) -> tuple[Callable, Callable]:
    """(one round of ``steps`` steps, the strategy's current shares of a batch)."""
    strategy = cs.CentralStorageStrategy(devices, parameter,
                                         options=cs.StrategyOptions(batch_split=split))
    torch.manual_seed(0)
    with strategy.scope():
        model = SlowReplica(widths, slow)
        opt = getattr(torch.optim, optimizer)(model.parameters(), lr=1e-3)
    data = _data(widths, batch, steps)

    def step(x, y):
        cs.compute_average_loss(F.cross_entropy(model(x), y, reduction="none")).backward()

    def run_round():
        before = torch.get_num_threads()
        if threads:
            torch.set_num_threads(threads)
        try:
            for x, y in strategy.experimental_distribute_dataset(data):
                opt.zero_grad(set_to_none=True)
                strategy.run(step, args=(x, y))
                opt.step()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        finally:
            torch.set_num_threads(before)

    balancer = strategy.extended.batch_balancer
    return run_round, lambda: (balancer.sizes(batch) if balancer.balanced
                               else even_sizes(batch, len(devices)))


def _interleaved(variants: dict, examples: int, rounds: int) -> dict:
    """throughput.py's interleaved rounds, with ``fastest_alone`` as the yardstick."""
    names = {"fastest_alone": "plain"}
    result = interleaved({names.get(k, k): fn for k, fn in variants.items()}, examples,
                         rounds)
    back = {v: k for k, v in names.items()}
    return {back.get(k, k): {("ratio_vs_fastest_alone" if f == "ratio_vs_plain" else f): x
                             for f, x in v.items()} for k, v in result.items()}


def _section(setups: dict, widths: tuple, batch: int, args, optimizer: str) -> dict:
    """``setups``: variant -> (devices, parameter device, batch_split, threads)."""
    loops, shares = {}, {}
    for name, (devices, parameter, split, threads) in setups.items():
        run_round, sizes = _loop(devices, parameter, split, widths, args.slow, batch,
                                 args.steps, optimizer, threads)
        for _ in range(max(1, args.warmup // args.steps)):  # warm-up: shares settle
            run_round()
        loops[name], shares[name] = run_round, sizes
    result = _interleaved(loops, batch * args.steps, args.rounds)
    for name in result:
        result[name]["shares"] = shares[name]() if len(setups[name][0]) > 1 else [batch]
    balanced = result["balanced"]
    balanced["target"] = {"balanced / fastest_alone >=": BATCH_SPLIT_TARGET,
                          "verdict": verdict(balanced["ratio_ci95"], BATCH_SPLIT_TARGET, True)}
    return result


def measure(args) -> dict:
    threads = torch.get_num_threads()
    per = max(1, threads // 2)  # each of two CPU replicas' share of the intra-op threads
    out = {"torch": torch.__version__, "cpu_threads": threads, "rounds": args.rounds,
           "steps_per_round": args.steps, "slow": args.slow, "sections": {}}
    cpu = {"fastest_alone": (["CPU:0"], "CPU:0", "even", per),
           "even": (["CPU:0", "CPU:1"], "CPU:0", "even", None),
           "balanced": (["CPU:0", "CPU:1"], "CPU:0", "balanced", None)}
    out["sections"]["cpu_mlp_784_512_512"] = _section(cpu, (784, 512, 512, 10), 256, args,
                                                      "SGD")
    if torch.cuda.is_available():
        gpu = {"fastest_alone": (["GPU:0"], "CPU:0", "even", None),
               "even": (["GPU:0", "CPU:0"], "CPU:0", "even", None),
               "balanced": (["GPU:0", "CPU:0"], "CPU:0", "balanced", None)}
        slow, args.slow = args.slow, 1  # the CPU is the slow replica there
        out["sections"]["gpu_cpu_mlp_784_512_512"] = _section(gpu, (784, 512, 512, 10), 256,
                                                              args, "Adam")
        out["sections"]["gpu_cpu_mlp_1024_4096x3"] = _section(
            gpu, (1024, 4096, 4096, 4096, 10), 1024, args, "Adam")
        args.slow = slow
    return out


def report(result: dict) -> str:
    lines = [f"torch {result['torch']}, {result['cpu_threads']} threads, "
             f"{result['rounds']} rounds x {result['steps_per_round']} steps "
             f"(CPU section: replica 1 runs its forward {result['slow']}x)"]
    for section, variants in result["sections"].items():
        lines.append(f"\n{section}")
        lines.append(f"  {'variant':<14} {'examples/s':>11} {'vs fastest alone':>17}  "
                     f"{'95% interval':>13}  shares")
        for name, v in variants.items():
            ci = v["ratio_ci95"]
            interval = f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "n/a"
            lines.append(f"  {name:<14} {v['examples_per_s']:>11.0f} "
                         f"{v['ratio_vs_fastest_alone']:>16.2f}x  {interval:>13}  "
                         f"{v['shares']}")
        target = variants["balanced"]["target"]
        lines.append(f"  target balanced / fastest alone >= {BATCH_SPLIT_TARGET}: "
                     f"{target['verdict']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=40, help="steps before the rounds")
    parser.add_argument("--slow", type=int, default=4,
                        help="forwards replica 1 runs per step in the CPU section")
    parser.add_argument("--json", type=Path, help="write the result here too")
    args = parser.parse_args(argv)
    result = measure(args)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
