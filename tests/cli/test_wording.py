"""Counts and numbers as a user reads them (issue 27): plurals, the batch split, and the
epoch a step is in, counted from 1 as the summary's "2.00 epochs" is."""

from __future__ import annotations


def test_validate_counts_in_words(cli, tiny):
    out = cli("validate", tiny, "train.steps=null", "train.epochs=1").stdout
    assert "  train: 1 epoch, seed 0" in out.splitlines()
    out = cli("validate", tiny, "train.steps=1").stdout
    assert "  train: 1 step, seed 0" in out.splitlines()


def test_the_last_step_of_two_epochs_is_in_epoch_2(cli, tiny):
    result = cli("train", tiny, "train.steps=null", "train.epochs=2", "train.log_every=5")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    # 72 examples to train in batches of 16: 5 steps an epoch
    assert "step 5/10 · epoch 1 ·" in out and "step 10/10 · epoch 2 ·" in out
    assert "steps          10/10 (2.00 epochs)" in out


def test_the_start_says_how_a_global_batch_is_split(cli, tiny):
    out = cli("train", tiny).stdout
    assert "CentralStorageStrategy: 2 replicas on CPU:0, CPU:1" in out
    assert "global batch 16, split into ~8 per replica\n" in out
    out = cli("train", tiny, "strategy.compute_devices=[CPU:0]").stdout
    assert "CentralStorageStrategy: 1 replica on CPU:0" in out
