"""The training run: determinism, loss scaling, resume bit-for-bit, failures, outputs."""

import json
import threading

import pytest

from csrun.core.runner.checkpoint import CheckpointError
from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.events import CheckpointSaved, Evaluated, Notice, RunStarted, StepLog
from csrun.core.runner.metrics import tensorboard_available
from csrun.core.runner.plots import plot_available
from csrun.core.config.problems import ConfigError
from csrun.core.runner.errors import NonFiniteLoss
from csrun.core.runner.session import Outputs
from csrun.core.runner.train import train
from tests.helpers.tiny_config import tiny_config

TINY = tiny_config("~strategy.parameter_device", "dataset.source.examples=120",
                   "dataset.steps.0.buffer=200", "model={kind: mlp, hidden: [8], dropout: 0.2}",
                   "optimizer={name: SGD, lr: 0.1, kwargs: {momentum: 0.9}}",
                   "train={epochs: 3, log_every: 5}")


def config(*overrides, text=TINY):
    return load_config_text(text, "tiny.yaml", list(overrides))


def run(*overrides, **options):
    events = []
    result = train(config(*overrides), on_event=events.append, **options)
    return result, events


def test_same_seed_same_digest_and_events():
    first, events = run()
    second, _ = run()
    assert first.status == "completed" and first.steps == first.total_steps == 18
    assert first.params_sha256 == second.params_sha256
    assert first.losses == second.losses and len(first.losses) == 18
    assert run("train.seed=1")[0].params_sha256 != first.params_sha256
    kinds = [type(e) for e in events]
    assert kinds[0] is RunStarted and kinds.count(StepLog) == 4  # 5, 10, 15, 18
    log = next(e for e in events if isinstance(e, StepLog))
    assert [r.device for r in log.replicas] == ["CPU:0", "CPU:1"]
    assert list(log.phases_s) == ["distribute", "run", "update", "reduce"]
    assert isinstance(events[-1], Evaluated) and events[-1].examples == 30


def test_result_reports_per_replica_and_metrics():
    result, _ = run()
    data = result.to_dict()
    assert [r["replica"] for r in data["per_replica"]] == [0, 1]
    assert sum(r["examples"] for r in data["per_replica"]) == data["examples"] == 90 * 3
    assert data["metrics"]["eval_examples"] == 30
    assert 0 <= data["metrics"]["eval_accuracy"] <= 1
    assert data["epochs"] == 3.0 and len(data["params_sha256"]) == 64
    json.dumps(data)  # JSON-ready


def test_loss_is_scaled_by_the_global_batch():
    # no dropout: one replica and two replicas take the same SGD steps (up to rounding)
    one, _ = run("model.dropout=0", "strategy.compute_devices=[CPU:0]")
    two, _ = run("model.dropout=0")
    three, _ = run("model.dropout=0", "strategy.compute_devices=[CPU:1, CPU:2, CPU:3]")
    for other in (two, three):
        assert all(abs(a - b) < 1e-5 for a, b in zip(one.losses, other.losses))


@pytest.mark.parametrize("extra", [
    (),
    ("dataset.distribute=per_replica", "dataset.replication=per_replica",
     "dataset.steps.0={op: shard}"),
    ("dataset.distribute=per_replica",
     "optimizer.schedule={name: StepLR, kwargs: {step_size: 1}, interval: epoch}"),
    ("train.steps=23", "train.epochs=null", "dataset.steps.2={op: repeat}"),
], ids=["global", "per-replica-sharded", "per-worker-schedule", "infinite-steps"])
def test_resume_ends_bit_for_bit_where_an_uninterrupted_run_ends(tmp_path, extra):
    uninterrupted, _ = run(*extra)
    overrides = (*extra, f"checkpoint.dir={tmp_path}", "checkpoint.every_steps=4")
    stop = threading.Event()

    def stop_at_7(event):
        if getattr(event, "step", None) == 7 and not isinstance(event, CheckpointSaved):
            stop.set()

    first = train(config(*overrides), on_event=stop_at_7, stop=stop)
    assert first.status == "interrupted" and first.steps == 7
    assert first.checkpoint["last_step"] == 7  # saved at the stop, not only every 4
    resumed, events = run(*overrides, resume=True)
    assert any(isinstance(e, Notice) and "resumed from step 7" in e.message for e in events)
    assert resumed.params_sha256 == uninterrupted.params_sha256
    assert resumed.losses == uninterrupted.losses
    assert resumed.metrics == uninterrupted.metrics


def test_a_resumed_run_logs_the_accuracy_an_uninterrupted_one_logs(tmp_path):
    # The log window of steps 6-10 spans the stop at 7: the checkpoint holds the window's
    # correct predictions so far, counted when it is saved (they wait until read).
    _, events = run()
    logged = {e.step: e.accuracy for e in events if isinstance(e, StepLog)}
    overrides = (f"checkpoint.dir={tmp_path}",)
    stop = threading.Event()
    first = train(config(*overrides), stop=stop,
                  on_event=lambda e: getattr(e, "step", None) == 7 and stop.set())
    assert first.status == "interrupted" and first.steps == 7
    _, again = run(*overrides, resume=True)
    assert {e.step: e.accuracy for e in again if isinstance(e, StepLog)} == \
        {step: accuracy for step, accuracy in logged.items() if step > 7}


def test_resume_refuses_another_config_and_starts_fresh_without_checkpoints(tmp_path):
    ck = f"checkpoint.dir={tmp_path / 'ck'}"
    fresh, events = run(ck, resume=True)
    assert any("no checkpoint" in e.message for e in events if isinstance(e, Notice))
    assert fresh.checkpoint["last_step"] == 18
    again, _ = run(ck, resume=True)  # already finished: nothing to do, same digest
    assert again.params_sha256 == fresh.params_sha256
    with pytest.raises(CheckpointError, match="model.hidden.0: checkpoint 8, now 16"):
        run(ck, "model.hidden=[16]", resume=True)


def test_options_that_cannot_work_are_config_errors(monkeypatch):
    with pytest.raises(ConfigError, match="--resume needs a checkpoint directory"):
        run(resume=True)
    monkeypatch.setattr("csrun.core.runner.preflight.outputs.plot_available", lambda: False)
    with pytest.raises(ConfigError, match="matplotlib"):
        run(outputs=Outputs(plot="x.png"))


def test_non_finite_loss_names_step_and_replica_and_keeps_the_checkpoint(tmp_path):
    overrides = ("optimizer.lr=1e30", "model.dropout=0", f"checkpoint.dir={tmp_path}",
                 "checkpoint.every_steps=1")
    with pytest.raises(NonFiniteLoss) as info:
        run(*overrides)
    message = str(info.value)
    assert "at step" in message and "on replica" in message and "CPU:" in message
    assert "intact" in message
    manifests = sorted(tmp_path.glob("*.json"))
    assert manifests  # the last good checkpoint is still there and loads
    from csrun.core.runner.checkpoint import CheckpointManager
    from csrun.core.runner.checkpointing import run_identity
    cfg = config(*overrides)
    assert CheckpointManager(tmp_path, 3, run_identity(cfg, 2)).load_latest() is not None


def test_one_replica_and_regression(tmp_path):
    text = TINY.replace("{kind: synthetic, examples: 120, features: 6, classes: 3}",
                        "{kind: synthetic, task: regression, examples: 64, features: 3}")
    result = train(config("strategy.compute_devices=[CPU:0]", "model.dropout=0", text=text))
    assert result.metrics["loss"] == "mse" and result.metrics["train_accuracy"] is None
    assert result.per_replica[0]["examples_share"] == 1.0


def test_metrics_file_has_one_line_per_step(tmp_path):
    path = tmp_path / "m" / "metrics.jsonl"
    result, _ = run(outputs=Outputs(metrics=str(path)))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, 19))
    assert lines[-1]["loss"] == result.losses[-1] and len(lines[0]["step_time_s"]) == 2


def test_each_metrics_record_counts_its_own_steps_correct_predictions(tmp_path):
    # Without a sink the counts wait for the log line (PendingCorrect); with one, each
    # record counts its step: the records add up to each log window's accuracy.
    path = tmp_path / "metrics.jsonl"
    _, events = run(outputs=Outputs(metrics=str(path)))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    correct = [round(line["accuracy"] * line["examples"]) for line in lines]
    assert all(abs(c - line["accuracy"] * line["examples"]) < 1e-9
               for c, line in zip(correct, lines))
    start = 0
    for log in (e for e in events if isinstance(e, StepLog)):
        window = slice(start, log.step)
        examples = sum(line["examples"] for line in lines[window])
        assert log.accuracy == pytest.approx(sum(correct[window]) / examples)
        start = log.step
    _, quiet = run()  # no sink: the same log lines
    assert [e.accuracy for e in quiet if isinstance(e, StepLog)] == \
        [e.accuracy for e in events if isinstance(e, StepLog)]


# process: matplotlib's first use where it has no font cache yet (a fresh environment,
# CI) builds one, which runs fc-list as a child process
@pytest.mark.process
@pytest.mark.skipif(not plot_available(), reason="matplotlib (csrun[plot]) not installed")
def test_plot_is_written(tmp_path):
    run(outputs=Outputs(plot=str(tmp_path / "loss.png")))
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_a_fresh_run_replaces_checkpoints_of_an_earlier_run(tmp_path):
    ck = f"checkpoint.dir={tmp_path}"
    run(ck, "model.hidden=[4]", "train.epochs=4")  # an earlier, different run: step 24
    result, events = run(ck)
    assert any("replaced 1 checkpoint" in e.message for e in events if isinstance(e, Notice))
    assert sorted(p.name for p in tmp_path.glob("*.json")) == ["ckpt-00000018.json"]
    resumed, _ = run(ck, resume=True)
    assert resumed.params_sha256 == result.params_sha256


@pytest.mark.skipif(not tensorboard_available(),
                    reason="tensorboard (csrun[tensorboard]) not installed")
def test_tensorboard_event_files(tmp_path):
    run(outputs=Outputs(tensorboard=str(tmp_path / "tb")))
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
