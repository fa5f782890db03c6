"""What the runner adds per step over a hand-written library loop, for a user model.

The same user model (an importable ``nn.Module``) on the same data is trained, in one
process and interleaved round by round, by ``csrun.core.runner`` (a config with
``model.kind: import``) and by a hand-written loop with ``CentralStorageStrategy``
(``experimental_distribute_dataset`` -> ``run`` -> ``optimizer.step`` -> ``reduce``). Each
side's per-step time is its training loop's wall time over its steps (the runner's setup,
data generation and final evaluation excluded); the figure is the median over rounds of
the paired ratio runner / library.

    python benchmarks/runner_overhead.py                    # 9 rounds of 60 steps
    python benchmarks/runner_overhead.py --rounds 3 --steps 20 --json /tmp/o.json
    python benchmarks/runner_overhead.py --processes 5 --rounds 101   # pooled, 505 rounds
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

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI does (performance.md)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the model, targets
from targets import RUNNER_OVERHEAD_TARGET, median_interval, verdict  # noqa: E402

from csrun.core import CentralStorageStrategy  # noqa: E402
from csrun.core.data.sources import load_source  # noqa: E402
from csrun.core.runner.preflight import load_config_text  # noqa: E402
from csrun.core.runner.train import train  # noqa: E402

FEATURES, CLASSES, BATCH, EXAMPLES = 64, 10, 128, 4096
DEVICES = ["CPU:0", "CPU:1"]


class UserMLP(torch.nn.Module):
    """The "user model": 64-256-256-10 ReLU."""

    def __init__(self, width: int = 256):
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(FEATURES, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
            torch.nn.ReLU(), torch.nn.Linear(width, CLASSES))

    def forward(self, x):
        return self.net(x)


CONFIG = f"""\
strategy: {{compute_devices: {DEVICES}}}
dataset:
  source: {{kind: synthetic, examples: {EXAMPLES}, features: {FEATURES}, classes: {CLASSES}}}
  steps: [{{op: shuffle, buffer: {EXAMPLES}}}, {{op: batch, size: {BATCH}}}]
model: {{kind: import, target: "runner_overhead:UserMLP", kwargs: {{width: WIDTH}},
        loss: cross_entropy}}
optimizer: {{name: SGD, lr: 0.05}}
train: {{steps: STEPS, log_every: 1000000}}
"""


WIDTH = 256  # the hidden layers' width (--width)


def runner_step_s(steps: int) -> float:
    text = CONFIG.replace("STEPS", str(steps)).replace("WIDTH", str(WIDTH))
    result = train(load_config_text(text, None))
    return result.throughput["wall_s"] / result.throughput["steps_this_session"]


def library_step_s(steps: int, data) -> float:
    """The hand-written loop of README's library tour, on the same model and data."""
    torch.manual_seed(0)
    strategy = CentralStorageStrategy(DEVICES, parameter_device="CPU:0")
    with strategy.scope():
        model = UserMLP(WIDTH)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    dataset = torch.utils.data.TensorDataset(data.features, data.targets)
    # Whole batches by one tensor index each, as the runner's pipeline takes them: a
    # DataLoader that indexes 128 examples one by one and collates them spends ~1 ms a
    # batch more, and the runner then looked 10% *faster* than the library.
    batches = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(dataset), BATCH,
                                            drop_last=False)
    loader = torch.utils.data.DataLoader(dataset, sampler=batches, batch_size=None)

    def step(x, y, global_batch):
        loss = F.cross_entropy(model(x), y, reduction="sum") / global_batch
        loss.backward()
        return loss.detach()

    done, begin = 0, time.perf_counter()
    with strategy.scope():
        while done < steps:
            for x, y in strategy.experimental_distribute_dataset(loader):
                sizes = [t.shape[0] for t in strategy.experimental_local_results(x)]
                optimizer.zero_grad(set_to_none=True)
                losses = strategy.run(step, args=(x, y, sum(sizes)))
                optimizer.step()
                float(strategy.reduce("SUM", losses, axis=None))
                done += 1
                if done == steps:
                    break
    return (time.perf_counter() - begin) / steps


def measure(rounds: int, steps: int) -> list[dict]:
    """Rounds of both loops in this process, alternating which goes first."""
    config = load_config_text(CONFIG.replace("STEPS", "1").replace("WIDTH", str(WIDTH)), None)
    data = load_source(config.dataset.source)
    runner_step_s(5), library_step_s(5, data)  # warm up both paths
    rows = []
    for r in range(rounds):
        pair = (runner_step_s, lambda s: library_step_s(s, data))
        first, second = (pair if r % 2 == 0 else pair[::-1])
        a, b = first(steps), second(steps)
        runner, library = (a, b) if r % 2 == 0 else (b, a)
        rows.append({"runner_ms": runner * 1e3, "library_ms": library * 1e3,
                     "ratio": runner / library})
        print(f"round {r}: runner {runner * 1e3:.2f} ms/step, library "
              f"{library * 1e3:.2f} ms/step, ratio {runner / library:.3f}", flush=True)
    return rows


def measure_in_processes(args) -> list[dict]:
    """``--processes``: each process measures its rounds; the rows are pooled. One
    process's median moves by a few percent from process to process on a busy VM (where
    its threads land, its memory), more than within it."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for process in range(args.processes):
            out = os.path.join(folder, f"{process}.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--rounds",
                            str(args.rounds), "--steps", str(args.steps), "--width",
                            str(WIDTH), "--json", out], check=True, stdout=subprocess.DEVNULL)
            with open(out, encoding="utf-8") as f:
                part = json.load(f)
            print(f"process {process}: median {part['median_ratio']:.3f}", flush=True)
            rows += [dict(row, process=process) for row in part["rounds"]]
    return rows


def summarize(rows: list[dict], args) -> dict:
    ratios = sorted(row["ratio"] for row in rows)
    interval = median_interval(ratios)
    by_process: dict[int, list[float]] = {}
    for row in rows:
        by_process.setdefault(row.get("process", 0), []).append(row["ratio"])
    medians = [statistics.median(v) for v in by_process.values()]
    return {"median_ratio": statistics.median(ratios), "min_ratio": ratios[0],
            "ci95": interval, "target": RUNNER_OVERHEAD_TARGET,
            "verdict": pooled_verdict(interval, medians),
            "median_extra_ms": statistics.median(r["runner_ms"] - r["library_ms"]
                                                 for r in rows), "width": WIDTH,
            "max_ratio": ratios[-1], "rounds": rows, "steps": args.steps,
            "process_medians": medians,
            "replicas": len(DEVICES), "batch": BATCH, "torch": torch.__version__}


def pooled_verdict(interval: tuple | None, process_medians: list[float]) -> str:
    """The interval's verdict; with several processes, ``met`` (``missed``) also needs
    every process's median under (none under) the target: the interval treats pooled
    rounds as independent, and processes differ more than rounds do."""
    found = verdict(interval, RUNNER_OVERHEAD_TARGET, at_least=False)
    under = [median < RUNNER_OVERHEAD_TARGET for median in process_medians]
    if len(under) > 1 and (found == "met" and not all(under)
                           or found == "missed" and any(under)):
        return "inconclusive"
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="rounds per process")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--processes", type=int, default=1,
                        help="fresh processes to measure in, their rounds pooled")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--width", type=int, default=256,
                        help="hidden width of the user MLP (a bigger step dilutes the "
                             "runner's fixed per-step cost)")
    args = parser.parse_args(argv)
    global WIDTH
    WIDTH = args.width
    rows = measure_in_processes(args) if args.processes > 1 else \
        measure(args.rounds, args.steps)
    summary = summarize(rows, args)
    interval, ratios = summary["ci95"], [summary["min_ratio"], summary["max_ratio"]]
    ci = "no 95% interval" if interval is None else \
        f"95% CI {interval[0]:.3f}..{interval[1]:.3f}"
    print(f"runner / library per step: median {summary['median_ratio']:.3f} ({ci}; range "
          f"{ratios[0]:.3f}..{ratios[1]:.3f}, {len(rows)} rounds in {args.processes} "
          f"process(es)); the runner adds {summary['median_extra_ms']:.3f} ms a step "
          f"(median of paired differences); target <= {RUNNER_OVERHEAD_TARGET}: "
          f"{summary['verdict']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
