"""A parameter-server worker's peak memory against the size of its embedding table.

For each table size, a ps task and a worker run as processes of this script on loopback:
the worker (the job's chief: it also checkpoints and digests) builds ``nn.EmbeddingBag(rows, 32, sparse=True)`` and a linear head in
``strategy.scope()`` (seeded), trains a few Adagrad steps, writes a checkpoint by shard,
takes the model's digest and ends the job. It reports its peak resident memory (the
kernel's ``ru_maxrss``) and what it held before building the model; the growth is the
difference. Beside it, ``plain``: the same model built by plain torch in a process of its
own (what a worker held before tables were made on the ps tasks), for scale.

    python benchmarks/ps_worker_memory.py                       # 1M and 4M rows, a table
    python benchmarks/ps_worker_memory.py --rows 250000 1000000 --json mem.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import threading

DIM = 32


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _build(rows: int):
    import torch
    torch.manual_seed(0)
    table = torch.nn.EmbeddingBag(rows, DIM, mode="sum", sparse=True)
    head = torch.nn.Linear(DIM, 1)
    return torch.nn.ModuleDict({"table": table, "head": head})


def plain(rows: int) -> dict:
    import torch  # noqa: F401 - loaded before the baseline is read
    before = _peak_mib()
    _build(rows)
    return {"before_mib": before, "peak_mib": _peak_mib()}


def worker(spec: dict, rows: int, folder: str) -> dict:
    import torch
    from csrun.core import ParameterServerStrategy
    from csrun.core.runner.digests import params_sha256
    strategy = ParameterServerStrategy(cluster_spec=spec, task_type="worker", task_id=0,
                                       timeout=120)
    before = _peak_mib()
    with strategy.scope():
        model = _build(rows)
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    ids = torch.randint(0, rows, (64, 4), generator=torch.Generator().manual_seed(1))
    for _ in range(5):
        optimizer.zero_grad()
        strategy.run(lambda i: model["head"](model["table"](i)).sum().backward(), args=(ids,))
        optimizer.step()
    strategy.extended.save_shards(folder, "ckpt-00000005")
    digest = params_sha256(model)
    strategy.extended.finish(timeout=60)
    return {"before_mib": before, "peak_mib": _peak_mib(), "digest": digest}


def ps(spec: dict) -> None:
    from csrun.core.cluster.resolvers import SimpleClusterResolver
    from csrun.core.cluster.server import ParameterServer
    ParameterServer(SimpleClusterResolver(spec, "ps", 0), timeout=120,
                    chief="worker:0").serve()


def _child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE,
                            text=True)


def measure(rows: int) -> dict:
    from csrun.core.runner.launch import free_ports
    ports = free_ports(2)
    spec = json.dumps({"worker": [f"127.0.0.1:{ports[0]}"], "ps": [f"127.0.0.1:{ports[1]}"]})
    with tempfile.TemporaryDirectory() as folder:
        server = _child("--role", "ps", "--spec", spec)
        threading.Event().wait(1.0)  # ps:0 hosts the store
        job = _child("--role", "worker", "--spec", spec, "--rows", str(rows),
                     "--folder", folder)
        out, _ = job.communicate(timeout=600)
        server.wait(timeout=120)
    baseline, _ = _child("--role", "plain", "--rows", str(rows)).communicate(timeout=600)
    csrun, torch_alone = json.loads(out), json.loads(baseline)
    table_mib = rows * DIM * 4 / 2**20
    return {"rows": rows, "table_mib": table_mib,
            "worker_growth_mib": csrun["peak_mib"] - csrun["before_mib"],
            "plain_growth_mib": torch_alone["peak_mib"] - torch_alone["before_mib"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000_000, 4_000_000])
    parser.add_argument("--json", help="write the results here too")
    parser.add_argument("--role", choices=["ps", "worker", "plain"], help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.role == "ps":
        return ps(json.loads(args.spec))
    if args.role in ("worker", "plain"):
        result = worker(json.loads(args.spec), args.rows[0], args.folder) \
            if args.role == "worker" else plain(args.rows[0])
        print(json.dumps(result))
        return None
    results = [measure(rows) for rows in args.rows]
    print(f"{'rows':>10} {'table MiB':>10} {'worker growth MiB':>18} {'plain build MiB':>16}")
    for r in results:
        print(f"{r['rows']:>10,} {r['table_mib']:>10.0f} {r['worker_growth_mib']:>18.1f} "
              f"{r['plain_growth_mib']:>16.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results}, f, indent=2)
    return None


if __name__ == "__main__":
    main()
