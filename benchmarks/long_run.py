"""A long run through ``csrun train``: memory, checkpoints, open files and threads stay
the same size at step 1,000,000 as at step 100,000.

A tiny model trains on 2 logical CPU replicas for ``--steps`` steps, saving a checkpoint
every ``--every`` steps, in a real ``csrun train`` process. At each new checkpoint this
script reads the process's resident memory, open file descriptors and threads (psutil)
and the checkpoint's payload size; at the end, the ``--json`` result's size. From
``--from-step`` on, each must stay within ``--tolerance`` (2%) of its first reading
there: nothing the run keeps may grow with the step count.

    pip install -e ".[test]"                      # psutil
    python benchmarks/long_run.py                 # 1,000,000 steps (about 20-40 min)
    python benchmarks/long_run.py --steps 200000 --every 10000 --from-step 50000
    python benchmarks/long_run.py --json long_run.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import signal
import subprocess
import sys
import tempfile
import time

import psutil

CONFIG = """\
strategy: {compute_devices: [CPU:0, CPU:1], parameter_device: CPU:0}
dataset:
  source: {kind: synthetic, examples: 256, features: 8, classes: 3}
  holdout: 0.125
  steps: [{op: shuffle, buffer: 256}, {op: batch, size: 16}, {op: repeat}]
model: {kind: mlp, hidden: [8]}
optimizer: {name: SGD, lr: 0.01}
train: {steps: STEPS, log_every: EVERY, eval_every: EVAL}
checkpoint: {dir: ckpt, every_steps: EVERY, keep: 2}
"""
MEASURES = ("rss_mib", "open_files", "threads", "checkpoint_bytes")


def main() -> int:
    args = _arguments()
    folder = pathlib.Path(tempfile.mkdtemp(prefix="csrun-long-run-"))
    (folder / "c.yaml").write_text(CONFIG.replace("STEPS", str(args.steps)).replace(
        "EVERY", str(args.every)).replace("EVAL", str(args.every // 2)))
    command = [sys.executable, "-m", "csrun.cli", "train", "c.yaml", "--json", "result.json"]
    begin = time.monotonic()
    process = subprocess.Popen(command, cwd=folder, stdout=subprocess.DEVNULL,
                               stderr=open(folder / "stderr.log", "w"))
    try:
        samples = _watch(process, folder / "ckpt", args)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    wall = time.monotonic() - begin
    if process.returncode != 0:
        print((folder / "stderr.log").read_text()[-2000:], file=sys.stderr)
        print(f"csrun train exited {process.returncode} (see {folder})", file=sys.stderr)
        return 1
    return _report(samples, (folder / "result.json").stat().st_size, wall, args)


def _watch(process: subprocess.Popen, checkpoints: pathlib.Path, args) -> list[dict]:
    """One sample per checkpoint the run writes, until it ends (or the deadline)."""
    watched, samples, seen = psutil.Process(process.pid), [], set()
    deadline = time.monotonic() + args.timeout
    while process.poll() is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"the run did not end within {args.timeout} s")
        for manifest in sorted(checkpoints.glob("ckpt-*.json")):
            if manifest.name in seen:
                continue
            seen.add(manifest.name)
            try:
                info = json.loads(manifest.read_text())
                sample = {"step": info["step"], "checkpoint_bytes": info["bytes"],
                          **_readings(watched)}
            except (OSError, ValueError, psutil.Error):
                continue  # pruned or ended meanwhile: the next one is sampled
            samples.append(sample)
            print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                           for k, v in sample.items()), flush=True)
        time.sleep(0.2)
    return samples


def _readings(watched: psutil.Process, count: int = 5) -> dict:
    """The process's memory, files and threads, read ``count`` times 50 ms apart: the
    median memory, and the fewest files and threads (a save holds a file or two open
    for a moment, which is not growth)."""
    reads = []
    for _ in range(count):
        reads.append((watched.memory_info().rss / 2**20, watched.num_fds(),
                      watched.num_threads()))
        time.sleep(0.05)
    memory, files, threads = zip(*reads)
    return {"rss_mib": sorted(memory)[count // 2], "open_files": min(files),
            "threads": min(threads)}


def _report(samples: list[dict], result_bytes: int, wall: float, args) -> int:
    late = [s for s in samples if s["step"] >= args.from_step]
    if len(late) < 2:
        print(f"only {len(late)} sample(s) from step {args.from_step}: run longer")
        return 1
    figures = {"steps": args.steps, "wall_s": round(wall, 1), "samples": len(samples),
               "from_step": late[0]["step"], "to_step": late[-1]["step"],
               "result_json_bytes": result_bytes}
    flat = True
    for measure in MEASURES:
        first, values = late[0][measure], [s[measure] for s in late]
        drift = (max(values) - first) / first if first else 0.0
        ok = max(values) <= first * (1 + args.tolerance)
        flat &= ok
        figures[measure] = {"first": first, "last": values[-1], "max": max(values),
                            "min": min(values), "max_drift": round(drift, 5),
                            "flat": ok}
        print(f"{measure:>16}: {first:.1f} at step {late[0]['step']} -> {values[-1]:.1f} at "
              f"step {late[-1]['step']} (max {max(values):.1f}, {100 * drift:+.2f}%): "
              f"{'flat' if ok else 'GROWS'}")
    print(f"result.json: {result_bytes} bytes; {args.steps} steps in {wall:.0f} s")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(figures, indent=1) + "\n")
    return 0 if flat else 1


def _arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--every", type=int, default=10_000,
                        help="steps between checkpoints (and samples, logs)")
    parser.add_argument("--from-step", type=int, default=100_000,
                        help="the first step whose sample the others are compared with")
    parser.add_argument("--tolerance", type=float, default=0.02)
    parser.add_argument("--timeout", type=float, default=4 * 3600.0,
                        help="seconds before the run is stopped as hung")
    parser.add_argument("--json", help="write the figures here")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
