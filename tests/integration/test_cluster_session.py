"""The runner's worker sessions against a real ps, in one process (threads, loopback):
each worker trains on its part of the global batch (its share of the data) with its loss
divided by the whole batch, so the updates of the two workers add up to one
central-storage step over the same examples."""

import json
import threading

import pytest
import torch

from csrun.core.runner.cluster_role import ClusterRole, connect, run_task
from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.launch import free_ports
from csrun.core.runner.session import Outputs, Session

TEXT = """\
strategy: {kind: parameter_server, compute_devices: [CPU:0]}
dataset:
  source: {kind: synthetic, examples: 63, features: 4, classes: 3}
  steps:
    - {op: batch, size: 10}
    - {op: skip, count: 6}          # the last batch: 3 examples, split 2 + 1
model: {kind: mlp, hidden: [8]}
optimizer: {name: SGD, lr: 0.5}
train: {steps: 1}
"""


def first_batch(session):
    """The first batch of the session's pass (one step's worth)."""
    state = session.state
    return next(iter(session.batches.distributed(state.epoch, state.position)))


# global: the last batch's 3 examples split 2 + 1 (TF's rule); per_replica: per-replica
# batches of 5, the first round's two, one per worker
@pytest.mark.parametrize("distribute,weights", [("global", (2, 1)), ("per_replica", (1, 1))])
@pytest.mark.timeout(120)
def test_two_workers_slices_add_up_to_one_central_storage_step(distribute, weights):
    ports = free_ports(3)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports[:2]], "ps": [f"127.0.0.1:{ports[2]}"]}
    kind = [f"dataset.distribute={distribute}"]

    def config(job, index):
        return load_config_text(TEXT, "c.yaml", [f"strategy.cluster={json.dumps(cluster)}",
                                                 f"strategy.task={{type: {job}, index: {index}}}",
                                                 *kind])

    stop = threading.Event()
    served = []
    ps = threading.Thread(target=lambda: served.append(run_task(
        config("ps", 0), False, Outputs(), lambda e: None, stop)), daemon=True)
    ps.start()

    def worker_session(i):
        cfg, emit = config("worker", i), lambda e: None
        return Session(cfg, Outputs(), emit, ClusterRole(connect(cfg), cfg, emit))

    workers = [worker_session(i) for i in range(2)]
    for worker in workers:
        worker.strategy.extended.pull()  # both start from the initial values
    for worker in workers:  # one step each, in turn: no update is stale
        with worker.strategy.scope():
            worker._train_step([first_batch(worker)], 0.0)

    reference = Session(load_config_text(TEXT.replace(
        "kind: parameter_server, compute_devices: [CPU:0]",
        "compute_devices: [CPU:0, CPU:1], parameter_device: CPU:0"), "c.yaml", kind),
        Outputs(), lambda e: None)
    with reference.strategy.scope():
        reference._train_step([first_batch(reference)], 0.0)

    workers[0].strategy.extended.pull()
    for mine, theirs in zip(workers[0].model.parameters(), reference.model.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-6)
    # each worker's loss is the mean over its own part: 2 and 1 of the 3 examples (global)
    losses = [w.state.first_loss for w in workers]
    mean = (weights[0] * losses[0] + weights[1] * losses[1]) / sum(weights)
    assert mean == pytest.approx(reference.state.first_loss, rel=1e-6)

    workers[1].strategy.extended.finish()
    assert workers[0].strategy.extended.finish(timeout=30) == []
    ps.join(timeout=30)
    assert served and served[0].status == "completed"
