"""The training options of issue 13: clipping, accumulation, precision, evaluation during
training with early stopping and the best checkpoint, export, compile, and the config
problems each can have."""

import json
import threading

import pytest
import torch

from csrun.core.config.problems import ConfigError
from csrun.core.distribute import torch_internals
from csrun.core.runner import replica_step
from csrun.core.runner.events import Evaluated
from csrun.core.runner.export import export_safetensors
from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.session import Outputs, Session
from csrun.core.runner.train import train
from tests.helpers.tiny_config import tiny_config

TINY = tiny_config("~strategy.parameter_device", "dataset.source.examples=120",
                   "dataset.steps.0.buffer=200", "model.hidden=[8]",
                   "optimizer={name: SGD, lr: 0.1}", "train={steps: 12, log_every: 6}")

# A linear regression without shuffling: a big batch and accumulated small ones see the
# same examples in the same order.
LINEAR = """\
strategy: {compute_devices: [CPU:0, CPU:1]}
dataset:
  source: {kind: synthetic, task: regression, examples: 100, features: 5}
  steps: [{op: batch, size: 32}]
model: {kind: linear}
optimizer: {name: SGD, lr: 0.05}
train: {epochs: 2}
"""


def config(*overrides, text=TINY):
    return load_config_text(text, None, list(overrides))


def fitted(*overrides, text=TINY, emit=None):
    """A session trained to its end (its model inspectable)."""
    session = Session(config(*overrides, text=text), Outputs(), emit or (lambda e: None))
    session.fit(threading.Event())
    return session


def problems(*overrides, text=TINY):
    with pytest.raises(ConfigError) as caught:
        config(*overrides, text=text)
    return {p.path: p for p in caught.value.problems}


# -- clipping ---------------------------------------------------------------------------
def test_grad_clip_norm_bounds_each_update_and_reports_the_norm(tmp_path):
    metrics = tmp_path / "m.jsonl"
    clip, lr = 1e-3, 0.1
    first = Session(config("train.grad_clip_norm=0.001", "train.steps=3"),
                    Outputs(metrics=str(metrics)), lambda e: None)
    start = torch.cat([p.detach().flatten().clone() for p in first.model.parameters()])
    first.fit(threading.Event())
    first.close()
    end = torch.cat([p.detach().flatten() for p in first.model.parameters()])
    # plain SGD moves at most lr * clip per step
    assert float((end - start).norm()) <= 3 * lr * clip * (1 + 1e-4)
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert len(lines) == 3 and all(line["grad_norm"] > clip for line in lines)


def test_no_grad_norm_without_clipping(tmp_path):
    metrics = tmp_path / "m.jsonl"
    train(config("train.steps=2"), outputs=Outputs(metrics=str(metrics)))
    assert all("grad_norm" not in json.loads(line) for line in
               metrics.read_text().splitlines())


# -- accumulation -----------------------------------------------------------------------
def test_accumulated_small_batches_take_the_big_batch_steps():
    big = fitted(text=LINEAR)
    small = fitted("dataset.steps.0.size=8", "train.accumulate_steps=4", text=LINEAR)
    # 100 examples: big batches 32,32,32,4; small ones 12 x 8 + 4, the last step's alone
    assert big.state.step == small.state.step == 8 and small.steps_per_epoch == 4
    assert small.state.totals.examples == big.state.totals.examples == 200
    for a, b in zip(big.model.parameters(), small.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert small.state.curve.points() == pytest.approx(big.state.curve.points(), rel=1e-5)


def test_train_steps_counts_optimizer_steps():
    session = fitted("dataset.steps.0.size=8", "train.accumulate_steps=3", "train.epochs=null",
                     "train.steps=6", text=LINEAR)
    # 13 batches a pass (12 x 8 + 4): steps of 3, 3, 3, 3, then the 1 left, then 3
    assert session.state.step == 6 and session.state.totals.examples == 100 + 3 * 8
    assert session.steps_per_epoch == 5


# -- precision --------------------------------------------------------------------------
def test_bf16_on_cpu_trains_close_to_fp32():
    fp32 = train(config("train.steps=30"))
    bf16 = train(config("train.steps=30", "train.precision=bf16"))
    assert bf16.final_loss < bf16.losses[0]
    assert bf16.final_loss == pytest.approx(fp32.final_loss, rel=0.1, abs=0.05)
    assert bf16.metrics["eval_loss"] == pytest.approx(fp32.metrics["eval_loss"], rel=0.1)


def test_fp16_on_cpu_is_a_config_problem():
    found = problems("train.precision=fp16")
    assert "GPU" in found["train.precision"].message
    assert "bf16" in found["train.precision"].hint


# -- evaluation, early stopping, best checkpoint -----------------------------------------
def test_eval_every_reports_each_evaluation(tmp_path):
    metrics, events = tmp_path / "m.jsonl", []
    result = train(config("train.eval_every=4"), outputs=Outputs(metrics=str(metrics)),
                   on_event=events.append)
    assert [e["step"] for e in result.evaluations] == [4, 8, 12]
    assert set(result.evaluations[0]) >= {"eval_loss", "eval_accuracy", "eval_examples"}
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    evals = [line for line in lines if "eval" in line]
    assert [line["step"] for line in evals] == [4, 8, 12]
    assert evals[-1]["eval"]["eval_loss"] == result.metrics["eval_loss"]  # not evaluated twice
    assert [e.step for e in events if isinstance(e, Evaluated)] == [4, 8, 12]


def test_early_stopping_stops_after_patience():
    # min_delta larger than any change: nothing after the first evaluation improves
    result = train(config("train.eval_every=2", "train.steps=100",
                          "train.early_stopping={metric: eval_loss, patience: 2, "
                          "min_delta: 100}"))
    assert result.status == "completed" and result.steps == 6
    assert result.early_stopped == {"step": 6, "metric": "eval_loss",
                                    "best": result.evaluations[0]["eval_loss"],
                                    "best_step": 2}


def test_keep_best_survives_rotation_and_resume(tmp_path):
    # the worst loss is the best "max": the first evaluation's, long rotated out by keep 1
    common = (f"checkpoint.dir={tmp_path}", "checkpoint.every_steps=1", "checkpoint.keep=1",
              "train.eval_every=3", "checkpoint.keep_best={metric: eval_loss, mode: max}")
    first = train(config(*common, "train.steps=9"))
    best = first.checkpoint["best"]
    assert first.checkpoint["best_step"] == 3 and best.endswith("ckpt-00000003.pt")
    names = sorted(p.name for p in tmp_path.glob("ckpt-*.pt"))
    assert names == ["ckpt-00000003.pt", "ckpt-00000009.pt"]
    resumed = train(config(*common, "train.steps=12"), resume=True)
    assert resumed.checkpoint["best"] == best
    assert sorted(p.name for p in tmp_path.glob("ckpt-*.pt")) == \
        ["ckpt-00000003.pt", "ckpt-00000012.pt"]
    assert [e["step"] for e in resumed.evaluations] == [3, 6, 9, 12]


def test_evaluation_needs_what_it_uses():
    found = problems("train.early_stopping={metric: loss}", "checkpoint.keep_best={}",
                     "checkpoint.export=safetensors")
    assert "eval_every" in found["train.early_stopping"].hint
    assert "train.early_stopping.metric" in found
    assert "checkpoint.dir" in found["checkpoint.keep_best"].message
    assert "checkpoint.dir" in found["checkpoint.export"].message
    assert "holdout" in problems("train.eval_every=2", "dataset.holdout=0")[
        "train.eval_every"].message


def test_a_parameter_server_job_refuses_what_it_cannot_do():
    text = TINY.replace("strategy: {compute_devices: [CPU:0, CPU:1]}", """\
strategy:
  kind: parameter_server
  cluster: {worker: ["localhost:2223"], ps: ["localhost:2222"]}
  task: {type: worker, index: 0}""")
    found = problems("train.grad_clip_norm=1", "train.accumulate_steps=2",
                     "train.precision=bf16", text=text)
    for field in ("train.grad_clip_norm", "train.accumulate_steps", "train.precision"):
        assert "parameter_server" in found[field].message


# -- export ------------------------------------------------------------------------------
def test_export_loads_with_safetensors_alone(tmp_path):
    from safetensors.torch import load_file
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model.eval()
    path = export_safetensors(model, tmp_path / "model.safetensors")
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3)).eval()
    tensors = load_file(str(path))
    assert set(tensors) == set(model.state_dict())
    fresh.load_state_dict(tensors)
    x = torch.randn(5, 4)
    torch.testing.assert_close(fresh(x), model(x))
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]  # no temp left


def test_a_run_exports_its_final_weights(tmp_path):
    result = train(config(f"checkpoint.dir={tmp_path}", "checkpoint.export=safetensors"))
    assert result.checkpoint["export"] == str(tmp_path / "model.safetensors")


# -- compile -----------------------------------------------------------------------------
COMPILES = torch_internals.compiles_in_replicas()


def test_compile_trains_like_eager(monkeypatch):
    from torch._dynamo.testing import CompileCounter
    counter = CompileCounter()
    monkeypatch.setattr(replica_step, "compiled",
                        lambda model: torch.compile(model, backend=counter))
    torch._dynamo.reset()
    compiled = fitted("train.compile=true", "train.steps=4")
    eager = fitted("train.steps=4")
    # the replicas called the compiled model; below the release that can, they ran the
    # model eagerly (one warning)
    assert counter.frame_count >= 1 if COMPILES else counter.frame_count == 0
    assert compiled.state.curve.points() == pytest.approx(eager.state.curve.points(), rel=1e-4)


@pytest.mark.skipif(not COMPILES, reason="this torch runs compiled replicas eagerly")
def test_compile_does_not_recompile_per_step(monkeypatch):
    """The graphs of a 2-replica run are made in its first runs (the probe's eager read
    included): as many for 12 steps as for 6, none per step."""
    from torch._dynamo.testing import CompileCounter
    counts = []
    for steps in (6, 12):
        counter = CompileCounter()
        monkeypatch.setattr(replica_step, "compiled",
                            lambda model: torch.compile(model, backend=counter))
        torch._dynamo.reset()
        fitted("train.compile=true", f"train.steps={steps}",
               "dataset.steps.1.drop_remainder=true")
        counts.append(counter.frame_count)
    # a few a replica (4 in all on torch 2.13, 5 on 2.11), whatever the step count
    assert counts[0] == counts[1] and 1 <= counts[0] <= 6, counts


class _CountingSGD(torch.optim.SGD):
    """An optimizer with a zero_grad of its own (e.g. one that keeps flat grad buffers)."""

    calls = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        type(self).calls += 1
        super().zero_grad(set_to_none)


def test_clearing_grads_skips_torchs_wrapper_but_keeps_an_optimizers_own_zero_grad(
        monkeypatch):
    layer = torch.nn.Linear(3, 2)
    layer(torch.ones(1, 3)).sum().backward()
    plain = torch.optim.SGD(layer.parameters(), lr=0.1)
    monkeypatch.setattr(torch.optim.Optimizer, "zero_grad", lambda *a, **k: 1 / 0)
    replica_step.clear_grads(plain)  # does not go through the (patched) method
    assert all(p.grad is None for p in layer.parameters())
    monkeypatch.undo()
    layer(torch.ones(1, 3)).sum().backward()
    own = _CountingSGD(layer.parameters(), lr=0.1)
    replica_step.clear_grads(own)
    assert _CountingSGD.calls == 1 and all(p.grad is None for p in layer.parameters())


def test_clearing_grads_keeps_a_zero_grad_patched_onto_the_optimizer():
    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    calls = []
    opt.zero_grad = lambda set_to_none=True: calls.append(set_to_none)  # as Apex does
    replica_step.clear_grads(opt)
    assert calls == [True]


# -- per-step cost ----------------------------------------------------------------------
def test_a_replica_step_calls_torch_for_the_model_and_loss_only(monkeypatch):
    # Each small op in a replica waits for the GIL the other replicas hold (~30 µs each
    # with 2 replicas in runner_overhead.py's timelines): the example count and the
    # step's seconds are Python numbers, and a float32 loss is not cast again.
    from collections import Counter

    from torch.overrides import TorchFunctionMode
    calls: Counter = Counter()

    class Count(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls[getattr(func, "__name__", str(func))] += 1
            return func(*args, **(kwargs or {}))
    real = replica_step.ReplicaStep.__call__

    def counted(self, *args):
        with Count():
            return real(self, *args)
    monkeypatch.setattr(replica_step.ReplicaStep, "__call__", counted)
    session = fitted("train.steps=1", "train.log_every=1")
    assert calls["tensor"] == calls["float"] == calls["to"] == 0, calls
    assert calls["argmax"] == calls["__eq__"] == calls["sum"] == 0, calls  # counted after
    assert calls["cross_entropy"] == calls["div"] == 2  # per replica
    assert session.state.last_log.replicas[0].examples == 8  # counted all the same
    assert session.state.last_log.accuracy is not None


@pytest.mark.parametrize("steps, accumulate", [(6, 1), (3, 2)])
def test_the_training_accuracy_counts_the_models_correct_predictions(steps, accumulate):
    # Counted on the caller after each run (objective.tally_step, all replicas and
    # accumulated batches at once), over one epoch of a model a tiny learning rate leaves
    # unchanged: the model's accuracy on the training split.
    session = fitted(f"train.steps={steps}", f"train.accumulate_steps={accumulate}",
                     "optimizer.lr=1e-12", f"train.log_every={steps}")
    indices = torch.as_tensor(session.pipeline.indices)
    with torch.no_grad():
        output = session.model(session.data.features[indices])
    correct = int((output.argmax(1) == session.data.targets[indices]).sum())
    assert session.state.totals.examples == len(indices) == 90
    assert session.state.totals.correct == correct
    assert session.state.last_log.accuracy == pytest.approx(correct / 90)


def _replica_outputs(sizes, classes=4):
    weight = torch.randn(3, classes, requires_grad=True)
    return [{"loss": torch.zeros(()), "examples": n,
             "predicted": (torch.randn(n, classes) @ weight.t(), torch.randint(0, 3, (n,)))}
            for n in sizes]


def _counted(replicas):
    return sum(int((o.argmax(1) == y).sum()) for o, y in (r["predicted"] for r in replicas))


def test_a_steps_outputs_are_taken_detached_and_counted_in_one_pass():
    from csrun.core.runner.objectives import NamedLoss, count_correct
    torch.manual_seed(0)
    runs = [_replica_outputs([5, 7]), _replica_outputs([4, 3])]  # accumulated: 2 runs
    expected = sum(_counted(run) for run in runs)
    pairs = NamedLoss("cross_entropy", True).tally_step(runs)
    assert all("predicted" not in r for run in runs for r in run)  # taken from the stats
    assert len(pairs) == 4 and not any(o.requires_grad for o, _ in pairs)  # graphs let go
    assert int(count_correct(pairs)) == expected
    assert NamedLoss("mse", False).tally_step([[{"loss": torch.zeros(())}]]) == []
    assert count_correct([]) == 0


class _OnAnotherGPU(torch.Tensor):
    """A CPU tensor that says it is on cuda:1 (count_correct groups by device)."""

    @property
    def device(self):
        return torch.device("cuda", 1)


def test_counts_on_different_devices_are_added_as_numbers():
    # 0-dim counts on cuda:0 and cuda:1 cannot be added as tensors
    from csrun.core.runner.objectives import count_correct
    torch.manual_seed(0)
    here = (torch.randn(6, 3), torch.randint(0, 3, (6,)))
    there = tuple(t.as_subclass(_OnAnotherGPU) for t in
                  (torch.randn(5, 3), torch.randint(0, 3, (5,))))
    counted = count_correct([here, there])
    assert type(counted) is int
    assert counted == sum(int((o.argmax(1) == y).sum()) for o, y in
                          (here, tuple(torch.Tensor(t) for t in there)))


def test_pending_correct_counts_when_taken_or_when_it_would_hold_too_much():
    from csrun.core.runner.objectives import NamedLoss, PendingCorrect
    torch.manual_seed(0)
    loss = NamedLoss("cross_entropy", True)
    steps = [_replica_outputs([6, 6]) for _ in range(4)]
    expected = [_counted(step) for step in steps]
    pending = PendingCorrect()
    for step in steps[:3]:
        pending.add(loss.tally_step([step]))
    assert len(pending._pairs) == 6  # nothing counted yet
    assert pending.take() == sum(expected[:3]) and pending.take() == 0
    small = PendingCorrect(limit_bytes=1)  # every step's outputs are over the limit
    small.add(loss.tally_step([steps[3]]))
    assert small._pairs == [] and small.take() == expected[3]  # counted at once, let go
    pending.add(2)  # a loss function's count is a number
    assert pending.take() == 2
    view = torch.randn(64, 32, 3)[:, -1]  # a slice keeps its whole storage alive
    pending.add([(view, torch.zeros(64, dtype=torch.long))])
    assert pending._bytes == 64 * 32 * 3 * 4 + 64 * 8


def test_a_fractional_accuracy_counts_the_same_however_often_it_is_read():
    # A loss function's accuracy may be fractional: each replica's is made whole per
    # step, as before, so a log line does not depend on when the count was read.
    from csrun.core.runner.objectives import LossFunction
    loss = LossFunction("torch.nn.functional:cross_entropy")  # any importable target
    runs = [[{"loss": torch.zeros(()), "examples": 2,
              "per_example": {"accuracy": torch.tensor([0.75, 0.5])}} for _ in range(2)]
            for _ in range(2)]  # 2 runs x 2 replicas: each replica 2.5 -> 2
    assert loss.tally_step(runs) == 4
