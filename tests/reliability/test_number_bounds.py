"""Every number of the config at its extreme (round 4): ``validate`` refuses what ``train``
could not hold, naming the key and its line, and what it lets through trains or fails
with csrun's own message -- never an ``OverflowError`` from deep inside.

``strategy.timeout_s=1e308`` passed ``validate`` and failed ``train`` with "Python int too
large to convert to C int"; ``train.log_every=2**63-1`` with "C ssize_t"; a ``prefetch``
of ``2**63-1`` with DataLoader workers hung in torch's loop over ``prefetch_factor``;
``num_gpus_per_worker=2**63-1`` hung ``validate`` listing that many GPUs; a range source
from ``-2**63`` held 0 examples (its float32 values collapsed), and one from ``2**24``
repeated some.

:data:`EXTREMES` holds an entry for every numeric field of the schema (a new field
without one fails :func:`test_every_numeric_field_of_the_schema_has_an_extreme`): the
overrides that set it to its extreme and what must happen.
"""

from __future__ import annotations

import re
import types
import typing

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from csrun.cli.main import app
from csrun.core.config import schema
from tests.helpers.tiny_config import tiny_config

BIG = 2**63 - 1
PS = ("strategy={kind: parameter_server, cluster: {worker: ['localhost:2222'], "
      "ps: ['localhost:2223']}, task: {type: worker, index: 0}}",)
RANGE = ("model.loss=mse",)
REFUSED, RUNS, FAILS, VALID = "refused", "runs", "fails cleanly", "valid"

# Model.field: (overrides, what must happen, the path a refusal names). RUNS: validate
# passes and 2 steps train; FAILS: validate passes and train ends with exit 1 and
# csrun's message; VALID: validate passes (a cluster, or a run that lasts forever by
# design: a signal stops it, tests/reliability/test_attack_corpus.py).
EXTREMES: dict[str, tuple[tuple[str, ...], str, str]] = {
    "TaskConfig.index": (PS[:-1] + (PS[0].replace("index: 0", f"index: {BIG}"),), REFUSED,
                         "strategy.task.index"),
    "ParameterServerConfig.num_ps": (PS + (f"strategy.num_ps={BIG}",), REFUSED,
                                     "strategy.num_ps"),
    "ParameterServerConfig.num_gpus_per_worker": (
        PS + (f"strategy.num_gpus_per_worker={BIG}",), REFUSED,
        "strategy.num_gpus_per_worker"),
    "FixedShardsConfig.num_shards": (
        PS + ("strategy.variable_partitioner={kind: fixed, num_shards: 65537}",), REFUSED,
        "strategy.variable_partitioner"),
    "MinSizeConfig.min_shard_bytes": (
        PS + (f"strategy.variable_partitioner={{kind: min_size, min_shard_bytes: {BIG}}}",),
        VALID, ""),
    "MinSizeConfig.max_shards": (
        PS + ("strategy.variable_partitioner={kind: min_size, max_shards: 65537}",),
        REFUSED, "strategy.variable_partitioner"),
    # one shard per variable, whatever its size
    "MaxSizeConfig.max_shard_bytes": (
        PS + (f"strategy.variable_partitioner={{kind: max_size, max_shard_bytes: {BIG}}}",),
        VALID, ""),
    "MaxSizeConfig.max_shards": (
        PS + ("strategy.variable_partitioner={kind: max_size, max_shard_bytes: 8, "
              "max_shards: 65537}",), REFUSED, "strategy.variable_partitioner"),
    "ParameterServerConfig.timeout_s": (PS + ("strategy.timeout_s=1e308",), REFUSED,
                                        "strategy.timeout_s"),
    # one bucket holds everything: the old one-copy path (on the copy path it runs)
    "CentralStorageConfig.bytes_per_pack": (("strategy.copy_parameters=true",
                                             f"strategy.bytes_per_pack={BIG}"), RUNS, ""),
    "ParameterServerConfig.bytes_per_pack": (PS + (f"strategy.bytes_per_pack={BIG}",),
                                             VALID, ""),
    "RangeSource.start": (RANGE + (f"dataset.source={{kind: range, start: {-BIG - 1}, "
                                   f"stop: {-BIG + 99}}}",), REFUSED,
                          "dataset.source.start"),
    "RangeSource.stop": (RANGE + (f"dataset.source={{kind: range, stop: {BIG}}}",),
                         REFUSED, "dataset.source.stop"),
    "RangeSource.step": (RANGE + (f"dataset.source={{kind: range, stop: 100, step: {BIG}}}",),
                         REFUSED, "dataset"),
    "SyntheticSource.examples": ((f"dataset.source.examples={BIG}",), REFUSED,
                                 "dataset.source"),
    "SyntheticSource.features": ((f"dataset.source.features={BIG}",), REFUSED,
                                 "dataset.source"),
    "SyntheticSource.classes": ((f"dataset.source.classes={BIG}",), REFUSED,
                                "dataset.source"),
    "SyntheticSource.targets": (("dataset.source.task=regression",
                                 f"dataset.source.targets={BIG}"), REFUSED, "dataset.source"),
    "SyntheticSource.noise": (("dataset.source.noise=1e308",), FAILS, ""),
    "SyntheticSource.seed": ((f"dataset.source.seed={BIG}",), RUNS, ""),
    "FileSource.target_column": (("dataset.source={kind: file, path: data.npy, "
                                  f"target_column: {BIG}}}",), REFUSED,
                                 "dataset.source.target_column"),
    "ShuffleStep.buffer": ((f"dataset.steps.0.buffer={BIG}",), RUNS, ""),
    "ShuffleStep.seed": ((f"dataset.steps.0.seed={-BIG - 1}",), RUNS, ""),
    "BatchStep.size": ((f"dataset.steps.1.size={BIG}",), REFUSED, "dataset.steps.1.size"),
    "RepeatStep.count": ((f"dataset.steps=[{{op: repeat, count: {BIG}}}, "
                          "{op: batch, size: 16}]",), RUNS, ""),
    "TakeStep.count": ((f"dataset.steps=[{{op: take, count: {BIG}}}, {{op: batch, size: 16}}]",),
                       RUNS, ""),
    "SkipStep.count": ((f"dataset.steps=[{{op: skip, count: {BIG}}}, {{op: batch, size: 16}}]",),
                       REFUSED, "dataset.steps"),
    "ShardStep.num_shards": ((f"dataset.steps=[{{op: shard, num_shards: {BIG}, index: 0}}, "
                              "{op: batch, size: 16}]",), REFUSED, "dataset.steps"),
    "ShardStep.index": ((f"dataset.steps=[{{op: shard, num_shards: 2, index: {BIG}}}, "
                         "{op: batch, size: 16}]",), REFUSED, "dataset.steps.0.index"),
    "NormalizeStep.mean": (("dataset.steps=[{op: normalize, mean: 1e308}, "
                            "{op: batch, size: 16}]",), FAILS, ""),
    "NormalizeStep.std": (("dataset.steps=[{op: normalize, std: 1e308}, "
                           "{op: batch, size: 16}]",), RUNS, ""),
    "PrefetchStep.buffer": (("dataset.workers=1", "dataset.steps=[{op: batch, size: 16}, "
                             f"{{op: prefetch, buffer: {BIG}}}]"), REFUSED,
                            "dataset.steps.1.buffer"),
    "DatasetConfig.holdout": (("dataset.holdout=1.0",), REFUSED, "dataset.holdout"),
    "DatasetConfig.workers": ((f"dataset.workers={BIG}",), REFUSED, "dataset.workers"),
    "MLPModel.hidden": ((f"model.hidden=[{BIG}]",), REFUSED, "model"),
    "MLPModel.dropout": (("model.dropout=1.0",), REFUSED, "model.dropout"),
    "CNNModel.channels": (("dataset.source={kind: digits, layout: image}",
                           f"model={{kind: cnn, channels: [{BIG}]}}"), REFUSED, "model"),
    "CNNModel.kernel_size": (("dataset.source={kind: digits, layout: image}",
                              f"model={{kind: cnn, kernel_size: {BIG}}}"), REFUSED, "model"),
    "CNNModel.hidden": (("dataset.source={kind: digits, layout: image}",
                         f"model={{kind: cnn, hidden: {BIG}}}"), REFUSED, "model"),
    "OptimizerConfig.lr": (("optimizer.lr=1e308",), FAILS, ""),
    # the tiny config's MLP has no table: refused before its lr matters
    "TableOptimizerConfig.lr": (("optimizer.tables={name: Adagrad, lr: 1e308}",), REFUSED,
                                "optimizer.tables"),
    "ScheduleConfig.steps": ((f"optimizer.schedule=[{{name: LinearLR, steps: {BIG}}}, "
                              "{name: StepLR, kwargs: {step_size: 2}}]",), RUNS, ""),
    "TrainConfig.steps": ((f"train.steps={BIG}",), VALID, ""),
    "TrainConfig.epochs": (("~train.steps", f"train.epochs={BIG}"), VALID, ""),
    "TrainConfig.seed": ((f"train.seed={-BIG - 1}",), RUNS, ""),
    "TrainConfig.log_every": ((f"train.log_every={BIG}",), REFUSED, "train.log_every"),
    "TrainConfig.divergence": (("train.divergence=1e308",), RUNS, ""),
    "TrainConfig.grad_clip_norm": (("train.grad_clip_norm=1e308",), RUNS, ""),
    "TrainConfig.accumulate_steps": ((f"train.accumulate_steps={BIG}",), RUNS, ""),
    "TrainConfig.eval_every": ((f"train.eval_every={BIG}",), RUNS, ""),
    "EarlyStoppingConfig.patience": (("train.eval_every=1", "train.early_stopping="
                                      f"{{patience: {BIG}}}"), RUNS, ""),
    "EarlyStoppingConfig.min_delta": (("train.eval_every=1", "train.early_stopping="
                                       "{min_delta: 1e308}"), RUNS, ""),
    "CheckpointConfig.every_steps": (("checkpoint.dir=ck",
                                      f"checkpoint.every_steps={BIG}"), RUNS, ""),
    "CheckpointConfig.keep": (("checkpoint.dir=ck", f"checkpoint.keep={BIG}"), RUNS, ""),
}


def _numeric_fields(model: type[BaseModel], seen: set) -> set[str]:
    found = set()
    for name, field in model.model_fields.items():
        for leaf in _leaves(field.annotation):
            if isinstance(leaf, type) and issubclass(leaf, BaseModel) and leaf not in seen:
                seen.add(leaf)
                found |= _numeric_fields(leaf, seen)
            elif leaf in (int, float):
                found.add(f"{model.__name__}.{name}")
    return found


def _leaves(annotation):
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType, typing.Annotated, list, dict):
        for arg in typing.get_args(annotation):
            yield from _leaves(arg)
    else:
        yield annotation


def test_every_numeric_field_of_the_schema_has_an_extreme():
    assert _numeric_fields(schema.RunConfig, set()) == set(EXTREMES)


def _run(command, tmp_path, monkeypatch, overrides):
    import numpy as np
    monkeypatch.chdir(tmp_path)
    np.save(tmp_path / "data.npy", np.arange(60, dtype=np.float32).reshape(20, 3) % 3)
    (tmp_path / "c.yaml").write_text(tiny_config("train.steps=2", *overrides))
    args = [command, "c.yaml"] + (["--json", "-"] if command == "validate" else [])
    done = CliRunner().invoke(app, args, catch_exceptions=False)
    assert "Traceback" not in done.stderr and "CSRUN_TRACEBACK" not in done.stderr, \
        done.stderr  # CSRUN_TRACEBACK: csrun's "unexpected error"
    return done


def _check(field, tmp_path, monkeypatch):
    overrides, outcome, path = EXTREMES[field]
    done = _run("validate", tmp_path, monkeypatch, overrides)
    if outcome == REFUSED:
        assert done.exit_code == 2, done.stderr
        assert path and path in done.stderr, done.stderr
        return
    assert done.exit_code == 0, done.stderr
    if outcome in (RUNS, FAILS):
        done = _run("train", tmp_path, monkeypatch, overrides)
        assert done.exit_code == (0 if outcome == RUNS else 1), done.stderr


NEW = ["ParameterServerConfig.timeout_s", "ParameterServerConfig.num_gpus_per_worker",
       "PrefetchStep.buffer", "TrainConfig.log_every", "RangeSource.start"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("field", NEW)
def test_numbers_train_could_not_hold_are_refused_by_validate(field, tmp_path, monkeypatch):
    _check(field, tmp_path, monkeypatch)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("field", sorted(set(EXTREMES) - set(NEW)))
def test_a_field_at_its_extreme_is_refused_or_runs_cleanly(field, tmp_path, monkeypatch):
    _check(field, tmp_path, monkeypatch)


@pytest.mark.parametrize("value, said", [
    ("1e308", "1e+308 s is more than 1,000,000 s, the most it can be"),
    ("0.0001", "0.0001 s is less than 0.001 s, the least it can be"),
    ("1000000", None), ("0.001", None)])
def test_timeout_s_says_its_range(value, said):
    config = {"kind": "parameter_server", "timeout_s": float(value)}
    if said is None:
        assert schema.ParameterServerConfig(**config).timeout_s == float(value)
        return
    with pytest.raises(ValueError, match=re.escape(said)):
        schema.ParameterServerConfig(**config)
