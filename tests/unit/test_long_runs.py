"""Long runs: nothing the runner keeps, checkpoints or reports grows with the steps.

The loss curve and the step times are bounded :class:`Curve` summaries, the evaluations a
:class:`Thinned` list, the divergence rule reads the newest windows only; resumed runs
report exactly what uninterrupted ones do, also from a checkpoint that holds every
step's loss (as csrun wrote them before). The curves' size is lowered here
(``curve.POINTS``) so that a short run merges many times; benchmarks/long_run.py trains a
million steps with the real size.
"""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
import torch

from csrun.core.runner import curve as curve_module
from csrun.core.runner.checkpoint import CheckpointManager
from csrun.core.runner.checkpointing import run_identity
from csrun.core.runner.curve import Curve, Thinned
from csrun.core.runner.divergence import diverged
from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.session import Outputs
from csrun.core.runner.train import train

TINY = """\
strategy: {compute_devices: [CPU:0, CPU:1]}
dataset:
  source: {kind: synthetic, examples: 64, features: 4, classes: 3}
  holdout: 0.25
  steps: [{op: shuffle, buffer: 64}, {op: batch, size: 8}]
model: {kind: linear}
optimizer: {name: SGD, lr: 0.05}
train: {steps: 90, log_every: 7, eval_every: 3}
"""


def config(*overrides):
    return load_config_text(TINY, None, list(overrides))


# -- the summaries ----------------------------------------------------------------------
def test_a_curve_keeps_at_most_its_limit_of_means_of_equal_spans():
    curve = Curve(limit=8)
    values = [float(v) for v in range(1000)]
    for v in values:
        curve.add(v)
    points = curve.points()
    assert len(points) <= 8 and curve.every == 128 and curve.steps == 1000
    full, partial = divmod(1000, 128)
    assert points[:full] == [sum(values[i * 128:(i + 1) * 128]) / 128 for i in range(full)]
    assert points[-1] == sum(values[full * 128:]) / partial  # the steps since the last


def test_the_default_curve_is_bounded_for_a_million_steps():
    curve = Curve()
    for step in range(1_000_000):
        curve.add(1.0)
    assert len(curve.points()) <= curve_module.POINTS == 512 and curve.every == 2048


def test_a_curve_resumed_from_its_state_continues_exactly():
    whole, first = Curve(limit=6), Curve(limit=6)
    losses = [((7 * i) % 11) / 3 for i in range(200)]
    for loss in losses:
        whole.add(loss)
    for loss in losses[:77]:
        first.add(loss)
    second = Curve(limit=6)
    second.load_state_dict(torch.load(_saved(first.state_dict()), weights_only=True))
    for loss in losses[77:]:
        second.add(loss)
    assert second.points() == whole.points() and second.every == whole.every


def _saved(state, path=None):
    import io
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


def test_thinned_records_stay_evenly_spaced_and_bounded():
    kept = Thinned(limit=4)
    for n in range(100):
        kept.add(n)
    assert kept.records == [0, 64] == list(range(0, 100, kept.stride))  # full at 96: halved
    kept.add(100)
    assert kept.records == [0, 64] and kept.seen == 101  # 100 is not a multiple of 64
    with pytest.raises(ValueError, match="even"):
        Thinned(limit=3)


def test_divergence_on_the_newest_losses_agrees_with_every_loss():
    losses = [1.0] * 30 + [5000.0] * 30
    for steps in range(1, 61):
        every = losses[:steps]
        for last in (False, True):
            assert diverged(every, 5, 1000.0, last) == \
                diverged(every[-15:], 5, 1000.0, last, first=every[0], steps=steps)


# -- a run --------------------------------------------------------------------------------
@pytest.fixture
def small_curves(monkeypatch):
    monkeypatch.setattr(curve_module, "POINTS", 8)


def _json(result) -> dict:
    data = result.to_dict()
    for key in ("throughput", "phases_s", "per_replica", "replica_balance", "checkpoint"):
        data.pop(key)
    return data


def test_a_long_run_reports_bounded_curves_and_every_step_in_metrics(small_curves, tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = train(config(), outputs=Outputs(metrics=str(metrics)))
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [line["loss"] for line in lines if "loss" in line]
    assert len(losses) == 90 and result.losses_every == 16 and len(result.losses) <= 8
    assert result.losses[0] == pytest.approx(sum(losses[:16]) / 16, rel=1e-12)
    assert result.first_loss == losses[0] and result.final_loss == losses[-1]
    evaluations = [line["eval"] for line in lines if "eval" in line]
    assert len(evaluations) == 30 and result.evaluations_every == 8
    assert result.evaluations == evaluations[::8]


def test_a_checkpoint_does_not_grow_with_the_steps(small_curves, tmp_path):
    train(config(f"checkpoint.dir={tmp_path}", "checkpoint.every_steps=30",
                 "checkpoint.keep=3"))
    manager = CheckpointManager(tmp_path, 3, run_identity(config(), 2))
    sizes = [json.loads(m.read_text())["bytes"] for m in manager.manifests()]
    assert max(sizes) - min(sizes) <= 0.01 * min(sizes), sizes  # steps 30, 60, 90
    lengths = []
    for manifest in manager.manifests():
        payload, _ = manager.load(manifest)
        # (the model, its optimizer state and the generators have fixed sizes of their own)
        lengths.append(_lengths({k: v for k, v in payload.items()
                                 if k not in ("model", "optimizer", "rng")}))
    assert len(lengths) == 3 and lengths[0] == lengths[1] == lengths[2], lengths
    shape = lengths[0]  # what a step adds to has one size: POINTS, or the config's
    assert shape.pop(".recent_losses") == 3 * 7  # the divergence rule's 3 windows
    assert max(shape.values()) <= 8, shape     # curves, evaluations, per replica


def _lengths(node, path="") -> dict[str, int]:
    """The length of every list and tensor in a payload, by path."""
    found = {}
    if isinstance(node, dict):
        for key, value in node.items():
            found |= _lengths(value, f"{path}.{key}")
    elif isinstance(node, (list, tuple, torch.Tensor)):
        found[path] = len(node)
    return found


def test_a_resumed_long_run_reports_what_an_uninterrupted_one_does(small_curves, tmp_path):
    whole = train(config(f"checkpoint.dir={tmp_path / 'a'}"))
    stop = threading.Event()
    train(config(f"checkpoint.dir={tmp_path / 'b'}"), stop=stop,
          on_event=lambda e: stop.set() if getattr(e, "step", 0) == 53 else None)
    resumed = train(config(f"checkpoint.dir={tmp_path / 'b'}"), resume=True)
    assert resumed.checkpoint["resumed_from_step"] == 53
    assert _json(resumed) == _json(whole)


def test_a_checkpoint_with_every_loss_resumes_to_the_same_result(small_curves, tmp_path):
    """Older checkpoints hold every step's loss and every evaluation: they are replayed
    into the bounded summaries."""
    whole = train(config(f"checkpoint.dir={tmp_path / 'a'}"))
    stop, metrics = threading.Event(), tmp_path / "m.jsonl"
    folder = tmp_path / "b"
    train(config(f"checkpoint.dir={folder}"), stop=stop, outputs=Outputs(metrics=str(metrics)),
          on_event=lambda e: stop.set() if getattr(e, "step", 0) == 40 else None)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    _rewrite_as_before(folder, [line["loss"] for line in lines if "loss" in line],
                       [line["eval"] for line in lines if "eval" in line])
    resumed = train(config(f"checkpoint.dir={folder}"), resume=True)
    assert resumed.checkpoint["resumed_from_step"] == 40
    assert _json(resumed) == _json(whole)


def _rewrite_as_before(folder, losses: list[float], evaluations: list[dict]) -> None:
    """The newest checkpoint in the format that kept every loss and evaluation."""
    manifest_path = sorted(folder.glob("ckpt-*.json"))[-1]
    payload_path = manifest_path.with_suffix(".pt")
    payload = torch.load(payload_path, weights_only=True)
    for key in ("loss_curve", "first_loss", "recent_losses", "recent_kept"):
        del payload[key]
    payload["losses"] = torch.tensor(losses, dtype=torch.float64)
    payload["evaluations"] = evaluations
    torch.save(payload, payload_path)
    manifest = json.loads(manifest_path.read_text())
    data = payload_path.read_bytes()
    manifest.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    manifest_path.write_text(json.dumps(manifest))
