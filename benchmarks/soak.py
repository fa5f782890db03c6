"""Whether the step time stays steady over a long run: the timing half of the soaks.

The soak tests (tests/integration/test_soak.py: the library loop; tests/reliability/
test_soak_runner.py: ``train()`` with the CLI's rendering) check that thousands of steps
leak no memory, threads or file descriptors. How long the steps take is measured here:
each step is timed beside a fixed plain-PyTorch reference step of the same moment (this
VM's speed switches between states ~1.6x apart, sometimes within seconds), and the median
relative step time of the last window is compared with that of the first window after the
warm-up. Target: the late window below SOAK_SLOWDOWN_TARGET times the early one.

    python benchmarks/soak.py                          # both loops, 3000 steps each
    python benchmarks/soak.py --loops engine --steps 600 --json /tmp/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # targets
from targets import SOAK_SLOWDOWN_TARGET  # noqa: E402

import csrun.core as cs  # noqa: E402

RUNNER_CONFIG = """\
strategy: {compute_devices: [CPU:0, CPU:1], parameter_device: CPU:0}
dataset:
  source: {kind: synthetic, examples: 96, features: 6, classes: 3}
  holdout: 0.25
  steps:
    - {op: shuffle, buffer: 128}
    - {op: batch, size: 16}
model: {kind: mlp, hidden: [16]}
optimizer: {name: Adam, lr: 0.01}
train: {steps: 40, log_every: 100}
checkpoint: {dir: ck, every_steps: 200, keep: 2}
"""


class Reference:
    """A fixed plain-PyTorch step (no csrun), timed beside every measured step."""

    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                         torch.nn.Linear(128, 4))
        self.x, self.y = torch.randn(64, 64, generator=g), torch.randint(0, 4, (64,), generator=g)
        self.times: list[float] = []

    def step(self) -> None:
        start = time.perf_counter()
        self.model.zero_grad(set_to_none=True)
        F.cross_entropy(self.model(self.x), self.y).backward()
        self.times.append(time.perf_counter() - start)


def engine_loop(steps: int) -> tuple[list[float], list[float]]:
    """tests/integration/test_soak.py's loop: synchronized BatchNorm, a DataLoader (a
    reader thread every pass), Adam; each step's seconds and its reference's."""
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                    torch.nn.ReLU(), torch.nn.Linear(32, 4))
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(50 * 32, 16, generator=g),
                                          torch.randint(0, 4, (50 * 32,), generator=g))
    dist = strategy.experimental_distribute_dataset(
        torch.utils.data.DataLoader(data, batch_size=32))

    def step(x, y):
        loss = F.cross_entropy(model(x), y, reduction="sum") / 32
        loss.backward()
        return loss.detach()

    times, reference = [], Reference()
    while len(times) < steps:
        for x, y in dist:
            start = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            strategy.reduce("SUM", strategy.run(step, args=(x, y)))
            optimizer.step()
            times.append(time.perf_counter() - start)
            reference.step()
            if len(times) == steps:
                break
    return times, reference.times


def runner_loop(steps: int) -> tuple[list[float], list[float]]:
    """tests/reliability/test_soak_runner.py's run: ``train()`` with the CLI's rendering
    of every event into /dev/null; a step's time is the interval between two steps' ends,
    less the reference step timed in between."""
    from rich.console import Console

    from csrun.cli.render import View
    from csrun.core.runner.events import StepDone
    from csrun.core.runner.preflight import load_config_text
    from csrun.core.runner.session import Outputs
    from csrun.core.runner.train import train

    stamps, reference = [], Reference()
    view = View()

    def on_event(event):
        view.on_event(event)
        if isinstance(event, StepDone):
            reference.step()
            stamps.append(time.perf_counter())

    here = os.getcwd()
    with tempfile.TemporaryDirectory() as folder, open(os.devnull, "w") as sink:
        view.out = view.err = Console(file=sink, width=120)
        os.chdir(folder)  # the checkpoints and metrics go there
        try:
            config = load_config_text(RUNNER_CONFIG, "soak.yaml", [f"train.steps={steps}"])
            train(config, outputs=Outputs(metrics="m.jsonl"), on_event=on_event)
        finally:
            os.chdir(here)
    times = [b - a - r for a, b, r in zip(stamps, stamps[1:], reference.times[1:])]
    return times, reference.times[1:]


def judge(name: str, times: list[float], reference: list[float]) -> dict:
    """Median step time (absolute and in reference steps) of the first window after the
    warm-up (a fifth of the steps) and of the last window, and the verdict."""
    warmup = len(times) // 5
    relative = [t / r for t, r in zip(times, reference)]

    def windows(values):
        return (statistics.median(values[warmup:2 * warmup]),
                statistics.median(values[-warmup:]))
    (early_ms, late_ms), (early, late) = [v * 1e3 for v in windows(times)], windows(relative)
    found = {"loop": name, "steps": len(times), "early_ms": early_ms, "late_ms": late_ms,
             "early_relative": early, "late_relative": late, "slowdown": late / early,
             "target": f"< {SOAK_SLOWDOWN_TARGET}",
             "verdict": "met" if late / early < SOAK_SLOWDOWN_TARGET else "missed"}
    print(f"{name}: {len(times)} steps, median step {early_ms:.2f} -> {late_ms:.2f} ms, "
          f"{early:.2f} -> {late:.2f} reference steps: x{late / early:.2f}, target "
          f"< {SOAK_SLOWDOWN_TARGET}: {found['verdict']}", flush=True)
    return found


LOOPS = {"engine": engine_loop, "runner": runner_loop}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", nargs="+", choices=sorted(LOOPS), default=sorted(LOOPS))
    parser.add_argument("--steps", type=int, default=3000, help="steps of each loop")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.steps < 10:
        parser.error("--steps: at least 10 (a fifth of them warm up, the windows need steps)")
    results = [judge(name, *LOOPS[name](args.steps)) for name in args.loops]
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"loops": results, "torch": torch.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
