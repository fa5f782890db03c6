"""Bring your own training: user datasets (map-style and iterable), collate and loss
functions, replica equivalence with them, preflight on CPU when meta cannot trace, paths."""

import itertools
import os
import sys
import threading
import uuid
import warnings

import pytest
import torch

from csrun.core.config.problems import ConfigError, ConfigNotice
from csrun.core.config.schema import DatasetConfig
from csrun.core.data.pipeline import Pipeline
from csrun.core.data.sources import load_source, split_holdout
from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.session import Outputs, Session, run_session

USER_CODE = '''
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset, IterableDataset


class Pairs(Dataset):
    """Dict examples: int64 token ids, a float feature, an int label."""
    def __init__(self, size=10):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1, 20, (size, 3), generator=g)
        self.value = torch.randn(size, generator=g)
        self.size = size
    def __len__(self):
        return self.size
    def __getitem__(self, i):
        return {"ids": self.ids[i], "value": float(self.value[i]), "label": i % 2}


class Stream(IterableDataset):
    def __init__(self, size=10):
        self.inner = Pairs(size)
    def __iter__(self):
        return (self.inner[i] for i in range(len(self.inner)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.EmbeddingBag(20, 4)
        self.out = nn.Linear(5, 2)
    def forward(self, ids, value):
        return self.out(torch.cat([self.embed(ids), value[:, None].float()], 1))


def loss(model, batch):
    logits = model(batch["ids"], batch["value"])
    losses = F.cross_entropy(logits, batch["label"], reduction="none")
    return losses, {"accuracy": (logits.argmax(1) == batch["label"]).float(),
                    "margin": logits.detach().max(1).values}


def mean_loss(model, batch):  # the mistake: a mean, not per-example losses
    return F.cross_entropy(model(batch["ids"], batch["value"]), batch["label"])


class Branchy(nn.Module):
    """Python control flow on values: the meta device cannot run it."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 10)
    def forward(self, x):
        if x.sum() > 0:
            return self.lin(x)
        return self.lin(-x)


def not_a_dataset():
    return 42


def raising_collate(examples):
    return {"ids": examples[0]["missing"]}


def unsplittable_collate(examples):
    return {"ids": [e["ids"] for e in examples], "name": "batch"}
'''


@pytest.fixture
def user(tmp_path, monkeypatch):
    """A fresh user module in the current folder (tmp_path); its unique name."""
    name = f"user_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    return name


def config_text(user, *, replicas=2, source="Pairs", steps="[{op: batch, size: 4}]",
                loss=None, train="{epochs: 2}", extra=""):
    devices = ", ".join(f"CPU:{i}" for i in range(replicas))
    return f"""
strategy: {{compute_devices: [{devices}]}}
dataset:
  source: {{kind: import, target: "{user}:{source}"}}
  steps: {steps}
{extra}
model: {{kind: import, target: "{user}:Net", loss: "{loss or user + ':loss'}"}}
optimizer: {{name: SGD, lr: 0.5}}
train: {train}
"""


def trained(config):
    session = Session(config, Outputs(), lambda event: None)
    result = run_session(session, False, threading.Event())
    return session, result


def test_cwd_is_importable_and_dtypes_and_nests_are_kept(user):
    config = load_config_text(config_text(user))
    assert os.getcwd() in sys.path
    data = load_source(config.dataset.source)
    pipeline = Pipeline(config.dataset, data, torch.arange(len(data)), 0)
    batch = next(iter(pipeline.loader(0)))
    assert set(batch) == {"ids", "value", "label"}
    assert batch["ids"].dtype == torch.int64 and batch["ids"].shape == (4, 3)
    assert batch["value"].dtype == torch.float64  # as default_collate gives Python floats
    assert batch["label"].dtype == torch.int64


def test_map_style_plan_shuffles_shards_and_resumes_exactly(user):
    steps = "[{op: shuffle, buffer: 10}, {op: shard, num_shards: 2, index: 1}, " \
            "{op: batch, size: 2}, {op: skip, count: 1}]"
    config = load_config_text(config_text(user, steps=steps))
    data = load_source(config.dataset.source)
    pipeline = Pipeline(config.dataset, data, torch.arange(len(data)), 0)
    full = [b["ids"] for b in pipeline.loader(1)]
    plan = list(pipeline.plan(1))
    assert len(full) == len(plan) == 2
    for batch, indices in zip(full, plan):
        assert torch.equal(batch, data.dataset.ids[indices])
    assert torch.equal(next(iter(pipeline.loader(1, skip=1)))["ids"], full[1])


def test_iterable_dataset_streams_the_steps_and_replays_on_resume(user):
    steps = "[{op: skip, count: 1}, {op: batch, size: 3}, {op: take, count: 2}]"
    config = load_config_text(config_text(user, source="Stream", steps=steps,
                                          train="{steps: 5}"))
    data = load_source(config.dataset.source)
    pipeline = Pipeline(config.dataset, data, torch.arange(0), 0)
    batches = [b["ids"] for b in pipeline.loader(0)]
    assert [len(b) for b in batches] == [3, 3]
    assert torch.equal(torch.cat(batches), data.dataset.inner.ids[1:7])
    assert torch.equal(next(iter(pipeline.loader(0, skip=1)))["ids"], batches[1])
    assert pipeline.steps_per_epoch(2) is None


def test_iterable_resume_ends_where_an_uninterrupted_run_ends(user, tmp_path):
    text = config_text(user, source="Stream", train="{steps: 7}") + \
        f"checkpoint: {{dir: {tmp_path / 'ckpt'}, every_steps: 3}}\n"
    _, whole = trained(load_config_text(text))
    stop = threading.Event()
    config = load_config_text(text)
    first = Session(config, Outputs(), lambda e: stop.set() if type(e).__name__ ==
                    "CheckpointSaved" else None)
    assert run_session(first, False, stop).status == "interrupted"
    resumed = run_session(Session(config, Outputs(), lambda e: None), True, threading.Event())
    assert resumed.checkpoint["resumed_from_step"] == 3
    assert resumed.params_sha256 == whole.params_sha256


def test_iterable_dataset_restrictions_are_config_problems(user):
    with pytest.raises(ConfigError) as caught:
        load_config_text(config_text(user, source="Stream", extra="  holdout: 0.2\n"
                                     "  workers: 1"))
    assert {p.path for p in caught.value.problems} >= {"dataset.holdout", "dataset.workers",
                                                        "train.epochs"}


def test_one_two_and_three_replicas_take_the_same_steps_on_a_short_last_batch(user):
    params = []
    for replicas in (1, 2, 3):  # 10 examples, batch 4: the last batch (2) leaves one empty
        session, result = trained(load_config_text(config_text(user, replicas=replicas)))
        assert result.steps == 6
        params.append(torch.cat([p.detach().flatten() for p in session.model.parameters()]))
    torch.testing.assert_close(params[1], params[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(params[2], params[0], rtol=0, atol=1e-6)


def test_loss_function_metrics_are_reported(user):
    text = config_text(user).replace("steps: [", "holdout: 0.3\n  steps: [")
    session, result = trained(load_config_text(text))
    assert result.metrics["train_accuracy"] is not None
    assert "train_margin" in result.metrics and "eval_margin" in result.metrics
    assert result.metrics["loss"] == f"{user}:loss"


def test_a_mean_loss_is_refused_before_training_with_the_fix(user):
    with pytest.raises(ConfigError) as caught:
        load_config_text(config_text(user, loss=f"{user}:mean_loss"))
    problem = caught.value.problems[0]
    assert problem.path == "model.loss"
    assert "shape []" in problem.message and "reduction='none'" in problem.message


def test_a_collate_that_fails_names_its_key_and_the_users_line(user):
    def problem(collate):
        with pytest.raises(ConfigError) as caught:
            load_config_text(config_text(user).replace(
                "  steps:", f'  collate: "{user}:{collate}"\n  steps:'))
        return caught.value.problems[0]

    raised = problem("raising_collate")
    assert raised.path == "dataset.collate"
    assert "KeyError: 'missing'" in raised.message and f"(at {user}.py:" in raised.message
    unsplittable = problem("unsplittable_collate")
    assert unsplittable.path == "dataset.collate"
    assert "first dimension must be the 2 examples" in unsplittable.message


def test_a_factory_that_raises_names_the_users_file_and_line(user):
    with pytest.raises(ConfigError) as caught:
        load_config_text(config_text(user).replace('target: "' + user + ':Pairs"',
                                                   'target: "' + user + ':Pairs", '
                                                   'kwargs: {size: "x"}'))
    problem = caught.value.problems[0]
    assert problem.path == "dataset.source.target"
    assert f"(at {user}.py:" in problem.message


def test_wrong_types_and_missing_targets_are_config_problems(user):
    for target, message in ((f"{user}:not_a_dataset", "returned a int, not a torch"),
                            (f"{user}:Nope", "has no 'Nope'"),
                            ("no_such_pkg_13:make", "cannot import module")):
        with pytest.raises(ConfigError) as caught:
            load_config_text(config_text(user).replace(f"{user}:Pairs", target))
        assert caught.value.problems[0].path == "dataset.source.target"
        assert message in caught.value.problems[0].message


def test_preflight_checks_an_untraceable_model_on_cpu_and_says_so(user):
    text = f"""
strategy: {{compute_devices: [CPU:0]}}
dataset:
  source: {{kind: digits}}
  steps: [{{op: batch, size: 32}}]
model: {{kind: import, target: "{user}:Branchy"}}
train: {{steps: 1}}
"""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        load_config_text(text)
    notes = [str(w.message) for w in seen if issubclass(w.category, ConfigNotice)]
    assert len(notes) == 1 and "checked on CPU with one real batch of 2" in notes[0]
    with pytest.raises(ConfigError) as caught:  # a real fault is still found on CPU
        load_config_text(text.replace("Branchy", "Net"))
    assert caught.value.problems[0].path == "model"


def test_a_file_path_starts_at_the_configs_folder(tmp_path, monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    torch.manual_seed(0)
    import numpy as np
    np.savez(folder / "data.npz", x=np.random.rand(20, 3), y=np.arange(20) % 2)
    (folder / "run.yaml").write_text("""
dataset: {source: {kind: file, path: data.npz}, steps: [{op: batch, size: 4}]}
model: {kind: linear}
train: {steps: 1}
""")
    monkeypatch.chdir(tmp_path)
    from csrun.core.runner.preflight import load_config
    config = load_config("project/run.yaml")
    assert config.dataset.source.path == os.path.join("project", "data.npz")
