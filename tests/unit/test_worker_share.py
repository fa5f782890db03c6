"""A parameter-server worker's share of the input (csrun.core.data.worker_share): the
workers' shares of a pass are disjoint, cover it, follow the epoch's seeded order, split a
remainder as TF splits a batch, and a worker loads only its own examples."""

import itertools
import threading

import pytest
import torch

from csrun.core.data.pipeline import Pipeline
from csrun.core.data.sources import load_source, split_holdout
from csrun.core.data.worker_share import WorkerShare, split
from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.roles import LocalRole
from csrun.core.runner.session import Outputs, Session
from csrun.core.runner.state import position_at
from tests.helpers import recorded_data
from tests.helpers.tiny_config import tiny_config

TEXT = """\
strategy: {compute_devices: [CPU:0]}
dataset:
  source: {kind: import, target: "tests.helpers.recorded_data:Recorded", kwargs: {size: 43}}
  collate: "tests.helpers.recorded_data:collate"
  steps:
    - {op: shuffle, buffer: 64}
    - {op: batch, size: 10}
model: {kind: import, target: "tests.helpers.recorded_data:Net",
        loss: "tests.helpers.recorded_data:loss"}
train: {steps: 1}
"""


def pipeline(*overrides):
    config = load_config_text(TEXT, "c.yaml", list(overrides))
    data = load_source(config.dataset.source)
    indices, _ = split_holdout(len(data), 0, 0)
    return Pipeline(config.dataset, data, indices, seed=0)


def test_split_is_tf_s_rule_ceil_per_part_the_last_ones_get_fewer_or_none():
    assert split(list(range(10)), 4) == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert split([7, 8, 9], 2) == [[7, 8], [9]]
    assert split([7], 3) == [[7], [], []]
    assert split([], 2) == [[], []]


@pytest.mark.parametrize("workers,replicas", [(1, 1), (2, 1), (3, 1), (2, 2), (4, 2)])
def test_the_shares_of_a_pass_are_disjoint_and_cover_it_in_the_epoch_s_order(workers,
                                                                               replicas):
    p = pipeline()
    for epoch in (0, 1):
        plan = list(p.plan(epoch))  # 43 examples: batches of 10, 10, 10, 10, 3
        shares = [list(p.plan(epoch, share=WorkerShare(workers, w, replicas)))
                  for w in range(workers)]
        for w, share in enumerate(shares):  # a part of every global batch, per replica
            assert len(share) == len(plan) * replicas == p.batches_per_epoch(
                share=WorkerShare(workers, w, replicas))
        for k, batch in enumerate(plan):  # together, each global batch in its order
            step = [part for share in shares for part in share[k * replicas:
                                                               (k + 1) * replicas]]
            assert list(itertools.chain.from_iterable(step)) == batch
        assert shares == [list(p.plan(epoch, share=WorkerShare(workers, w, replicas)))
                          for w in range(workers)]  # deterministic
    assert list(p.plan(0)) != list(p.plan(1))  # reshuffled each epoch, every worker alike


def test_a_remainder_batch_is_split_as_tf_splits_it():
    p = pipeline()
    last = list(p.plan(0))[-1]  # 3 examples
    parts = [list(p.plan(0, share=WorkerShare(2, w, 2)))[-2:] for w in range(2)]
    # 2 workers: 2 + 1 examples; then each worker's over its 2 replicas: 1 + 1, 1 + 0
    assert parts == [[last[0:1], last[1:2]], [last[2:3], []]]


def test_per_replica_rounds_keep_a_worker_s_replicas_batches_and_drop_an_incomplete_one():
    p = pipeline()
    plan = list(p.plan(0, batch_size=4))  # 10 per-replica batches of 4, then one of 3
    for w in range(2):
        share = WorkerShare(2, w, 2, rounds=True)  # a round: 4 batches, 2 per worker
        mine = list(p.plan(0, batch_size=4, share=share))
        assert mine == [b for k, b in enumerate(plan[:8]) if k % 4 // 2 == w]
        assert p.batches_per_epoch(batch_size=4, share=share) == len(mine) == 4


def test_a_worker_reads_and_collates_only_its_own_examples():
    p = pipeline()
    read = []
    for w in range(3):
        p.data.dataset.reads.clear()
        recorded_data.collated.clear()
        share = WorkerShare(3, w, 1)
        mine = sorted(i for part in p.plan(1, share=share) for i in part)
        batches = list(p.loader(1, share=share))
        assert sorted(p.data.dataset.reads) == mine == sorted(recorded_data.collated)
        assert sorted(int(i) for _, y in batches for i in y) == mine
        read += mine
    assert sorted(read) == list(range(43))


def test_an_empty_part_is_an_empty_batch_of_the_worker_s_own_structure():
    # batches of 10, 10, 10, 10 and 3: 4 workers get 1, 1, 1 and 0 of the last
    p = pipeline()
    p.data.dataset.reads.clear()
    batches = list(p.loader(0, share=WorkerShare(4, 3, 1)))
    assert [len(y) for _, y in batches] == [1, 1, 1, 1, 0]
    x, y = batches[-1]
    assert x.shape == (0, 4) and y.dtype == torch.int64
    assert len(p.data.dataset.reads) == 4
    # resumed at the last global batch: nothing of its own left; the pass's first is copied
    p.data.dataset.reads.clear()
    (x, y), = list(p.loader(0, 4, share=WorkerShare(4, 3, 1)))
    assert x.shape == (0, 4) and len(p.data.dataset.reads) == 1


def test_a_worker_with_no_example_in_a_pass_is_told_so():
    p = pipeline("dataset.source.kwargs.size=2", "dataset.steps.1.size=2")
    with pytest.raises(ValueError, match="worker 2 of 3 has no example in pass 0"):
        list(p.loader(0, share=WorkerShare(3, 2, 1)))


@pytest.mark.parametrize("step,expected", [(0, (0, 0)), (9, (0, 18)), (10, (1, 0)),
                                           (25, (2, 10))])
def test_a_restarted_worker_s_place_in_its_share_follows_from_its_step(step, expected):
    assert position_at(step, steps_per_epoch=10, accumulate_steps=2) == expected


def test_without_a_known_pass_length_a_worker_is_in_its_first_pass():
    assert position_at(7, None, 1) == (0, 7)
    assert position_at(7, None, 3) == (0, 21)


class _HearsOnlyItsStep(LocalRole):
    """A role whose ``begin`` says only a step, as for a worker restarted alone."""

    def begin(self, where, optimizer):
        return {"step": 5}


def test_a_session_that_hears_only_its_step_starts_at_that_step_s_place():
    # 72 training examples in batches of 16: 5 a pass, 3 steps of 2 batches (the last 1)
    config = load_config_text(tiny_config("train.steps=6", "train.accumulate_steps=2"))
    session = Session(config, Outputs(), lambda e: None, _HearsOnlyItsStep(config))
    assert session.steps_per_epoch == 3
    session.fit(threading.Event())
    # step 5 is epoch 1, batch 4: the sixth step takes that pass's last batch, ending it
    assert session.checkpoints.resumed_from == 5
    assert (session.state.step, session.state.epoch, session.state.position) == (6, 2, 0)
