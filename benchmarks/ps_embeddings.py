"""Embedding tables on parameter servers: rows served against whole tables, in one run.

A DLRM-like model on synthetic clicks: 13 dense features through a bottom MLP
(13-64-32), embedding tables (default 1,000,000, 600,000 and 400,000 rows of 32 floats:
2M rows; all but the last an ``nn.EmbeddingBag`` summing ``--hotness`` ids, the last an
``nn.Embedding``), DLRM's dot interaction, a top MLP (-64-1) and a logit; BCE loss, SGD
(or Adagrad). Ids follow a Zipf-like law (exponent ``--zipf``) whose ranks a fixed hash
scatters over the table; a click is a hidden rule of the dense features and the ids, so
the loss falls. Each worker trains on its slice of every global batch.

Four measures, each its variants side by side (ps and workers are processes of this
script, started as ``parameter_server.py`` starts them; a worker gets
``cpu_count // workers`` threads, a ps one):

a. **bytes**: a worker step's payload (``strategy.extended.transfer_stats()``) against the
   **touched-rows bound**: per table, the step's unique ids x (row bytes + 8 for the id),
   pulled and pushed, plus the dense MLP whole each way. Target <= 1.5x.
b. **speed**: examples/s with rows served against ``serve_embedding_rows=False`` (every
   table pushed and pulled whole each step, the path csrun had before) on one 1M x 32
   table, in paired rounds at ``--batch`` and once at other batches. Target >= 20x.
c. **links**: 1, 2, 4 workers x 1, 2 ps, each task a network namespace with its link
   limited (``--links 1gbit``), against the bandwidth bound of the touched-rows bytes;
   skipped, saying why, where namespaces cannot be made (they need root).
d. **memory**: a worker's peak (``ru_maxrss``) and steady-state RSS with a 1 GiB table
   (8,388,608 x 32 float32), rows served against whole tables.

    python benchmarks/ps_embeddings.py --json emb.json        # everything, 5 to 8 min on 2 cores
    python benchmarks/ps_embeddings.py --quick                  # a smoke run, tiny tables
    python benchmarks/ps_embeddings.py --measures bytes,speed   # some of it
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DENSE_FEATURES, BOTTOM, TOP = 13, (64,), (64,)
MODELS = {"dlrm": (1_000_000, 600_000, 400_000),  # table rows
          "one_1m": (1_000_000,), "one_1gib": (8_388_608,)}
RATES = {"100mbit": 1e8, "1gbit": 1e9, "10gbit": 1e10}
ID_BYTES = 8  # an int64 row id travels with each row


# -- the model and its data (run in the tasks) -----------------------------------------
def build_model(tables, dim: int, sparse: bool):
    import torch
    import torch.nn as nn

    def mlp(sizes):
        layers = []
        for a, b in zip(sizes, sizes[1:]):
            layers += [nn.Linear(a, b), nn.ReLU()]
        return layers

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            self.bottom = nn.Sequential(*mlp((DENSE_FEATURES, *BOTTOM, dim)))
            # bags sum --hotness ids; the last table is a plain one-hot nn.Embedding
            self.tables = nn.ModuleList(
                [nn.EmbeddingBag(rows, dim, mode="sum", sparse=sparse) for rows in tables[:-1]]
                + [nn.Embedding(tables[-1], dim, sparse=sparse)])
            features = len(tables) + 1
            self.pairs = [[i for i in range(features) for _ in range(i)],
                          [j for i in range(features) for j in range(i)]]  # below the diagonal
            self.top = nn.Sequential(*mlp((dim + len(self.pairs[0]), *TOP)),
                                     nn.Linear(TOP[-1], 1))

        def forward(self, dense, *ids):
            x = self.bottom(dense)
            looked = [t(i) for t, i in zip(self.tables, ids)]
            stacked = torch.stack([x, *looked], dim=1)            # (B, F, dim)
            dots = torch.bmm(stacked, stacked.transpose(1, 2))    # DLRM's dot interaction
            return self.top(torch.cat([x, dots[:, self.pairs[0], self.pairs[1]]], 1)).squeeze(1)

    return DLRM()


def zipf_ids(rows: int, shape, s: float, generator):
    """Ids whose ranks follow p(r) ~ r^-s on 1..rows (inverse CDF), hashed over the table:
    hot rows land everywhere, not all in the first shard."""
    import torch
    u = torch.rand(shape, generator=generator, dtype=torch.float64)
    top = rows ** (1.0 - s)
    rank = ((top - 1.0) * u + 1.0) ** (1.0 / (1.0 - s))  # in [1, rows]
    rank = rank.long().clamp_(1, rows) - 1
    return (rank * 2_147_483_647) % rows  # a prime above any table: a bijection


def hidden_sign(ids):
    """The hidden rule's +-1 per row: a hash of the id, so nothing table-sized is kept."""
    return (((ids * 2_654_435_761) & 0xFFFFFFFF) >> 16 & 1).float() * 2 - 1


def clicks(tables, batch: int, count: int, hotness: int, zipf: float, seed: int):
    """``count`` global batches: (dense, labels, ids of each table)."""
    import torch
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(DENSE_FEATURES, generator=torch.Generator().manual_seed(7))
    out = []
    for _ in range(count):
        dense = torch.randn(batch, DENSE_FEATURES, generator=g)
        ids = [zipf_ids(rows, (batch, hotness), zipf, g) for rows in tables[:-1]]
        ids.append(zipf_ids(tables[-1], (batch,), zipf, g))
        score = dense @ weights / 2 + sum(hidden_sign(i).reshape(batch, -1).sum(1) for i in ids)
        out.append((dense, (score > 0).float(), *ids))
    return out


# -- the touched-rows bound (counted by the worker, from its own slices) ---------------
def shard_of(ids, rows: int, shards: int):
    """The shard of each row id under TF's fixed partitioner (the first rows % shards
    shards one row longer)."""
    import torch
    base, extra = divmod(rows, shards)
    cut = extra * (base + 1)  # rows in the longer shards
    return torch.where(ids < cut, ids // (base + 1), extra + (ids - cut) // max(base, 1))


def touched_bytes(ids_per_table, tables, dim: int, dense_bytes: int, num_ps: int) -> dict:
    """One worker step's bound, one direction (pull = push): every unique row with its id,
    the dense parameters whole; and the busiest ps's part (tables split by rows over the
    ps tasks, the dense parameters evenly: the most favourable split)."""
    import torch
    row = dim * 4 + ID_BYTES
    per_ps = [dense_bytes / num_ps] * num_ps
    unique = 0
    for ids, rows in zip(ids_per_table, tables):
        u = torch.unique(ids)
        unique += u.numel()
        for k, n in enumerate(torch.bincount(shard_of(u, rows, num_ps), minlength=num_ps)):
            per_ps[k] += int(n) * row
    return {"one_way": unique * row + dense_bytes, "busiest_ps": max(per_ps),
            "unique_rows": unique, "lookups": sum(i.numel() for i in ids_per_table)}


# -- one task (run as `ps_embeddings.py --task ...`) -----------------------------------
def supported(name: str) -> bool:
    """Whether this csrun's ParameterServerStrategy takes the keyword ``name``."""
    from csrun.core import ParameterServerStrategy
    return name in inspect.signature(ParameterServerStrategy.__init__).parameters


def make_strategy(args, num_ps: int):
    from csrun.core import ParameterServerStrategy
    kwargs = {"timeout": 600}
    if supported("serve_embedding_rows"):
        kwargs["serve_embedding_rows"] = args.serve == "rows"
    elif args.serve == "rows":
        raise SystemExit("serve_embedding_rows: this csrun serves whole tables only")
    if args.partition and supported("variable_partitioner"):
        from csrun.core import FixedShardsPartitioner
        kwargs["variable_partitioner"] = FixedShardsPartitioner(num_ps)
    return ParameterServerStrategy(**kwargs)


def memory() -> dict:
    """This process's resident set now and at its peak, in bytes."""
    status = dict(line.split(":", 1) for line in
                  Path("/proc/self/status").read_text().splitlines() if ":" in line)
    kib = lambda key: int(status.get(key, "0 kB").split()[0]) * 1024  # noqa: E731
    # ru_maxrss lags VmRSS by a few pages; the peak is the larger of it and VmHWM
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, kib("VmHWM"))
    return {"rss": kib("VmRSS"), "maxrss": peak}


def transfer_stats(strategy) -> dict | None:
    stats = getattr(strategy.extended, "transfer_stats", None)
    return dict(stats()) if stats else None


def task(args) -> int:
    import torch
    num_ps = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["ps"])
    strategy = make_strategy(args, num_ps)
    if args.task == "ps":
        strategy.extended.join()
        Path(args.result).write_text(json.dumps({"memory": memory()}))
        return 0
    tables, sparse = args.tables, args.sparse and args.serve == "rows"
    batches = clicks(tables, args.batch, args.warmup + args.steps, args.hotness, args.zipf, 1)
    before_model = memory()
    torch.manual_seed(0)
    with strategy.scope():
        model = build_model(tables, args.dim, sparse)
        optimizer = (torch.optim.Adagrad if args.optimizer == "adagrad" else torch.optim.SGD)(
            model.parameters(), lr=args.lr)
    dense_bytes = sum(p.numel() * 4 for n, p in model.named_parameters()
                      if not n.startswith("tables."))
    table_bytes = sum(rows * args.dim * 4 for rows in tables)
    looked_up: list[tuple] = []  # each step's ids (this worker's slice), for the bound

    def step(dense, labels, *ids):
        looked_up.append(ids)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            model(dense, *ids), labels, reduction="sum") / args.batch
        loss.backward()
        return loss.detach(), torch.tensor(labels.shape[0])

    losses, examples, begin, first, ticks = [], 0, None, None, []
    with strategy.scope():
        for i, batch in enumerate(strategy.experimental_distribute_dataset(batches)):
            if i == args.warmup:
                barrier(Path(args.barrier), args.parties)
                first, begin, looked_up = transfer_stats(strategy), time.time(), []
            optimizer.zero_grad(set_to_none=True)
            loss, count = strategy.reduce("SUM", strategy.run(step, args=batch), axis=None)
            optimizer.step()
            losses.append(float(loss))
            examples += int(count) if i >= args.warmup else 0
            ticks.append(time.perf_counter())
    end, last, steady = time.time(), transfer_stats(strategy), memory()
    strategy.extended.finish()
    bounds = [touched_bytes(ids, tables, args.dim, dense_bytes, num_ps) for ids in looked_up]
    logs = getattr(strategy.extended, "ps_logs", None) or []  # the chief's, at the end
    Path(args.result).write_text(json.dumps({
        "begin": begin, "end": end, "examples": examples, "losses": losses,
        "steps": args.steps, "stats": _delta(first, last), "bounds": bounds,
        "step_seconds": [b - a for a, b in zip(ticks[args.warmup:], ticks[args.warmup + 1:])],
        "dense_bytes": dense_bytes, "table_bytes": table_bytes,
        "ps_held_bytes": [log.get("held_bytes") for log in logs],
        "memory": {"before_model": before_model["rss"], "steady": steady["rss"],
                   "peak": steady["maxrss"]}}))
    return 0


def _delta(first: dict | None, last: dict | None) -> dict | None:
    if first is None or last is None:
        return None
    return {k: last[k] - first[k] for k in ("steps", "pushed_bytes", "pulled_bytes")}


def barrier(folder: Path, parties: int) -> None:
    """Wait until ``parties`` tasks reached this point (files in a shared folder)."""
    (folder / f"{os.getpid()}.ready").touch()
    while len(list(folder.glob("*.ready"))) < parties:
        time.sleep(0.01)


# -- the driver -------------------------------------------------------------------------
def variant(name: str, model: str, serve: str, workers: int = 1, ps: int = 1,
            steps: int | None = None, batch: int | None = None) -> dict:
    return {"name": name, "model": model, "serve": serve, "workers": workers, "ps": ps,
            "steps": steps, "batch": batch}


def tables_of(model: str, args) -> list[int]:
    return [max(16, round(rows * args.rows_scale)) for rows in MODELS[model]]


def task_argv(spec: dict, tables: list[int], args, barrier_dir: Path) -> list[str]:
    """This script as one of ``spec``'s tasks (``--task`` and ``--result`` follow)."""
    return [sys.executable, __file__, "--tables", ",".join(map(str, tables)),
            "--serve", spec["serve"], "--steps", str(spec["steps"] or args.steps),
            "--warmup", str(args.warmup), "--batch", str(spec["batch"] or args.batch),
            "--dim", str(args.dim), "--hotness", str(args.hotness), "--zipf", str(args.zipf),
            "--optimizer", args.optimizer, "--lr", str(args.lr), "--barrier", str(barrier_dir),
            "--parties", str(spec["workers"])] + (
            [] if args.sparse else ["--dense-grads"]) + (
            [] if args.partition else ["--no-partition"])


def run_variant(spec: dict, args, folder: Path, hosts=None) -> dict:
    """Start the variant's tasks (on loopback, or each on a host of ``hosts``), wait for
    them; their figures."""
    workers, ps = spec["workers"], spec["ps"]
    if hosts is None:
        from csrun.core.runner.launch import free_ports
        ports = free_ports(workers + ps)
        addresses = [f"127.0.0.1:{p}" for p in ports]
    else:
        addresses = [f"{a}:2222" for a in hosts.addresses]
    cluster = {"ps": addresses[:ps], "worker": addresses[ps:ps + workers]}
    barrier_dir = folder / f"barrier-{spec['name']}-{time.monotonic_ns()}"
    barrier_dir.mkdir()
    tables = tables_of(spec["model"], args)
    common = task_argv(spec, tables, args, barrier_dir)
    tasks = [("ps", k, 1) for k in range(ps)] + [
        ("worker", i, max(1, (os.cpu_count() or 1) // workers)) for i in range(workers)]
    procs, results = [], []
    for host, (job, index, threads) in enumerate(tasks):
        result = folder / f"{spec['name']}-{job}{index}-{time.monotonic_ns()}.json"
        env = dict(os.environ, OMP_NUM_THREADS=str(threads),
                   OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),
                   TF_CONFIG=json.dumps({"cluster": cluster,
                                         "task": {"type": job, "index": index}}))
        argv = common + ["--task", job, "--result", str(result)]
        procs.append(subprocess.Popen(hosts.command(host, argv) if hosts else argv, env=env))
        results.append((job, result))
    for proc in procs:
        if proc.wait(timeout=900) != 0:
            for other in procs:
                other.kill()
            raise SystemExit(f"{spec['name']}: a task failed (exit {proc.returncode})")
    return figures(spec, tables, args, {str(r): (job, json.loads(r.read_text()))
                                        for job, r in results})


def figures(spec: dict, tables: list[int], args, results: dict) -> dict:
    """examples/s, bytes per worker step (measured and bound), loss, memory."""
    workers = [r for job, r in results.values() if job == "worker"]
    ps = [r for job, r in results.values() if job == "ps"]
    span = max(w["end"] for w in workers) - min(w["begin"] for w in workers)
    examples = sum(w["examples"] for w in workers)
    bounds = [b for w in workers for b in w["bounds"]]
    mean = lambda key: sum(b[key] for b in bounds) / len(bounds)  # noqa: E731
    stats = [w["stats"] for w in workers]
    whole = 2 * (workers[0]["dense_bytes"] + workers[0]["table_bytes"])
    measured = None if None in stats else sum(
        s["pushed_bytes"] + s["pulled_bytes"] for s in stats) / sum(s["steps"] for s in stats)
    losses = workers[0]["losses"]
    head, tail = losses[:5], losses[-5:]
    return {**spec, "steps": workers[0]["steps"], "batch": spec["batch"] or args.batch,
            "tables": tables,
            "examples_per_s": examples / span, "seconds": span, "examples": examples,
            # robust to other jobs' bursts: each worker's typical step
            "median_step_examples_per_s": sum(
                w["examples"] / w["steps"] / statistics.median(w["step_seconds"])
                for w in workers if w["step_seconds"]) or None,
            "first_loss": sum(head) / len(head), "final_loss": sum(tail) / len(tail),
            "bytes_per_step": measured if measured is not None else (
                whole if spec["serve"] == "dense" else None),
            "bytes_source": "transfer_stats" if measured is not None else (
                "every variable each way (dense path)" if spec["serve"] == "dense" else None),
            "bound_bytes_per_step": 2 * mean("one_way"),
            "busiest_ps_bytes_per_step": mean("busiest_ps"),
            "unique_rows_per_step": mean("unique_rows"), "lookups_per_step": mean("lookups"),
            "worker_memory": workers[0]["memory"], "ps_memory": ps[0]["memory"]["maxrss"],
            # the machine's 1-minute load as the variant ended: this run's tasks and others'
            "load_average": os.getloadavg()[0],
            "ps_held_bytes": next((w["ps_held_bytes"] for w in workers if w["ps_held_bytes"]),
                                  None)}


def features() -> dict:
    """What this csrun offers of the embedding API (a branch before it serves rows)."""
    from csrun.core import ParameterServerStrategy
    from csrun.core.cluster.parameter_server_strategy import ParameterServerClusterExtended
    return {"serve_embedding_rows": supported("serve_embedding_rows"),
            "variable_partitioner": supported("variable_partitioner"),
            "transfer_stats": hasattr(ParameterServerClusterExtended, "transfer_stats")
            or hasattr(ParameterServerStrategy, "transfer_stats")}


NO_ROWS = ("this csrun has no ParameterServerStrategy(serve_embedding_rows=...): "
           "rows serving not measured")


def side_by_side(model: str, args, folder: Path, have: dict, rows_steps: int,
                 dense_steps: int, batch: int | None = None) -> dict:
    """``model`` with whole tables and with rows served, 1 worker + 1 ps on loopback."""
    out = {"dense": run_variant(variant(f"{model}-dense", model, "dense", steps=dense_steps,
                                        batch=batch), args, folder)}
    out["rows"] = run_variant(variant(f"{model}-rows", model, "rows", steps=rows_steps,
                                      batch=batch), args, folder) \
        if have["serve_embedding_rows"] else {"skipped": NO_ROWS}
    for name in ("rows", "dense"):
        print(variant_row(name, out[name]), flush=True)
    return out


def measure_bytes(args, folder: Path, have: dict) -> dict:
    out = side_by_side("dlrm", args, folder, have, args.steps, args.dense_steps)
    for v in out.values():
        if v.get("bytes_per_step") is not None:
            v["of_bound"] = v["bytes_per_step"] / v["bound_bytes_per_step"]
    return out


def measure_speed(args, folder: Path, have: dict) -> dict:
    """Rows served against whole tables on the 1M x 32 table: ``--rounds`` pairs at
    ``--batch``, where the target is judged, one at each of ``--speed-batches`` (whole
    tables cost the same per step at any batch, rows served cost per example: the
    speedup falls as the batch grows)."""
    sweep = []
    for batch in sorted({args.batch, *args.speed_batches}):
        pairs = [side_by_side("one_1m", args, folder, have, args.steps, args.dense_steps,
                              batch) for _ in range(args.rounds if batch == args.batch else 1)]
        cell = {"batch": batch, "rounds": pairs}
        if have["serve_embedding_rows"]:
            ratios = [p["rows"]["examples_per_s"] / p["dense"]["examples_per_s"] for p in pairs]
            typical = [p["rows"]["median_step_examples_per_s"] /
                       p["dense"]["median_step_examples_per_s"] for p in pairs]
            cell.update(speedup=statistics.median(ratios), speedup_min=min(ratios),
                        speedup_max=max(ratios), speedup_rounds=ratios,
                        speedup_median_step=statistics.median(typical))
            print(f"  batch {batch}: rows / whole tables {cell['speedup']:.1f}x (rounds "
                  f"{', '.join(f'{r:.1f}' for r in ratios)}); of the median steps "
                  f"{cell['speedup_median_step']:.1f}x", flush=True)
        sweep.append(cell)
    judged = next(c for c in sweep if c["batch"] == args.batch)
    return {"batch": args.batch, "speedup": judged.get("speedup"), "sweep": sweep,
            "rows": judged["rounds"][0]["rows"], "dense": judged["rounds"][0]["dense"]}


def measure_memory(args, folder: Path, have: dict) -> dict:
    return side_by_side("one_1gib", args, folder, have, args.memory_steps, args.memory_steps)


def link_bound(row: dict, rate: float, batch: int) -> float:
    """examples/s the links allow: a worker's link carries its step's rows and dense
    parameters each way (full duplex), the busiest ps's link its share of every
    worker's steps; a worker step is batch / workers examples."""
    one_way = row["bound_bytes_per_step"] / 2
    steps = min(row["workers"] * rate / 8 / one_way, rate / 8 / row["busiest_ps_bytes_per_step"])
    return steps * batch / row["workers"]


def measure_links(args, folder: Path, have: dict) -> dict:
    netns = _netns()
    if isinstance(netns, str):
        return {"skipped": netns}
    serve = "rows" if have["serve_embedding_rows"] else "dense"
    steps = args.links_steps if serve == "rows" else args.dense_steps
    out = {"rate": args.links, "serve": serve, "rows": []}
    if serve == "dense":
        out["note"] = NO_ROWS + "; the dense path ran instead"
    for cell in args.grid.split(","):
        workers, ps = (int(n) for n in cell.split("x"))
        spec = variant(f"links-{cell}", "dlrm", serve, workers, ps, steps)
        with netns.Hosts(ps + workers, args.links) as hosts:
            row = run_variant(spec, args, folder, hosts)
            out["shaping"] = hosts.shaping
        row["bound_examples_per_s"] = link_bound(row, RATES[args.links], args.batch)
        row["of_bound"] = row["examples_per_s"] / row["bound_examples_per_s"]
        if row["bytes_per_step"] is not None:
            row["bytes_of_bound"] = row["bytes_per_step"] / row["bound_bytes_per_step"]
        out["rows"].append(row)
        print(f"  {args.links} {workers}w {ps}ps: {row['examples_per_s']:8.0f} ex/s, bound "
              f"{row['bound_examples_per_s']:8.0f} ({row['of_bound']:.2f} of it); bytes "
              f"{row.get('bytes_of_bound', float('nan')):.2f}x the touched rows'", flush=True)
    return out


def _netns():
    """benchmarks/netns.py, or why network namespaces cannot be made here."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("netns", Path(__file__).with_name("netns.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.unavailable() or module


def variant_row(name: str, v: dict) -> str:
    if "skipped" in v:
        return f"  {v.get('model', ''):8s} {name:6s} skipped: {v['skipped']}"
    mib = v["bytes_per_step"] / 2**20 if v["bytes_per_step"] is not None else float("nan")
    return (f"  {v['model']:8s} {name:6s} {v['examples_per_s']:10.0f} ex/s  "
            f"{mib:10.3f} MiB/step (bound {v['bound_bytes_per_step'] / 2**20:.3f})  "
            f"loss {v['first_loss']:.3f} -> {v['final_loss']:.3f}  worker peak "
            f"{v['worker_memory']['peak'] / 2**20:.0f} MiB, steady "
            f"{v['worker_memory']['steady'] / 2**20:.0f} MiB; load {v['load_average']:.1f}")


def targets(result: dict) -> list[dict]:
    """The issue's two numeric targets, judged (or why not)."""
    out = []
    rows = result.get("bytes", {}).get("rows")
    if rows is not None:
        value = rows.get("of_bound")
        why = rows.get("skipped") or "this csrun has no strategy.extended.transfer_stats()"
        out.append({"what": "bytes per worker step / touched-rows bound (dlrm)",
                    "target": "<= 1.5", "value": value,
                    "verdict": why if value is None else "met" if value <= 1.5 else "missed"})
    speed = result.get("speed")
    if speed is not None:
        value = speed.get("speedup")
        out.append({"what": "examples/s rows served / whole tables (1M x 32)",
                    "target": ">= 20", "value": value,
                    "verdict": NO_ROWS if value is None else "met" if value >= 20 else "missed"})
    return out


def measure(args) -> dict:
    import torch
    have = features()
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", "benchmarks/ps_embeddings.py", *sys.argv[1:]]),
              "python": platform.python_version(), "torch": torch.__version__,
              "machine": f"{platform.machine()} {_cpu_name()}", "cpu_count": os.cpu_count(),
              "features": have, "settings": {k: v for k, v in vars(args).items()
                                             if k not in ("task", "result", "barrier", "json")}}
    with tempfile.TemporaryDirectory(prefix="csrun-embbench-") as tmp:
        for name in args.measures.split(","):
            print(f"{name}:", flush=True)
            result[name] = MEASURES[name](args, Path(tmp), have)
    result["targets"] = targets(result)
    for t in result["targets"]:
        shown = "-" if t["value"] is None else f"{t['value']:.2f}"
        print(f"target {t['what']} {t['target']}: {shown} ({t['verdict']})")
    return result


def _cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor()


MEASURES = {"bytes": measure_bytes, "speed": measure_speed, "links": measure_links,
            "memory": measure_memory}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--measures", default="bytes,speed,links,memory", help="which, comma-separated")
    add("--steps", type=int, default=300, help="measured steps per worker, rows served")
    add("--dense-steps", type=int, default=6, help="measured steps, whole tables")
    add("--links-steps", type=int, default=200, help="measured steps per --links cell")
    add("--memory-steps", type=int, default=3, help="measured steps, 1 GiB table")
    add("--warmup", type=int, default=2, help="steps before measuring")
    add("--rounds", type=int, default=5, help="speed: pairs (whole tables, rows) at --batch")
    add("--speed-batches", type=lambda t: [int(n) for n in t.split(",")],
        default=[512, 8192], help="speed: global batches besides --batch")
    add("--batch", type=int, default=2048, help="global batch")
    add("--dim", type=int, default=32, help="embedding width")
    add("--hotness", type=int, default=2, help="ids per bag (all tables but the last)")
    add("--zipf", type=float, default=1.1, help="exponent of the ids' power law")
    add("--rows-scale", type=float, default=1.0, help="multiply every table's rows")
    add("--optimizer", choices=["sgd", "adagrad"], default="sgd")
    add("--lr", type=float, default=0.05)
    add("--dense-grads", dest="sparse", action="store_false",
        help="rows served: sparse=False tables (default sparse=True; whole tables always "
             "sparse=False, which that path needs)")
    add("--no-partition", dest="partition", action="store_false",
        help="no FixedShardsPartitioner(num_ps): tables whole on one ps each")
    add("--links", default="1gbit", choices=list(RATES), help="link rate of each host")
    add("--grid", default="1x1,1x2,2x1,2x2,4x1,4x2", help="--links: workers x ps cells")
    add("--quick", action="store_true", help="tiny tables and few steps: a smoke run")
    add("--json", metavar="PATH", help="write the figures as JSON")
    add("--tables", type=lambda t: [int(n) for n in t.split(",")], help=argparse.SUPPRESS)
    add("--serve", choices=["rows", "dense"], help=argparse.SUPPRESS)
    add("--task", choices=["worker", "ps"], help=argparse.SUPPRESS)
    add("--result", help=argparse.SUPPRESS)
    add("--barrier", help=argparse.SUPPRESS)
    add("--parties", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.task:
        return task(args)
    if args.quick:
        args.rows_scale, args.batch, args.warmup = 0.001, 128, 1
        args.steps, args.dense_steps, args.links_steps, args.memory_steps = 5, 2, 3, 2
        args.rounds, args.speed_batches = 1, []
    unknown = set(args.measures.split(",")) - set(MEASURES)
    if unknown:
        parser.error(f"--measures: unknown {sorted(unknown)}; choose from {list(MEASURES)}")
    result = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
