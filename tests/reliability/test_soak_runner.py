"""Soak through the runner and the CLI's rendering: thousands of steps of ``csrun train``
(a new pass over the data, its DataLoader and reader thread every 5 steps, a checkpoint
every 200, a metrics line every step, a rendered table every 100) keep memory flat, leak
no threads or file handles, and keep the step time steady.

The engine alone has its own soak (tests/integration/test_soak.py); this one adds what a
run does around it.
"""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time

import psutil
import pytest
from rich.console import Console

from csrun.cli.render import View
from csrun.core.config import load_config_text
from csrun.core.events import StepDone
from csrun.core.runner import Outputs, train
from csrun_processes import TINY

STEPS = int(os.environ.get("CSRUN_SOAK_STEPS", "3000"))
WARMUP = STEPS // 5


@pytest.mark.timeout(900)
def test_a_long_run_keeps_memory_threads_handles_and_step_time_flat(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config_text(TINY, "tiny.yaml", [
        f"train.steps={STEPS}", "train.log_every=100", "checkpoint.dir=ck",
        "checkpoint.every_steps=200", "checkpoint.keep=2"])
    process = psutil.Process()
    sink = open(os.devnull, "w")  # the CLI's rendering of every event, into nowhere
    view = View()
    view.out = view.err = Console(file=sink, width=120)
    stamps, samples = [], {}

    def on_event(event):
        view.on_event(event)
        if isinstance(event, StepDone):
            stamps.append(time.perf_counter())
            if event.step in (WARMUP, STEPS):
                gc.collect()
                samples[event.step] = (process.memory_info().rss, threading.active_count(),
                                       process.num_fds())

    try:
        result = train(config, outputs=Outputs(metrics="m.jsonl"), on_event=on_event)
    finally:
        sink.close()
    assert result.status == "completed" and result.steps == STEPS
    (rss0, threads0, fds0), (rss1, threads1, fds1) = samples[WARMUP], samples[STEPS]
    growth = (rss1 - rss0) / rss0
    times = [b - a for a, b in zip(stamps, stamps[1:])]
    early = statistics.median(times[WARMUP:2 * WARMUP])
    late = statistics.median(times[-WARMUP:])
    print(f"\nrunner soak: {STEPS} steps, RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB "
          f"({growth:+.2%}), threads {threads0} -> {threads1}, fds {fds0} -> {fds1}, "
          f"median step {early * 1e3:.2f} -> {late * 1e3:.2f} ms")
    assert growth < 0.05
    assert threads1 <= threads0 + 1  # at most the reader thread of the pass in flight
    assert fds1 <= fds0
    assert late < 1.5 * early
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [
        f"ckpt-{STEPS - 200:08d}.json", f"ckpt-{STEPS - 200:08d}.pt",
        f"ckpt-{STEPS:08d}.json", f"ckpt-{STEPS:08d}.pt"]
