"""Soak through the runner and the CLI's rendering: thousands of steps of ``csrun train``
(a new pass over the data, its DataLoader and reader thread every 5 steps, a checkpoint
every 200, a metrics line every step, a rendered table every 100) keep memory flat and
leak no threads, file handles or objects. How long the steps take is measured by
benchmarks/soak.py (the same run).

The engine alone has its own soak (tests/integration/test_soak.py); this one adds what a
run does around it.
"""

from __future__ import annotations

import os

import psutil
import pytest
from rich.console import Console

from csrun.cli.render import View
from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.events import StepDone
from csrun.core.runner.session import Outputs
from csrun.core.runner.train import train
from tests.helpers.soak_checks import STEPS, WARMUP, check_flat, sample
from tests.helpers.tiny_config import TINY


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_long_run_keeps_memory_threads_handles_and_objects_flat(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config_text(TINY, "tiny.yaml", [
        f"train.steps={STEPS}", "train.log_every=100", "checkpoint.dir=ck",
        "checkpoint.every_steps=200", "checkpoint.keep=2"])
    process = psutil.Process()
    sink = open(os.devnull, "w")  # the CLI's rendering of every event, into nowhere
    view = View()
    view.out = view.err = Console(file=sink, width=120)
    samples = {}

    def on_event(event):
        view.on_event(event)
        if isinstance(event, StepDone) and event.step in (WARMUP, STEPS):
            samples[event.step] = sample(process)

    try:
        result = train(config, outputs=Outputs(metrics="m.jsonl"), on_event=on_event)
    finally:
        sink.close()
    assert result.status == "completed" and result.steps == STEPS
    check_flat("runner soak", samples)
    previous = (STEPS - 1) // 200 * 200  # the last periodic one before the final one
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".csrun.lock",
        f"ckpt-{previous:08d}.json", f"ckpt-{previous:08d}.pt",
        f"ckpt-{STEPS:08d}.json", f"ckpt-{STEPS:08d}.pt"]
