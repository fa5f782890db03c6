"""The plain loop through ``csrun.core.DataParallel`` against the other ways to run it,
side by side in one run (issue 25).

    python benchmarks/data_parallel.py                  # 31 rounds of 20 steps
    python benchmarks/data_parallel.py --rounds 7 --steps 5   # a smoke run

The MLP 784-512-512-10 at batch 256 with SGD, on 2 logical CPU replicas. Every round
runs each variant for ``--steps`` steps in turn (each round starting one variant later,
as benchmarks/throughput.py does), and the report gives the median over rounds of each
variant's paired ratio to plain PyTorch of the same round, with its 95% interval:

* ``plain``: the single-device loop, the yardstick;
* ``data_parallel``: the same loop with the model wrapped (target >= 0.85x plain);
* ``strategy_run``: the same engine through ``strategy.run`` (TF's API), backward inside;
* ``ddp``: ``DistributedDataParallel`` on gloo, 2 processes with half the batch each
  and half the intra-op threads each (torchrun's default is 1), kept alive across
  rounds and started by the round;
* ``torch_data_parallel``: ``torch.nn.DataParallel``, only with 2 CUDA devices (on a CPU
  it calls the module itself, unsplit: nothing to compare).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import csrun.core as cs
from csrun.core.runner.launch import free_ports

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script or imported
from targets import DATA_PARALLEL_TARGET, verdict  # noqa: E402
from throughput import batches, build, csrun_loop, interleaved, plain_loop  # noqa: E402

MODEL = "mlp"


# -- DDP: two processes driven round by round ---------------------------------------------
def _ddp_worker(rank: int, steps: int, threads: int, port: int, orders, done) -> None:
    torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(build(MODEL))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [(x.chunk(2)[rank], y.chunk(2)[rank]) for x, y in batches(MODEL, steps)]
    while orders.get():
        dist.barrier()
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        dist.barrier()
        if rank == 0:
            done.put(True)
    dist.destroy_process_group()


class DDPProcesses:
    """Two DDP ranks that each run ``steps`` steps when called (the call returns when
    both are done)."""

    def __init__(self, steps: int):
        context = mp.get_context("spawn")
        self.orders = [context.SimpleQueue() for _ in range(2)]
        self.done = context.SimpleQueue()
        threads = max(1, torch.get_num_threads() // 2)
        port = free_ports(1)[0]  # a fixed port could be another job's
        self.procs = [context.Process(target=_ddp_worker, daemon=True, args=(
            rank, steps, threads, port, self.orders[rank], self.done)) for rank in range(2)]
        for proc in self.procs:
            proc.start()

    def __call__(self) -> None:
        for queue in self.orders:
            queue.put(True)
        self.done.get()

    def close(self) -> None:
        for queue in self.orders:
            queue.put(False)
        for proc in self.procs:
            proc.join(timeout=30)


def variants(data: list, ddp: DDPProcesses | None) -> dict:
    two = ["CPU:0", "CPU:1"]
    out = {"plain": plain_loop(MODEL, data),
           "data_parallel": plain_loop(MODEL, data, wrap=lambda m: cs.DataParallel(m, two)),
           "strategy_run": csrun_loop(MODEL, data, two, "CPU:0")}
    if torch.cuda.device_count() >= 2:
        out["torch_data_parallel"] = plain_loop(
            MODEL, data, wrap=lambda m: torch.nn.DataParallel(m.cuda(), [0, 1]))
    if ddp is not None:
        out["ddp"] = ddp
    return out


def measure(rounds: int, steps: int, with_ddp: bool) -> dict:
    data = batches(MODEL, steps)
    ddp = DDPProcesses(steps) if with_ddp else None
    try:
        started = time.time()
        load = os.getloadavg()[0]
        results = interleaved(variants(data, ddp), steps * 256, rounds)
        load_after = os.getloadavg()[0]
    finally:
        if ddp is not None:
            ddp.close()
    entry = results["data_parallel"]
    judged = verdict(entry["ratio_ci95"], DATA_PARALLEL_TARGET, at_least=True)
    return {"model": "mlp 784-512-512-10, batch 256, SGD", "rounds": rounds, "steps": steps,
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "load_average_1min": [load, load_after], "seconds": time.time() - started,
            "variants": results, "target": {"data_parallel >=": DATA_PARALLEL_TARGET,
                                             "verdict": judged},
            "not_run": {} if torch.cuda.device_count() >= 2 else {
                "torch_data_parallel": "needs 2 CUDA devices (on a CPU torch.nn."
                                       "DataParallel calls the module itself)"}}


def report(result: dict) -> str:
    lines = [f"{result['model']}, {result['rounds']} rounds x {result['steps']} steps, "
             f"{result['threads']} intra-op threads, 1-min load average "
             f"{result['load_average_1min'][0]:.2f} -> {result['load_average_1min'][1]:.2f}",
             f"{'variant':<22}{'examples/s':>12}{'/ plain':>9}  95% interval"]
    for name, entry in result["variants"].items():
        low_high = entry["ratio_ci95"]
        interval = f"{low_high[0]:.3f}..{low_high[1]:.3f}" if low_high else "-"
        lines.append(f"{name:<22}{entry['examples_per_s']:>12,.0f}"
                     f"{entry['ratio_vs_plain']:>9.3f}  {interval}")
    runs = result["variants"]
    ratio = runs["data_parallel"]["examples_per_s"] / runs["strategy_run"]["examples_per_s"]
    lines.append(f"data_parallel / strategy_run: {ratio:.3f} (of the median rates)")
    lines.append(f"target data_parallel >= {DATA_PARALLEL_TARGET} x plain: "
                 f"{result['target']['verdict']}")
    lines += [f"not run: {k}: {why}" for k, why in result["not_run"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--no-ddp", action="store_true", help="skip the DDP processes")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    result = measure(args.rounds, args.steps, not args.no_ddp)
    print(report(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
