"""One parameter-server step on a wide-and-deep model, timed and profiled: the quick
harness for making csrun's ps path fast (the side-by-side with TensorFlow is
``benchmarks/ps_vs_tf.py``'s).

The shapes of issue 37's model: 4 tables of 32 floats (4,000,000 + 500,000 + 50,000 +
10,000 = 4.56M rows), multi-hot ``nn.EmbeddingBag`` features of Zipf-distributed ids
(1.1), a wide linear part over 13 dense features and a deep MLP (128+13 -> 256 -> 128 ->
1), Adagrad, every variable in 2 fixed shards. Tasks are processes of this script on
loopback (a worker ``cpu_count // workers`` threads, a ps one, as ``csrun launch``).

    python benchmarks/ps_step.py                         # 1x1 and 2x2, printed table
    python benchmarks/ps_step.py --layouts 2x2 --profile prof/   # cProfile of worker:0, ps:0
    python benchmarks/ps_step.py --json step.json --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TABLES = (4_000_000, 500_000, 50_000, 10_000)
HOTNESS = (8, 1, 4, 2)  # ids per example (jagged: 1..HOTNESS[i]; padded features pad)
DIM, DENSE = 32, 13
SPARSE = os.environ.get("PS_STEP_SPARSE", "1") == "1"  # the tables' sparse=


def build_model(collected: bool):
    import torch.nn as nn
    import torch
    if collected:
        from csrun.core import EmbeddingBagCollection

    class WideAndDeep(nn.Module):
        def __init__(self):
            super().__init__()
            tables = {f"t{i}": nn.EmbeddingBag(rows, DIM, mode="sum", sparse=SPARSE)
                      for i, rows in enumerate(TABLES)}
            self.tables = EmbeddingBagCollection(tables) if collected else \
                nn.ModuleDict(tables)
            self.wide = nn.Linear(DENSE, 1)
            self.deep = nn.Sequential(nn.Linear(len(TABLES) * DIM + DENSE, 256), nn.ReLU(),
                                      nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 1))

        def forward(self, dense, features):
            if collected:  # one lookup per ps for every table
                pooled = self.tables(features)
            else:  # one lookup per table, as a model that calls its tables does
                pooled = {name: self.tables[name](*ids) for name, ids in features.items()}
            bags = [pooled[f"t{i}"] for i in range(len(TABLES))]
            return (self.wide(dense) + self.deep(torch.cat([dense, *bags], 1))).squeeze(1)

    return WideAndDeep()


def zipf(rows: int, count: int, generator):
    import torch
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    s = 1.1
    rank = (((rows ** (1 - s)) - 1.0) * u + 1.0) ** (1 / (1 - s))
    return ((rank.long().clamp_(1, rows) - 1) * 2_147_483_647) % rows


def batches(count: int, batch: int, seed: int, collected: bool):
    """(dense, labels, {table: ids}) per batch, multi-hot bags of 1..HOTNESS ids: a
    JaggedTensor each for a collection, else (flat ids, offsets) as EmbeddingBag takes
    them (one local replica: the batch is not split, and csrun before JaggedTensor
    runs it too)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        dense = torch.randn(batch, DENSE, generator=g)
        features = {}
        for i, (rows, hot) in enumerate(zip(TABLES, HOTNESS)):
            lengths = torch.randint(1, hot + 1, (batch,), generator=g)
            ids = zipf(rows, int(lengths.sum()), g)
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)[:-1]])
            if collected:
                from csrun.core import JaggedTensor
                features[f"t{i}"] = JaggedTensor.from_lengths(ids, lengths)
            else:
                features[f"t{i}"] = (ids, offsets)
        out.append((dense, (dense[:, 0] > 0).float(), features))
    return out


def task(args) -> None:
    import torch
    from csrun.core import FixedShardsPartitioner, ParameterServerStrategy
    profile = None
    if args.profile:
        import cProfile
        profile = cProfile.Profile()
    strategy = ParameterServerStrategy(timeout=600,
                                       variable_partitioner=FixedShardsPartitioner(2))
    me = json.loads(os.environ["TF_CONFIG"])["task"]
    name = f"{me['type']}{me['index']}"
    if strategy.extended.is_ps:
        if profile and me["index"] == 0:
            profile.enable()
        strategy.extended.join()
        if profile and me["index"] == 0:
            profile.disable()
            profile.dump_stats(str(Path(args.profile) / f"{name}.prof"))
        return
    torch.manual_seed(0)
    with strategy.scope():
        model = build_model(args.collected)
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.05)
    data = batches(args.warmup + args.steps, args.batch, me["index"] + 1, args.collected)

    def step(dense, labels, features):
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(dense, features), labels, reduction="sum") / args.batch
        loss.backward()
        return loss.detach()

    ticks = []
    for i, batch in enumerate(data):
        if i == args.warmup:
            barrier(Path(args.barrier), args.parties)
            if profile and me["index"] == 0:
                profile.enable()
        optimizer.zero_grad(set_to_none=True)
        strategy.run(step, args=batch)  # one local replica: the batch as it is
        optimizer.step()
        ticks.append(time.perf_counter())
    if profile and me["index"] == 0:
        profile.disable()
        profile.dump_stats(str(Path(args.profile) / f"{name}.prof"))
    strategy.extended.finish()
    seconds = ticks[-1] - ticks[args.warmup - 1]
    Path(args.result).write_text(json.dumps({"seconds": seconds,
                                             "examples": args.steps * args.batch}))


def barrier(folder: Path, parties: int) -> None:
    (folder / f"{os.getpid()}.ready").touch()
    while len(list(folder.glob("*.ready"))) < parties:
        time.sleep(0.005)


def run_layout(workers: int, ps: int, args, folder: Path) -> float:
    from csrun.core.runner.launch import free_ports
    addresses = [f"127.0.0.1:{p}" for p in free_ports(workers + ps)]
    cluster = {"ps": addresses[:ps], "worker": addresses[ps:]}
    gate = Path(tempfile.mkdtemp(dir=folder))
    procs, results, spies = [], [], []
    for job, index in [("ps", k) for k in range(ps)] + [("worker", i) for i in range(workers)]:
        result = folder / f"{job}{index}-{time.monotonic_ns()}.json"
        threads = 1 if job == "ps" else max(1, (os.cpu_count() or 1) // workers)
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), TF_CONFIG=json.dumps(
            {"cluster": cluster, "task": {"type": job, "index": index}}))
        argv = [sys.executable, __file__, "--task", "--result", str(result), "--barrier",
                str(gate), "--parties", str(workers), "--steps", str(args.steps),
                "--warmup", str(args.warmup), "--batch", str(args.batch)] + (
            ["--collected"] if args.collected else []) + (
            ["--profile", args.profile] if args.profile else [])
        procs.append(subprocess.Popen(argv, env=env))
        if args.spy and index == 0:  # py-spy samples every thread (cProfile one)
            spies.append(subprocess.Popen(
                ["py-spy", "record", "--format", "raw", "--threads", "--rate", "200",
                 "-o", str(Path(args.spy) / f"{job}{index}-{workers}x{ps}.txt"),
                 "-p", str(procs[-1].pid)], stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL))
        if job == "worker":
            results.append(result)
    for proc in procs:
        if proc.wait(timeout=1800) != 0:
            for other in procs:
                other.kill()
            raise SystemExit(f"{workers}x{ps}: a task failed (exit {proc.returncode})")
    for spy in spies:
        spy.wait(timeout=60)
    done = [json.loads(r.read_text()) for r in results]
    return sum(d["examples"] for d in done) / max(d["seconds"] for d in done)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layouts", default="1x1,2x2", help="WORKERSxPS, comma-separated")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=512, help="examples per worker step")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--collected", action="store_true",
                        help="the tables in an EmbeddingBagCollection (one lookup per ps)")
    parser.add_argument("--profile", help="folder for cProfile files of worker0 and ps0")
    parser.add_argument("--spy", help="folder for py-spy samples of worker0 and ps0")
    parser.add_argument("--json")
    parser.add_argument("--task", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--barrier", help=argparse.SUPPRESS)
    parser.add_argument("--parties", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.task:
        task(args)
        return 0
    if args.spy:
        Path(args.spy).mkdir(parents=True, exist_ok=True)
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    layouts = [tuple(map(int, spec.split("x"))) for spec in args.layouts.split(",")]
    figures: dict = {f"{w}x{p}": [] for w, p in layouts}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.rounds):  # interleaved: a busy moment hits every layout
            for workers, ps in layouts:
                figures[f"{workers}x{ps}"].append(run_layout(workers, ps, args, Path(folder)))
    print(f"{'workers x ps':>12}  {'examples/s (best)':>18}  {'median':>10}")
    for name, values in figures.items():
        print(f"{name:>12}  {max(values):>18,.0f}  {statistics.median(values):>10,.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"batch": args.batch, "steps": args.steps,
                                               "examples_per_s": figures}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
