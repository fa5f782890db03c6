"""ParameterServerStrategy with 1 and 2 workers against local central storage, in one run.

The model of issue 6: an MLP 784-512-512-10 (ReLU), cross-entropy, SGD with lr 0.1, a
global batch of 256 synthetic examples. Three variants, each its own processes, started
the same way:

* ``central``: one process, CentralStorageStrategy on 2 logical CPU replicas (CPU:0, CPU:1)
  with the parameters on CPU:0 -- every thread of the machine;
* ``ps_1w``: 1 ps + 1 worker (the worker trains on every whole global batch);
* ``ps_2w``: 1 ps + 2 workers, each on its half of every global batch, asynchronously.

Threads follow ``csrun launch``: each worker gets ``cpu_count // workers`` threads, a ps
one. Every task warms up, waits at a barrier for the others, then trains ``--steps``
steps; examples/s is every worker's examples over the span from the first start to the
last end. Rounds run the variants in turn, in a rotating order, so that drift of the
machine hits all; the report gives each variant's median and the median of its paired
ratio to ``central`` in the same round.

    python benchmarks/parameter_server.py                  # 3 rounds, table
    python benchmarks/parameter_server.py --json ps.json   # and the figures as JSON
    python benchmarks/parameter_server.py --quick          # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = {"central": 0, "ps_1w": 1, "ps_2w": 2}  # name -> workers (0: no cluster)
GLOBAL_BATCH, FEATURES, CLASSES, DISTINCT_BATCHES = 256, 784, 10, 8


# -- one task (run as `parameter_server.py --task ...`) ---------------------------------
def build_model(hidden: int = 512):
    import torch.nn as nn
    return nn.Sequential(nn.Linear(FEATURES, hidden), nn.ReLU(), nn.Linear(hidden, hidden),
                         nn.ReLU(), nn.Linear(hidden, CLASSES))


def parameter_count(hidden: int) -> int:
    return FEATURES * hidden + hidden + hidden * hidden + hidden + hidden * CLASSES + CLASSES


def make_strategy(kind: str, placement: str = "round_robin"):
    if kind == "central":
        from csrun.core import CentralStorageStrategy
        return CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
    from csrun.core.cluster.parameter_server_strategy import ParameterServerStrategy
    return ParameterServerStrategy(timeout=120, variable_placement=placement)  # TF_CONFIG


def task(args) -> int:
    import torch
    import torch.nn.functional as F
    strategy = make_strategy(args.task, args.placement)
    if args.task == "ps":
        strategy.extended.join()
        return 0
    torch.manual_seed(0)
    with strategy.scope():
        model = build_model(args.hidden)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(GLOBAL_BATCH, FEATURES, generator=g),
             torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=g))
            for _ in range(DISTINCT_BATCHES)]
    batches = [data[i % DISTINCT_BATCHES] for i in range(args.warmup + args.steps)]

    def step(x, y):
        loss = F.cross_entropy(model(x), y, reduction="sum") / GLOBAL_BATCH
        loss.backward()
        return loss.detach(), torch.tensor(x.shape[0])

    losses, examples, begin = [], 0, None
    with strategy.scope():
        for i, (x, y) in enumerate(strategy.experimental_distribute_dataset(batches)):
            if i == args.warmup:
                barrier(Path(args.barrier), args.parties)
                begin = time.time()  # wall clock: comparable across the processes
            optimizer.zero_grad(set_to_none=True)
            loss, count = strategy.reduce("SUM", strategy.run(step, args=(x, y)), axis=None)
            optimizer.step()
            losses.append(float(loss))
            examples += int(count) if i >= args.warmup else 0
    end = time.time()
    if args.task != "central":
        strategy.extended.finish()
    Path(args.result).write_text(json.dumps({"begin": begin, "end": end,
                                             "examples": examples, "losses": losses}))
    return 0


def barrier(folder: Path, parties: int) -> None:
    """Wait until ``parties`` tasks reached this point (files in a shared folder)."""
    (folder / f"{os.getpid()}.ready").touch()
    while len(list(folder.glob("*.ready"))) < parties:
        time.sleep(0.01)


# -- the driver -------------------------------------------------------------------------

def run_variant(name: str, args, folder: Path) -> dict:
    """Start the variant's processes on loopback, wait for them, return its figures."""
    workers = VARIANTS[name]
    if workers == 0:
        return run_tasks([("central", None, os.cpu_count() or 1)], args, folder, name)
    from csrun.core.runner.launch import free_ports  # the driver itself stays free of torch
    ports = free_ports(workers + 1)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports[:workers]],
               "ps": [f"127.0.0.1:{ports[-1]}"]}
    return run_tasks(cluster_tasks(cluster), args, folder, name)


def cluster_tasks(cluster: dict) -> list[tuple]:
    """(kind, (job, index, cluster), threads) of every task, ps tasks first; threads as
    `csrun launch` gives them."""
    workers, cpus = len(cluster["worker"]), os.cpu_count() or 1
    return [("ps", ("ps", k, cluster), 1) for k in range(len(cluster["ps"]))] + [
        ("worker", ("worker", i, cluster), max(1, cpus // workers)) for i in range(workers)]


def run_tasks(tasks: list[tuple], args, folder: Path, name: str,
              wrap=lambda k, argv: argv) -> dict:
    """Run ``tasks`` (``wrap(k, argv)`` may place task k elsewhere); their figures."""
    workers = sum(kind != "ps" for kind, _, _ in tasks)
    barrier_dir = folder / f"barrier-{name}-{time.monotonic_ns()}"
    barrier_dir.mkdir()
    common = [sys.executable, __file__, "--steps", str(args.steps), "--warmup",
              str(args.warmup), "--barrier", str(barrier_dir), "--parties", str(workers),
              "--hidden", str(args.hidden), "--placement", args.placement]
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"))
    procs, results = [], []
    for k, (kind, where, threads) in enumerate(tasks):
        result = folder / f"{name}-{k}.json"
        task_env = dict(env, OMP_NUM_THREADS=str(threads))
        if where is not None:
            task_env["TF_CONFIG"] = json.dumps({"cluster": where[2], "task": {
                "type": where[0], "index": where[1]}})
        argv = wrap(k, common + ["--task", kind, "--result", str(result)])
        procs.append(subprocess.Popen(argv, env=task_env))
        if kind != "ps":
            results.append(result)
    for proc in procs:
        if proc.wait(timeout=600) != 0:
            raise SystemExit(f"{name}: a task failed (exit {proc.returncode})")
    figures = [json.loads(r.read_text()) for r in results]
    span = max(f["end"] for f in figures) - min(f["begin"] for f in figures)
    examples = sum(f["examples"] for f in figures)
    return {"examples_per_s": examples / span, "seconds": span, "examples": examples,
            "final_loss": figures[0]["losses"][-1], "first_loss": figures[0]["losses"][0]}


# -- limited links: each task a host (a network namespace) -----------------------------
RATES = {"1gbit": 1e9, "10gbit": 1e10}


def largest_shard(hidden: int, ps: int, placement: str) -> int:
    """Parameters on the busiest ps (csrun's placement rules, on the MLP's tensors)."""
    sizes = [FEATURES * hidden, hidden, hidden * hidden, hidden, hidden * CLASSES, CLASSES]
    load = [0] * ps
    for i, size in enumerate(sizes):
        k = i % ps if placement == "round_robin" else min(range(ps), key=lambda j: load[j])
        load[k] += size
    return max(load)


def bandwidth_bound(rate: float, workers: int, ps: int, hidden: int,
                    placement: str = "balanced") -> float:
    """examples/s the links allow. A worker step pushes every gradient and pulls every
    value (4 bytes each way; links are full duplex) over the worker's link, and its
    shard's part over each ps's link, which carries that for every worker's steps. Each
    worker step is GLOBAL_BATCH/workers examples."""
    worker_steps = workers * rate / (parameter_count(hidden) * 32)
    ps_steps = rate / (largest_shard(hidden, ps, placement) * 32)
    return min(worker_steps, ps_steps) * GLOBAL_BATCH / workers


def run_on_links(rate: str, workers: int, ps: int, args, folder: Path) -> dict:
    netns = _netns()
    with netns.Hosts(ps + workers, rate) as hosts:
        cluster = {"ps": [f"{a}:2222" for a in hosts.addresses[:ps]],
                   "worker": [f"{a}:2222" for a in hosts.addresses[ps:]]}
        figures = run_tasks(cluster_tasks(cluster), args, folder, f"{rate}-{workers}w{ps}ps",
                            wrap=hosts.command)
        shaping = hosts.shaping
    bound = bandwidth_bound(RATES[rate], workers, ps, args.hidden, args.placement)
    return {**figures, "rate": rate, "workers": workers, "ps": ps, "hidden": args.hidden,
            "shaping": shaping, "bound_examples_per_s": bound,
            "bytes_per_worker_step": 2 * 4 * parameter_count(args.hidden)}


def _netns():
    import importlib.util
    spec = importlib.util.spec_from_file_location("netns", Path(__file__).with_name("netns.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    reason = module.unavailable()
    if reason:
        raise SystemExit(f"--links: {reason}")
    return module


def measure_links(args) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="csrun-psbench-") as tmp:
        for rate in args.links.split(","):
            for workers in (1, 2, 4):
                for ps in (1, 2):
                    rows.append(run_on_links(rate, workers, ps, args, Path(tmp)))
                    print(link_row(rows[-1]), flush=True)
        hidden = args.hidden
        for args.hidden in args.crossover:  # model size: where does a second ps pay?
            for ps in (1, 2):
                rows.append(run_on_links(args.links.split(",")[0], 2, ps, args, Path(tmp)))
                print(link_row(rows[-1]), flush=True)
        args.hidden = hidden
    import torch
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "steps": args.steps, "warmup": args.warmup,
            "global_batch": GLOBAL_BATCH, "placement": args.placement, "links": rows}


def link_row(row: dict) -> str:
    latency = "rate + 0.2 ms" if row["shaping"] == "netem" else "rate only (tbf)"
    return (f"{row['rate']:>7s} {row['hidden']:>6d} {row['workers']:>3d}w {row['ps']}ps "
            f"{row['examples_per_s']:10.0f} ex/s  bound {row['bound_examples_per_s']:10.0f}"
            f"  ({row['examples_per_s'] / row['bound_examples_per_s']:.2f} of it; {latency})")


def measure(args) -> dict:
    rounds: list[dict] = []
    names = list(VARIANTS)
    with tempfile.TemporaryDirectory(prefix="csrun-psbench-") as tmp:
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            rounds.append({name: run_variant(name, args, Path(tmp)) for name in order})
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{n} {rounds[-1][n]['examples_per_s']:.0f} ex/s" for n in names), flush=True)
    summary = {}
    for name in names:
        rates = [r[name]["examples_per_s"] for r in rounds]
        ratios = [r[name]["examples_per_s"] / r["central"]["examples_per_s"] for r in rounds]
        summary[name] = {"examples_per_s": statistics.median(rates),
                         "ratio_vs_central": statistics.median(ratios),
                         "ratio_min": min(ratios), "ratio_max": max(ratios)}
    import torch
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "rounds": args.rounds, "steps": args.steps,
            "warmup": args.warmup, "global_batch": GLOBAL_BATCH, "summary": summary,
            "per_round": rounds}


def report(result: dict) -> str:
    lines = [f"MLP 784-512-512-10, SGD lr 0.1, global batch {result['global_batch']}; "
             f"torch {result['torch']}, {result['cpu_count']} CPUs; {result['rounds']} "
             f"interleaved rounds of {result['steps']} steps (after {result['warmup']})",
             f"{'variant':10s} {'examples/s':>12s} {'vs central':>11s} {'(min..max)':>14s}"]
    for name, v in result["summary"].items():
        lines.append(f"{name:10s} {v['examples_per_s']:12.0f} {v['ratio_vs_central']:11.3f} "
                     f"{v['ratio_min']:6.3f}..{v['ratio_max']:.3f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200, help="measured steps per worker")
    parser.add_argument("--warmup", type=int, default=10, help="steps before measuring")
    parser.add_argument("--quick", action="store_true", help="1 round of 10 steps")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--links", metavar="RATES", help="instead: each task a network "
                        "namespace, links limited to RATES (1gbit,10gbit); needs root")
    parser.add_argument("--hidden", type=int, default=512, help="the MLP's hidden width")
    parser.add_argument("--crossover", type=lambda t: [int(h) for h in t.split(",")],
                        default=[64, 256, 1024], help="--links: hidden widths to run "
                        "with 2 workers and 1 or 2 ps")
    parser.add_argument("--placement", default="balanced", choices=["round_robin",
                        "balanced"], help="variables over the ps tasks")
    parser.add_argument("--task", choices=["central", "worker", "ps"], help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--barrier", help=argparse.SUPPRESS)
    parser.add_argument("--parties", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.task:
        return task(args)
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 10, 2
    if args.links:
        result = measure_links(args)
    else:
        result = measure(args)
        print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
