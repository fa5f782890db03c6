"""csrun's parameter servers against TensorFlow 2.21's, side by side in one run.

The model (issue 37's wide-and-deep): 4 embedding tables of 32 floats a row (4,000,000,
400,000, 100,000 and 60,000 rows: 4.56M), each looked up by a multi-hot feature of 1 to
``--hotness`` ids an example (per table), the ids following a Zipf law (``--zipf``)
whose ranks a fixed hash scatters over the table, averaged per example (csrun:
``nn.EmbeddingBag(mode="sum", sparse=True)`` over the ids padded to the longest, padding
weighed 0, divided by the count; TF: ``tf.nn.safe_embedding_lookup_sparse(table, ids,
combiner="mean")`` on the ``ShardedVariable``); a deep part (the 13 dense features and
the 4 averages through a 141-256-128-1 MLP) plus a wide part (a linear layer on the
dense features); the logit's BCE loss; Adagrad (``--lr``, accumulators from 0, eps 1e-10,
torch's defaults; TF: its fused ``ResourceSparseApplyAdagradV2``/``ResourceApplyAdagradV2``
kernels, deduplicated rows, on the ps tasks); every variable split in ``--shards``
shards (``FixedShardsPartitioner`` in both) placed round-robin over the ps tasks.

Data: generated once per run with numpy (seeded) and written as raw arrays, one folder a
worker; both frameworks read the same shares: worker w of W trains on examples
``[w*B/W, (w+1)*B/W)`` of every global batch of ``--batch`` B.

* csrun: one process per task, as ``csrun launch`` starts them (``TF_CONFIG``; 1 thread
  per ps, ``cores // workers`` per worker); a worker's plain loop:
  ``strategy.run(step, args=batch)``, ``optimizer.step()``.
* TF: a ``tf.distribute.Server`` per ps and worker task and a coordinator (the chief)
  with ``ParameterServerStrategy`` + ``ClusterCoordinator``: a ``tf.function`` step
  scheduled ``--steps`` times per worker over per-worker datasets (each TF worker reads
  its share from its own working directory, as a machine reads its local disk: TF 2.21
  gives every worker's ``dataset_fn`` the same ``InputContext``); TF's default threads.

Cells (``--grid``, default 2 workers x 2 ps and 1 x 1): csrun and TF in paired rounds
(``--rounds``; the order alternates round by round), each run with the machine's
1-minute load average before it and after it (other jobs on the machine show there).
examples/s counts the ``--steps`` measured steps of every worker, after ``--warmup``.
TensorFlow is run by ``--tf-python PATH`` (a Python with ``tensorflow-cpu==2.21.0``);
without it, or when it cannot import tensorflow, the output says so and only csrun runs.

    python benchmarks/ps_vs_tf.py --tf-python ~/tfvenv/bin/python --json ps_vs_tf.json
    python benchmarks/ps_vs_tf.py --tf-python ~/tfvenv/bin/python --quick   # small tables
    python benchmarks/ps_vs_tf.py --quick                                  # csrun alone
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np  # both frameworks' Pythons have it; neither torch nor tf is imported here

TABLES = (4_000_000, 400_000, 100_000, 60_000)
DIM, DENSE, HIDDEN = 32, 13, (256, 128)
HOTNESS = (8, 4, 4, 2)  # most ids an example looks up in each table (at least 1)
QUICK_SCALE = 0.001  # --quick: tables 4,000 / 400 / 100 / 60 rows
ADAGRAD_EPS = 1e-10  # torch.optim.Adagrad's default, used by both


# -- the data (numpy only, shared by both frameworks) -----------------------------------
def zipf_ids(rows: int, shape, s: float, rng: np.random.Generator) -> np.ndarray:
    """Ids whose ranks follow p(r) ~ r^-s on 1..rows, hashed over the table (hot rows
    land in every shard)."""
    u = rng.random(shape)
    top = rows ** (1.0 - s)
    rank = np.clip((((top - 1.0) * u + 1.0) ** (1.0 / (1.0 - s))).astype(np.int64), 1, rows)
    return ((rank - 1) * 2_147_483_647) % rows


def hidden_sign(ids: np.ndarray) -> np.ndarray:
    return (((ids * 2_654_435_761) & 0xFFFFFFFF) >> 16 & 1).astype(np.float32) * 2 - 1


def examples(tables, hotness, count: int, zipf: float, seed: int) -> dict:
    """``count`` examples: dense features, labels, and per table padded ids + lengths;
    a click is a hidden rule of the dense features and the ids, so the loss falls."""
    rng = np.random.default_rng(seed)
    dense = rng.standard_normal((count, DENSE), dtype=np.float32)
    weights = np.random.default_rng(7).standard_normal(DENSE).astype(np.float32)
    score = dense @ weights / 2
    out = {"dense": dense}
    for t, (rows, most) in enumerate(zip(tables, hotness)):
        lengths = rng.integers(1, most + 1, count).astype(np.int32)
        ids = zipf_ids(rows, (count, most), zipf, rng)
        ids[np.arange(most)[None, :] >= lengths[:, None]] = 0  # padding
        mask = np.arange(most)[None, :] < lengths[:, None]
        score += (hidden_sign(ids) * mask).sum(1) / lengths
        out[f"ids{t}"], out[f"len{t}"] = ids, lengths
    out["label"] = (score > 0).astype(np.float32)
    return out


def write_shares(folder: Path, data: dict, batch: int, workers: int) -> None:
    """Worker w's share of every global batch, as raw arrays in ``folder/w{w}``."""
    count = len(data["label"])
    local = batch // workers
    for w in range(workers):
        rows = np.concatenate([np.arange(b + w * local, b + (w + 1) * local)
                               for b in range(0, count, batch)])
        share = folder / f"w{w}"
        share.mkdir(parents=True)
        for name, array in data.items():
            np.ascontiguousarray(array[rows]).tofile(share / f"{name}.bin")


def read_share(folder: Path, tables: int, hotness) -> dict:
    out = {"dense": np.fromfile(folder / "dense.bin", np.float32).reshape(-1, DENSE),
           "label": np.fromfile(folder / "label.bin", np.float32)}
    for t in range(tables):
        out[f"ids{t}"] = np.fromfile(folder / f"ids{t}.bin", np.int64).reshape(-1, hotness[t])
        out[f"len{t}"] = np.fromfile(folder / f"len{t}.bin", np.int32)
    return out


# -- csrun's tasks ----------------------------------------------------------------------
def csrun_model(tables, jagged: bool):
    """The model as a csrun user writes it: the tables in an ``EmbeddingBagCollection``
    fed jagged features (one lookup per ps a step, no padding); ``jagged=False``: the
    secondary form, ``nn.EmbeddingBag`` tables called one by one on padded ids (padding
    weighed 0, the sum divided by the count)."""
    import torch
    import torch.nn as nn

    from csrun.core import EmbeddingBagCollection

    class WideAndDeep(nn.Module):
        def __init__(self):
            super().__init__()
            bags = {f"t{t}": nn.EmbeddingBag(rows, DIM, mode="mean" if jagged else "sum",
                                             sparse=True) for t, rows in enumerate(tables)}
            self.tables = EmbeddingBagCollection(bags) if jagged else nn.ModuleDict(bags)
            for table in bags.values():
                nn.init.normal_(table.weight, std=0.05)
            sizes = (DENSE + DIM * len(tables), *HIDDEN)
            layers = []
            for a, b in zip(sizes, sizes[1:]):
                layers += [nn.Linear(a, b), nn.ReLU()]
            self.deep = nn.Sequential(*layers, nn.Linear(sizes[-1], 1))
            self.wide = nn.Linear(DENSE, 1)

        def forward(self, dense, features):
            if jagged:  # {"t0": JaggedTensor, ...}: every table's rows in one request per ps
                pooled = self.tables(features)
                bags = [pooled[f"t{t}"] for t in range(len(tables))]
            else:  # {"t0": (padded ids, lengths), ...}
                bags = []
                for t in range(len(tables)):
                    ids, lengths = features[f"t{t}"]
                    mask = (torch.arange(ids.shape[1]) < lengths[:, None]).float()
                    bags.append(self.tables[f"t{t}"](ids, per_sample_weights=mask)
                                / lengths[:, None])
            return (self.deep(torch.cat([dense, *bags], 1)) + self.wide(dense)).squeeze(1)

    return WideAndDeep()


def csrun_batches(data: dict, tables: int, local: int, count: int, jagged: bool):
    """The share's first ``count`` batches of ``local`` examples: (dense, label,
    features), a feature a ``JaggedTensor`` (the ids without padding) or (padded ids,
    lengths)."""
    import torch

    from csrun.core import JaggedTensor
    columns = {}
    for t in range(tables):
        ids, lengths = data[f"ids{t}"], data[f"len{t}"].astype(np.int64)
        if jagged:  # as a user's data hold them: each example's ids, one after another
            values = ids[np.arange(ids.shape[1])[None, :] < lengths[:, None]]
            starts = np.concatenate([[0], np.cumsum(lengths)])
            columns[t] = (values, starts, lengths)
        else:
            columns[t] = (ids, None, lengths)
    out = []
    for i in range(count):
        a, b = i * local, (i + 1) * local
        features = {}
        for t, (ids, starts, lengths) in columns.items():
            n = torch.from_numpy(lengths[a:b])
            features[f"t{t}"] = (JaggedTensor.from_lengths(
                torch.from_numpy(ids[starts[a]:starts[b]]), n) if jagged
                else (torch.from_numpy(ids[a:b]), n))
        out.append((torch.from_numpy(data["dense"][a:b]), torch.from_numpy(data["label"][a:b]),
                    features))
    return out


def csrun_task(args) -> int:
    import torch
    import torch.nn.functional as F

    from csrun.core import FixedShardsPartitioner, ParameterServerStrategy
    strategy = ParameterServerStrategy(
        timeout=600, variable_partitioner=FixedShardsPartitioner(args.shards))
    first = json.loads(os.environ["TF_CONFIG"])["task"]["index"] == 0
    profile = profiler(args) if first else None
    if strategy.extended.is_ps:
        if profile:
            profile.enable()
        strategy.extended.join()
        if profile:
            profile.disable()
            profile.dump_stats(str(Path(args.profile) / f"{args.task}-ps0-{args.workers}w.prof"))
        return 0
    data = read_share(Path(args.share), len(args.tables), args.hotness)
    local = args.batch // args.workers
    jagged = args.task == "csrun"
    batches = csrun_batches(data, len(args.tables), local, args.warmup + args.steps, jagged)
    torch.manual_seed(0)
    with strategy.scope():
        model = csrun_model(args.tables, jagged)
        optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr, eps=ADAGRAD_EPS)

    def step(dense, label, features):
        loss = F.binary_cross_entropy_with_logits(model(dense, features), label)
        loss.backward()
        return loss.detach()

    losses, begin = [], None
    for i, batch in enumerate(batches):
        if i == args.warmup:
            barrier(Path(args.barrier), args.workers)
            begin = time.time()
            if profile:
                profile.enable()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(strategy.run(step, args=batch)))
        optimizer.step()
    end = time.time()
    if profile:
        profile.disable()
        profile.dump_stats(str(Path(args.profile) / f"{args.task}-worker0-{args.workers}w.prof"))
    strategy.extended.finish()
    Path(args.result).write_text(json.dumps({"begin": begin, "end": end, "losses": losses,
                                             "examples": args.steps * local}))
    return 0


def profiler(args):
    """--profile: a cProfile of worker0's measured steps, and of ps0's serving."""
    if not args.profile:
        return None
    import cProfile
    Path(args.profile).mkdir(parents=True, exist_ok=True)
    return cProfile.Profile()


def barrier(folder: Path, parties: int) -> None:
    """Wait until ``parties`` tasks reached this point (files in a shared folder)."""
    (folder / f"{os.getpid()}.ready").touch()
    deadline = time.monotonic() + 600
    while len(list(folder.glob("*.ready"))) < parties:
        if time.monotonic() > deadline:
            raise SystemExit("barrier: the other workers never came")
        time.sleep(0.01)


# -- TensorFlow's tasks (run by --tf-python) --------------------------------------------
def tf_server() -> int:
    """A ps or worker task: serve until killed (TF's servers never return)."""
    import tensorflow as tf
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                         task_index=resolver.task_id, protocol="grpc", start=True).join()
    return 0


def tf_variables(tf, strategy, tables):
    """The model's variables in the strategy's scope (initialized as torch's: tables
    N(0, 0.05), dense layers U(+-1/sqrt(fan_in))), and an Adagrad accumulator beside
    each shard (colocated with it, on its ps)."""
    normal = tf.random_normal_initializer(stddev=0.05)

    def uniform(shape, fan_in):
        return tf.random.uniform(shape, -fan_in ** -0.5, fan_in ** -0.5, seed=0)

    with strategy.scope():
        embeddings = [tf.Variable(lambda rows=rows: normal([rows, DIM]), shape=[rows, DIM],
                                  dtype=tf.float32) for rows in tables]
        sizes = (DENSE + DIM * len(tables), *HIDDEN, 1)
        dense = []
        for a, b in [*zip(sizes, sizes[1:]), (DENSE, 1)]:
            dense += [tf.Variable(uniform([a, b], a)), tf.Variable(uniform([b], a))]
        shards = [s for v in embeddings + dense for s in getattr(v, "variables", [v])]
        accumulators = []
        for shard in shards:
            with strategy.extended.colocate_vars_with(shard):
                accumulators.append(tf.Variable(lambda s=shard: tf.zeros(s.shape),
                                                shape=shard.shape, dtype=tf.float32))
    return embeddings, dense, shards, accumulators


def tf_bag(tf, table, ids, lengths, form: str):
    """One example's mean of its rows: TF's sparse lookup (``sparse``), or a dense lookup
    of the padded ids with the padding weighed 0 (``padded``, as csrun's padded form)."""
    if form == "sparse":
        ragged = tf.RaggedTensor.from_tensor(ids, lengths=lengths)
        return tf.nn.safe_embedding_lookup_sparse(table, ragged.to_sparse(), combiner="mean")
    mask = tf.sequence_mask(lengths, tf.shape(ids)[1], dtype=tf.float32)
    rows = tf.nn.embedding_lookup(table, ids)
    return tf.reduce_sum(rows * mask[:, :, None], 1) / \
        tf.cast(lengths, tf.float32)[:, None]


def tf_step_fn(tf, strategy, embeddings, dense, shards, accumulators, hotness, lr,
               form="sparse"):
    """The scheduled step: lookups, the MLP, BCE, Adagrad on every shard."""
    def forward(batch):
        x, label = batch["dense"], batch["label"]
        bags = [tf_bag(tf, table, batch[f"ids{t}"], batch[f"len{t}"], form)
                for t, table in enumerate(embeddings)]
        h = tf.concat([x, *bags], 1)
        for k in range(0, len(dense) - 4, 2):
            h = tf.nn.relu(tf.matmul(h, dense[k]) + dense[k + 1])
        logit = tf.matmul(h, dense[-4]) + dense[-3] + tf.matmul(x, dense[-2]) + dense[-1]
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(label, logit[:, 0]))

    def apply(grad, shard, accumulator):
        if isinstance(grad, tf.IndexedSlices):  # rows: summed per unique id, as torch's
            rows, where = tf.unique(grad.indices)
            values = tf.math.unsorted_segment_sum(grad.values, where, tf.shape(rows)[0])
            return tf.raw_ops.ResourceSparseApplyAdagradV2(
                var=shard.handle, accum=accumulator.handle, lr=lr, epsilon=ADAGRAD_EPS,
                grad=values, indices=rows)
        return tf.raw_ops.ResourceApplyAdagradV2(var=shard.handle, accum=accumulator.handle,
                                                 lr=lr, epsilon=ADAGRAD_EPS, grad=grad)

    def replica_fn(batch):
        with tf.GradientTape() as tape:
            loss = forward(batch)
        for grad, shard, acc in zip(tape.gradient(loss, shards), shards, accumulators):
            apply(grad, shard, acc)
        return loss

    @tf.function
    def step(iterator):
        return strategy.run(replica_fn, args=(next(iterator),))
    return step


def tf_dataset_fn(tf, tables: int, hotness, local: int):
    """A worker's share, read from its working directory (see the module docstring)."""
    def read(name, dtype, width=None):
        raw = tf.io.decode_raw(tf.io.read_file(f"{name}.bin"), dtype)
        return raw if width is None else tf.reshape(raw, [-1, width])

    def dataset_fn(_context):
        columns = {"dense": read("dense", tf.float32, DENSE), "label": read("label", tf.float32)}
        for t in range(tables):
            columns[f"ids{t}"] = read(f"ids{t}", tf.int64, hotness[t])
            columns[f"len{t}"] = tf.cast(read(f"len{t}", tf.int32), tf.int64)
        # repeated: the coordinator gives a step to whichever worker is free, so a faster
        # worker may take more than its share of the scheduled steps
        return tf.data.Dataset.from_tensor_slices(columns).batch(local, drop_remainder=True) \
            .repeat().prefetch(2)
    return dataset_fn


def tf_chief(args) -> int:
    import tensorflow as tf
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    strategy = tf.distribute.experimental.ParameterServerStrategy(
        resolver, variable_partitioner=tf.distribute.experimental.partitioners
        .FixedShardsPartitioner(args.shards))
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    variables = tf_variables(tf, strategy, args.tables)
    step = tf_step_fn(tf, strategy, *variables, args.hotness, args.lr, args.tf_form)
    dataset_fn = tf_dataset_fn(tf, len(args.tables), args.hotness, args.batch // args.workers)
    per_worker = coordinator.create_per_worker_dataset(
        lambda: strategy.distribute_datasets_from_function(dataset_fn))
    iterator = iter(per_worker)
    warm = [coordinator.schedule(step, args=(iterator,)) for _ in range(args.warmup * args.workers)]
    coordinator.join()
    begin = time.time()
    measured = [coordinator.schedule(step, args=(iterator,))
                for _ in range(args.steps * args.workers)]
    coordinator.join()
    end = time.time()
    losses = [float(r.fetch()) for r in warm + measured]
    Path(args.result).write_text(json.dumps({
        "begin": begin, "end": end, "losses": losses, "tensorflow": tf.__version__,
        "examples": args.steps * args.batch}))
    return 0


# -- the driver -------------------------------------------------------------------------
def tf_available(python: str | None) -> tuple[str | None, str]:
    """TensorFlow's version under ``python``, or None and why it is not measured."""
    if not python:
        return None, ("TensorFlow not measured: no --tf-python given (a Python with "
                      "tensorflow-cpu==2.21.0, e.g. python3 -m venv tfvenv && "
                      "tfvenv/bin/pip install tensorflow-cpu==2.21.0)")
    try:
        done = subprocess.run([python, "-c", "import tensorflow as tf; print(tf.__version__)"],
                              capture_output=True, text=True, timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"TensorFlow not measured: {python} did not run ({exc})"
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return None, f"TensorFlow not measured: {python} cannot import tensorflow ({last})"
    return done.stdout.strip().splitlines()[-1], ""


def task_argv(python: str, task: str, args, workers: int, extra: list[str]) -> list[str]:
    return [python, str(Path(__file__).resolve()), "--task", task,
            "--tables", ",".join(map(str, args.tables)),
            "--hotness", ",".join(map(str, args.hotness)), "--batch", str(args.batch),
            "--workers", str(workers), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--lr", str(args.lr), "--shards", str(args.shards),
            "--tf-form", args.tf_form,
            *(["--profile", str(Path(args.profile).resolve())] if args.profile else []),
            *extra]


def start(argv, cluster: dict, job: str, index: int, logs: Path, cwd=None,
          launched: bool = False):
    """Start a task; ``launched``: with the thread settings ``csrun launch`` gives its
    tasks (:func:`csrun.core.runner.launch.thread_settings`), as csrun's users run."""
    env = dict(os.environ, TF_CONFIG=json.dumps({"cluster": cluster,
                                                 "task": {"type": job, "index": index}}))
    if launched:
        from csrun.core.runner.launch import thread_settings
        env.update(thread_settings(f"{job}:{index}", len(cluster["worker"])))
    log = open(logs / f"{job}{index}.log", "w")  # noqa: SIM115 -- closed by the reaper
    return subprocess.Popen(argv, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)


class CpuWatch:
    """Every task's CPU seconds (its threads together), sampled every 0.1 s from
    ``/proc`` (Linux; elsewhere nothing): what each kind of task spent on the measured
    steps, read between their begin and end times."""

    def __init__(self, procs: dict):
        self.samples: list[tuple[float, dict]] = []
        self._procs, self._stop = procs, threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _cpu(self, pid: int) -> float | None:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / self._tick  # utime + stime

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            now = {name: self._cpu(proc.pid) for name, proc in self._procs.items()}
            self.samples.append((time.time(), now))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def spent(self, begin: float, end: float) -> dict | None:
        """CPU seconds per task between ``begin`` and ``end`` (wall-clock times)."""
        def at(when):
            before = [s for s in self.samples if s[0] <= when]
            return before[-1][1] if before else None
        first, last = at(begin), at(end)
        if not first or not last:
            return None
        return {name: round(last[name] - first[name], 3) for name in first
                if first[name] is not None and last.get(name) is not None}


def cpu_per_step(spent: dict | None, steps: int) -> dict | None:
    """CPU milliseconds a global batch cost (``steps`` of them), by kind of task (worker,
    ps, chief): what the tasks spent together, however many cores they had."""
    if not spent:
        return None
    kinds: dict = {}
    for name, seconds in spent.items():
        kind = name.rstrip("0123456789")
        kinds[kind] = kinds.get(kind, 0.0) + seconds
    return {kind: round(1e3 * seconds / steps, 1) for kind, seconds in kinds.items()}


def reap(procs: dict, waited: list[str], logs: Path, timeout: float) -> None:
    """Wait for the ``waited`` tasks; then end the rest. A failure shows its log."""
    deadline = time.monotonic() + timeout
    try:
        for name in waited:
            code = procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
            if code:
                tail = (logs / f"{name}.log").read_text()[-3000:]
                raise SystemExit(f"task {name} failed (exit {code}):\n{tail}")
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_csrun(workers: int, ps: int, args, folder: Path, task: str = "csrun") -> dict:
    """``task``: ``csrun`` (the collection on jagged features) or ``csrun-padded``."""
    from csrun.core.runner.launch import free_ports
    ports = free_ports(workers + ps)
    cluster = {"ps": [f"127.0.0.1:{p}" for p in ports[:ps]],
               "worker": [f"127.0.0.1:{p}" for p in ports[ps:]]}
    run = Path(tempfile.mkdtemp(prefix="csrun-", dir=folder))
    procs = {f"ps{k}": start(task_argv(sys.executable, task, args, workers, []),
                             cluster, "ps", k, run, launched=True) for k in range(ps)}
    for w in range(workers):
        share = folder / f"W{workers}" / f"w{w}"
        procs[f"worker{w}"] = start(task_argv(sys.executable, task, args, workers, [
            "--share", str(share), "--result", str(run / f"w{w}.json"), "--barrier", str(run)]),
            cluster, "worker", w, run, launched=True)
    spies = spy_on(procs, args.spy, f"{task}-{workers}x{ps}") if args.spy else []
    watch = CpuWatch(procs)
    try:
        reap(procs, [f"worker{w}" for w in range(workers)] + [f"ps{k}" for k in range(ps)],
             run, args.timeout)
    finally:
        watch.stop()
    for spy in spies:
        spy.wait(timeout=60)
    results = [json.loads((run / f"w{w}.json").read_text()) for w in range(workers)]
    begin, end = min(r["begin"] for r in results), max(r["end"] for r in results)
    return {"examples_per_s": sum(r["examples"] for r in results) / (end - begin),
            "seconds": end - begin, "losses": results[0]["losses"],
            "cpu_ms_per_batch": cpu_per_step(watch.spent(begin, end), args.steps)}


def py_spy() -> str:
    """py-spy's path: on PATH, or where ``pip install --user py-spy`` puts it."""
    return shutil.which("py-spy") or str(Path.home() / ".local/bin/py-spy")


def spy_on(procs: dict, folder: str, label: str) -> list:
    """py-spy samples (every thread, 200 Hz; idle threads left out, so the samples are
    CPU) of worker0 and every ps into ``folder``."""
    spy = py_spy()
    Path(folder).mkdir(parents=True, exist_ok=True)
    return [subprocess.Popen([spy, "record", "--format", "raw", "--threads", "--rate",
                              "200", "-o", str(Path(folder) / f"{label}-{name}.txt"), "-p",
                              str(procs[name].pid)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
            for name in procs if name == "worker0" or name.startswith("ps")]


def run_tf(workers: int, ps: int, args, folder: Path) -> dict:
    from csrun.core.runner.launch import free_ports
    ports = free_ports(1 + workers + ps)
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"],
               "ps": [f"127.0.0.1:{p}" for p in ports[1:1 + ps]],
               "worker": [f"127.0.0.1:{p}" for p in ports[1 + ps:]]}
    run = Path(tempfile.mkdtemp(prefix="tf-", dir=folder))
    server = task_argv(args.tf_python, "tf-server", args, workers, [])
    procs = {f"ps{k}": start(server, cluster, "ps", k, run, cwd=run) for k in range(ps)}
    for w in range(workers):
        procs[f"worker{w}"] = start(server, cluster, "worker", w, run,
                                    cwd=folder / f"W{workers}" / f"w{w}")
    procs["chief0"] = start(task_argv(args.tf_python, "tf-chief", args, workers, [
        "--result", str(run / "chief.json")]), cluster, "chief", 0, run, cwd=run)
    watch = CpuWatch(procs)
    try:
        reap(procs, ["chief0"], run, args.timeout)
    finally:
        watch.stop()
    result = json.loads((run / "chief.json").read_text())
    return {"examples_per_s": result["examples"] / (result["end"] - result["begin"]),
            "seconds": result["end"] - result["begin"], "losses": result["losses"],
            "tensorflow": result["tensorflow"], "tf_form": args.tf_form,
            "cpu_ms_per_batch": cpu_per_step(
                watch.spent(result["begin"], result["end"]), args.steps)}


def measured(run, workers: int, ps: int, args, folder: Path) -> dict:
    """One run with the machine's 1-minute load average before and after it."""
    before = os.getloadavg()[0]
    out = run(workers, ps, args, folder)
    losses = out.pop("losses")
    head, tail = losses[:max(1, len(losses) // 10)], losses[-max(1, len(losses) // 10):]
    return {**out, "load_before": before, "load_after": os.getloadavg()[0],
            "first_loss": sum(head) / len(head), "final_loss": sum(tail) / len(tail)}


def cell_rounds(cell: str, args, folder: Path, tf_ok: bool) -> dict:
    workers, ps = (int(n) for n in cell.split("x"))
    rounds = []
    for r in range(args.rounds):
        sides = [("csrun", run_csrun)] + ([("tf", run_tf)] if tf_ok else []) + (
            [("csrun-padded", functools.partial(run_csrun, task="csrun-padded"))]
            if args.padded else [])
        if r % 2:
            sides.reverse()  # alternate which goes first: drift hits both
        pair = {name: measured(run, workers, ps, args, folder) for name, run in sides}
        if tf_ok:
            pair["ratio"] = pair["csrun"]["examples_per_s"] / pair["tf"]["examples_per_s"]
            if args.padded:
                pair["padded_ratio"] = (pair["csrun-padded"]["examples_per_s"]
                                        / pair["tf"]["examples_per_s"])
        rounds.append(pair)
        print(row(cell, r + 1, pair), flush=True)
    out = {"workers": workers, "ps": ps, "rounds": rounds,
           "csrun_median": statistics.median(p["csrun"]["examples_per_s"] for p in rounds)}
    if tf_ok:
        out["tf_median"] = statistics.median(p["tf"]["examples_per_s"] for p in rounds)
        out["ratio_median"] = statistics.median(p["ratio"] for p in rounds)
    if args.padded:
        out["padded_median"] = statistics.median(p["csrun-padded"]["examples_per_s"]
                                                 for p in rounds)
    return out


def row(cell: str, r: int, pair: dict) -> str:
    def side(name):
        v = pair.get(name)
        return f"{'-':>10s} {'':>11s}" if v is None else \
            f"{v['examples_per_s']:10.0f} {v['load_before']:5.1f}/{v['load_after']:<5.1f}"
    ratio = f"{pair['ratio']:8.2f}" if "ratio" in pair else f"{'-':>8s}"
    line = f"{cell:5s} {r:5d} {side('csrun')} {side('tf')} {ratio}"
    if "csrun-padded" in pair:
        shown = f"{pair['padded_ratio']:8.2f}" if "padded_ratio" in pair else f"{'-':>8s}"
        line += f"  {side('csrun-padded')} {shown}"
    cpu = [f"{name} " + " ".join(f"{kind} {ms:.0f}" for kind, ms in
                                 pair[name]["cpu_ms_per_batch"].items())
           for name in ("csrun", "tf", "csrun-padded")
           if name in pair and pair[name].get("cpu_ms_per_batch")]
    return line + ("\n      CPU ms per global batch: " + "; ".join(cpu) if cpu else "")


HEADER = (f"{'cell':5s} {'round':>5s} {'csrun ex/s':>10s} {'load':>11s} {'TF ex/s':>10s} "
          f"{'load':>11s} {'csrun/TF':>8s}")
PADDED_HEADER = f"  {'padded ex/s':>10s} {'load':>11s} {'padded/TF':>8s}"


def targets(cells: dict, tf_ok: bool) -> list[dict]:
    out = []
    for cell, c in cells.items():
        value = c.get("ratio_median")
        out.append({"what": f"csrun / TF examples/s, {c['workers']} workers x {c['ps']} ps",
                    "target": ">= 1.0", "value": value,
                    "verdict": "TensorFlow not measured" if not tf_ok else
                    "met" if value >= 1.0 else "missed"})
    return out


def measure(args) -> dict:
    import torch
    version, note = tf_available(args.tf_python)
    tf_ok = version is not None
    print(note or f"TensorFlow {version} ({args.tf_python})", flush=True)
    if environment():  # a user's run sets none of these
        print(f"NOTE: measured with {environment()}", flush=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": " ".join(["python", "benchmarks/ps_vs_tf.py", *sys.argv[1:]]),
              "machine": f"{platform.machine()} {cpu_name()}",
              "cpu_count": os.cpu_count(), "python": platform.python_version(),
              "torch": torch.__version__, "tensorflow": version, "tf_python": args.tf_python,
              "tf_note": note or None, "load_at_start": os.getloadavg(),
              "environment": environment(),
              "settings": {k: v for k, v in vars(args).items() if k not in TASK_ONLY}}
    with tempfile.TemporaryDirectory(prefix="csrun-ps-vs-tf-") as tmp:
        folder = Path(tmp)
        grid = [cell for cell in args.grid.split(",")]
        data = examples(args.tables, args.hotness, (args.warmup + args.steps) * args.batch,
                        args.zipf, args.seed)
        for workers in sorted({int(c.split("x")[0]) for c in grid}):
            write_shares(folder / f"W{workers}", data, args.batch, workers)
        print(HEADER + (PADDED_HEADER if args.padded else ""), flush=True)
        result["cells"] = {cell: cell_rounds(cell, args, folder, tf_ok) for cell in grid}
    result["targets"] = targets(result["cells"], tf_ok)
    for t in result["targets"]:
        shown = "-" if t["value"] is None else f"{t['value']:.2f}"
        print(f"target {t['what']} {t['target']}: {shown} ({t['verdict']})")
    return result


def environment() -> dict:
    """Thread settings in this environment, which every task inherits."""
    return {k: v for k, v in sorted(os.environ.items())
            if k.startswith(("OMP_", "KMP_", "MKL_", "TF_NUM_", "TF_ENABLE_ONEDNN"))}


def cpu_name() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if "model name" in line)
    except (OSError, StopIteration):
        return platform.processor()


TASK_ONLY = ("task", "share", "result", "barrier", "workers", "json")


def ints(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--tf-python", metavar="PATH", help="a Python with tensorflow-cpu 2.21 (without it, "
        "csrun alone is measured)")
    add("--grid", default="2x2,1x1", help="workers x ps cells, comma-separated")
    add("--rounds", type=int, default=3, help="paired rounds per cell")
    add("--steps", type=int, default=100, help="measured steps per worker")
    add("--warmup", type=int, default=5, help="steps per worker before measuring")
    add("--batch", type=int, default=2048, help="global batch (split over the workers)")
    add("--shards", type=int, default=2, help="FixedShardsPartitioner(n) in both")
    add("--hotness", type=ints, default=list(HOTNESS), help="most ids per example, per table")
    add("--zipf", type=float, default=1.1, help="exponent of the ids' power law")
    add("--lr", type=float, default=0.05, help="Adagrad's learning rate")
    add("--rows-scale", type=float, default=1.0, help="multiply every table's rows")
    add("--seed", type=int, default=1, help="the data's seed")
    add("--timeout", type=float, default=1800, help="seconds a run may take")
    add("--quick", action="store_true", help="tables of 4,000 rows and less, few steps")
    add("--padded", action="store_true", help="also run csrun's secondary form: padded "
        "ids, the tables called one by one (a lookup per table)")
    add("--tf-form", choices=["sparse", "padded"], default="sparse",
        help="TF's lookups: safe_embedding_lookup_sparse over the ragged ids (sparse), or "
        "embedding_lookup of the padded ids, the padding weighed 0 (padded)")
    add("--json", metavar="PATH", help="write the figures as JSON")
    add("--profile", metavar="DIR", help="cProfile files of csrun's worker0 (its measured "
        "steps) and ps0 (its serving)")
    add("--spy", metavar="DIR", help="py-spy samples of csrun's worker0 and every ps (py-spy "
        "on PATH or in ~/.local/bin)")
    add("--task", choices=["csrun", "csrun-padded", "tf-server", "tf-chief"],
        help=argparse.SUPPRESS)
    add("--tables", type=ints, help=argparse.SUPPRESS)
    add("--workers", type=int, help=argparse.SUPPRESS)
    add("--share", help=argparse.SUPPRESS)
    add("--result", help=argparse.SUPPRESS)
    add("--barrier", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.task:
        return {"csrun": csrun_task, "csrun-padded": csrun_task, "tf-server": lambda a: tf_server(),
                "tf-chief": tf_chief}[args.task](args)
    problems = check(args)
    if problems:
        parser.error("; ".join(problems))
    result = measure(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def check(args) -> list[str]:
    """Settle --quick and the table sizes; what is wrong with the arguments."""
    if args.quick:
        args.rows_scale, args.steps, args.warmup, args.batch = QUICK_SCALE, 5, 2, 256
        args.rounds = 1
    args.tables = [max(16, round(rows * args.rows_scale)) for rows in TABLES]
    problems = []
    try:
        cells = [(int(w), int(p)) for w, p in (cell.split("x") for cell in args.grid.split(","))]
    except ValueError:
        return [f"--grid: cells are WORKERSxPS, comma-separated (e.g. 2x2,1x1), got {args.grid!r}"]
    for workers, ps in cells:
        if workers < 1 or ps < 1:
            problems.append(f"--grid: {workers}x{ps} needs a worker and a ps at least")
        elif args.batch % workers:
            problems.append(f"--batch {args.batch} does not split over {workers} workers")
    if len(args.hotness) != len(TABLES) or min(args.hotness) < 1:
        problems.append(f"--hotness: {len(TABLES)} counts of 1 or more, got {args.hotness}")
    for name in ("rounds", "steps", "shards"):
        if getattr(args, name) < 1:
            problems.append(f"--{name} must be at least 1")
    if args.warmup < 1:
        problems.append("--warmup must be at least 1 (the first step compiles TF's function)")
    if args.spy and not Path(py_spy()).is_file():  # checked before any task starts
        problems.append(f"--spy needs py-spy (pip install py-spy): not on PATH nor at {py_spy()}")
    return problems


if __name__ == "__main__":
    sys.exit(main())
