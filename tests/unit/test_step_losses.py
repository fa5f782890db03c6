"""The runner reads the steps' losses at logs, not each step, where a read waits for a
device: counted on logical CPU replicas with the loss treated as one on a GPU."""

import pytest
import torch

from csrun.core.runner import step_losses
from csrun.core.runner.errors import NonFiniteLoss
from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.step_losses import StepLosses
from csrun.core.runner.train import train
from tests.helpers.op_count import OpCount
from tests.helpers.tiny_config import tiny_config

# one pass holds every step: the pass's end is no read
# SGD: Adam reads its step count each step (on the CPU; a plain loop does the same)
TEXT = tiny_config("dataset.source.examples=4000", "model.dropout=0", "train.eval_every=0",
                   "optimizer={name: SGD, lr: 0.1}")


def _reads(steps: int, log_every: int, *overrides: str) -> tuple[int, object]:
    """The values the run's thread read: one-value reads (item, float) and the reads of
    held losses (a stack read with .tolist, which no op shows); and the result."""
    config = load_config_text(TEXT, "tiny.yaml", [f"train.steps={steps}",
                                                  f"train.log_every={log_every}", *overrides])
    count, batches, read_all = OpCount(), [], step_losses._read_all

    def counted(tensors):
        batches.append(len(tensors))
        return read_all(tensors)
    step_losses._read_all = counted
    try:
        with count.counting():  # the caller's thread: where the runner reads
            result = train(config, on_event=lambda e: None)
    finally:
        step_losses._read_all = read_all
    return count.ops["_local_scalar_dense"] + count.ops["item"] + len(batches), result


@pytest.fixture
def on_a_gpu(monkeypatch):
    """The losses read as if on a device the host waits for."""
    monkeypatch.setattr(step_losses, "waits_to_read", lambda tensor: True)


def test_a_loss_the_host_waits_for_is_read_per_log_not_per_step(on_a_gpu):
    few, short = _reads(6, 6)
    many, long = _reads(18, 18)  # 12 steps more, as many logs: not one read more
    assert many - few <= 2, (few, many)
    assert len(long.losses) == 18 and all(isinstance(x, float) for x in long.losses)


def test_clipping_reads_no_gradient_norm_each_step(on_a_gpu):
    few, _ = _reads(6, 6, "train.grad_clip_norm=1.0")
    many, _ = _reads(18, 18, "train.grad_clip_norm=1.0")
    assert many - few <= 2, (few, many)  # the norm is read by a --metrics record only


def test_read_late_the_losses_are_those_read_each_step(on_a_gpu, monkeypatch):
    deferred = _reads(14, 5)[1]
    monkeypatch.setattr(step_losses, "waits_to_read", lambda tensor: False)
    each = _reads(14, 5)[1]
    assert deferred.losses == each.losses and deferred.params_sha256 == each.params_sha256
    assert [r["loss"] for r in deferred.per_replica] == \
        [r["loss"] for r in each.per_replica]


def test_on_the_cpu_each_step_is_read_and_checked_before_its_update(monkeypatch):
    few, _ = _reads(6, 6)
    many, _ = _reads(18, 18)
    assert many - few >= 12  # each step: its losses read at once (one stack)


def test_a_late_read_nan_names_its_step_and_the_updates_that_ran(on_a_gpu, tmp_path):
    with pytest.raises(NonFiniteLoss) as info:
        _reads(12, 6, "optimizer.lr=1e30", f"checkpoint.dir={tmp_path}")
    message = str(info.value)
    assert "at step" in message and "read later" in message and "updates of steps" in message


def test_held_losses_are_bounded_and_read_in_one_go_per_device():
    held = StepLosses(each_step=False)
    gpu_like = torch.tensor(1.0)
    step_losses_waits = step_losses.waits_to_read
    try:
        step_losses.waits_to_read = lambda tensor: True
        for step in range(1, step_losses.CAPACITY):
            held.add(step, [[gpu_like], [gpu_like * 2]], [gpu_like * 3], 3)
            assert not held.due()
        held.add(step_losses.CAPACITY, [[gpu_like], [gpu_like]], [gpu_like * 2], 2)
        assert held.due()  # full: read now, whatever the interval
    finally:
        step_losses.waits_to_read = step_losses_waits
    count = OpCount()
    with count.counting():
        read = held.read()
    assert count.ops["_local_scalar_dense"] == 0 and count.ops["stack"] == 1
    assert read[0].loss == 1.0 and read[0].replicas == [1.0, 2.0] and held.held == 0
    assert read[-1].step == step_losses.CAPACITY and read[-1].replicas == [1.0, 1.0]
