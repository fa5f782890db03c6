"""Divided input in a parameter-server job, in one process (threads, loopback): each
worker reads only its share of every pass, the shares are disjoint and cover the data,
with `dataset.distribute: global` and `per_replica` alike."""

import itertools
import json
import threading

import pytest

from csrun.core.data.worker_share import WorkerShare
from csrun.core.runner.cluster_role import ClusterRole, connect, run_task
from csrun.core.runner.launch import free_ports
from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.session import Outputs, Session, run_session

TEXT = """\
strategy: {kind: parameter_server, compute_devices: [CPU:0]}
dataset:
  source: {kind: import, target: "tests.helpers.recorded_data:Recorded", kwargs: {size: 43}}
  collate: "tests.helpers.recorded_data:collate"
  steps:
    - {op: shuffle, buffer: 64}
    - {op: batch, size: 10}
model: {kind: import, target: "tests.helpers.recorded_data:Net",
        loss: "tests.helpers.recorded_data:loss"}
optimizer: {name: SGD, lr: 0.1}
train: {epochs: 2, log_every: 1}
"""


def run_job(*overrides):
    """A ps and two workers trained to the end; the workers' sessions and results."""
    ports = free_ports(3)
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports[:2]], "ps": [f"127.0.0.1:{ports[2]}"]}

    def config(job, index):
        return load_config_text(TEXT, "c.yaml", [
            f"strategy.cluster={json.dumps(cluster)}",
            f"strategy.task={{type: {job}, index: {index}}}", *overrides])

    stop = threading.Event()
    ps = threading.Thread(target=run_task, args=(config("ps", 0), False, Outputs(),
                                                 lambda e: None, stop), daemon=True)
    ps.start()
    sessions, results = [], {}
    for i in range(2):
        cfg, emit = config("worker", i), lambda e: None
        sessions.append(Session(cfg, Outputs(), emit, ClusterRole(connect(cfg), cfg, emit)))
    threads = [threading.Thread(target=lambda i=i: results.update(
        {i: run_session(sessions[i], False, stop)}), daemon=True) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads + [ps]:
        thread.join(timeout=120)
    assert sorted(results) == [0, 1], "a worker did not finish"
    return sessions, results


def shares(session, **plan):
    """Each pass's examples of each worker, as its share of the plan says."""
    return [[[i for part in session.pipeline.plan(epoch, share=WorkerShare(2, w, 1, **plan),
                                                  batch_size=plan.get("rounds") and 5)
              for i in part] for w in range(2)] for epoch in range(2)]


@pytest.mark.timeout(180)
def test_two_workers_read_disjoint_shares_that_cover_each_pass():
    sessions, results = run_job()
    expected = shares(sessions[0])
    for w, session in enumerate(sessions):
        assert session.steps_per_epoch == 5  # a part of each of the 5 global batches
        assert results[w].status == "completed" and session.state.step == 10
        # read, in order, exactly its share of pass 0 then of pass 1
        assert session.data.dataset.reads == expected[0][w] + expected[1][w]
    for epoch in expected:  # 22 + 21 examples: disjoint, together every example once
        assert sorted(epoch[0] + epoch[1]) == list(range(43))
    assert [len(e[0]) for e in expected] == [5 + 5 + 5 + 5 + 2] * 2


@pytest.mark.timeout(180)
def test_per_replica_batches_run_in_a_parameter_server_job():
    # per-replica batches of 10 / 2 = 5: 8 of them and one of 3 a pass, in rounds of 2
    # (one per worker); the incomplete last round is dropped by both
    sessions, results = run_job("dataset.distribute=per_replica")
    expected = shares(sessions[0], rounds=True)
    for w, session in enumerate(sessions):
        assert session.steps_per_epoch == 4
        assert results[w].status == "completed" and session.state.step == 8
        assert session.data.dataset.reads == expected[0][w] + expected[1][w]
        assert results[w].per_replica[0]["examples"] == 8 * 5
    for epoch in expected:
        assert not set(epoch[0]) & set(epoch[1]) and len(epoch[0] + epoch[1]) == 40
    assert list(itertools.chain(*expected[0])) != list(itertools.chain(*expected[1]))


@pytest.mark.timeout(180)
def test_one_pipeline_per_replica_reads_the_replica_s_shard_as_in_central_storage():
    # a shard step left to the InputContext: replica r of 2 keeps every 2nd example
    sessions, results = run_job("dataset.distribute=per_replica",
                                "dataset.replication=per_replica",
                                "dataset.steps=[{op: shuffle, buffer: 64}, {op: shard}, "
                                "{op: batch, size: 10}]")
    for w, session in enumerate(sessions):
        mine = [[i for b in session.pipeline.plan(epoch, 2, w, 5) for i in b]
                for epoch in range(2)]  # 22 and 21 examples: 5 batches each
        assert session.steps_per_epoch == 5 and session.state.step == 10
        assert session.data.dataset.reads == mine[0] + mine[1]
        assert results[w].status == "completed"
    reads = [s.data.dataset.reads for s in sessions]
    assert sorted(reads[0] + reads[1]) == sorted(list(range(43)) * 2)
