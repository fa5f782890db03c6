"""Parameter groups by name, an optimizer class of your own, schedule chains; and where
the paths of a config start."""

import os
import pathlib

import pytest
import torch

from csrun.core.config.problems import ConfigError
from csrun.core.config.schema import OptimizerConfig
from csrun.core.runner.optimizers import build_optimizer
from csrun.core.runner.preflight import load_config, load_config_text
from csrun.core.runner.schedules import build_schedule
from tests.helpers.tiny_config import tiny_config

# the tests set the optimizer section; all of a 20-example data file is for training
TINY = tiny_config("~optimizer", "~dataset.holdout")


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 2, bias=False)


def optimizer_config(**fields):
    return OptimizerConfig.model_validate(fields)


def problems(*overrides, text=TINY):
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, None, list(overrides))
    return {p.path: p for p in caught.value.problems}


def test_biases_and_norm_weights_get_no_weight_decay():
    model = Block()
    config = optimizer_config(name="AdamW", kwargs={"weight_decay": 0.1},
                              param_groups=[{"match": "bias|norm", "weight_decay": 0.0}])
    optimizer = build_optimizer(config, model.named_parameters())
    decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    named = dict(model.named_parameters())
    assert {n for n, p in named.items() if decay[id(p)] == 0.0} == \
        {"proj.bias", "norm.weight", "norm.bias"}
    assert {n for n, p in named.items() if decay[id(p)] == 0.1} == {"proj.weight",
                                                                   "head.weight"}


def test_first_matching_group_wins():
    config = optimizer_config(lr=0.1, param_groups=[{"match": "norm", "lr": 0.01},
                                                    {"match": "weight", "lr": 0.5}])
    optimizer = build_optimizer(config, Block().named_parameters())
    sizes = [(len(g["params"]), g["lr"]) for g in optimizer.param_groups]
    assert sizes == [(1, 0.1), (2, 0.01), (2, 0.5)]  # default: proj.bias


def test_bad_groups_are_config_problems():
    found = problems("optimizer.param_groups=[{match: 'bias(', weight_decay: 0}]")
    assert "regular expression" in found["optimizer.param_groups.0.match"].message
    found = problems("optimizer.param_groups=[{match: bias, weight_decy: 0}]")
    assert "weight_decay" in found["optimizer.param_groups.0.weight_decy"].hint


def test_optimizer_target_outside_torch_optim(tmp_path, monkeypatch):
    (tmp_path / "myopt.py").write_text(
        "import torch\nclass Halving(torch.optim.SGD):\n    pass\n")
    monkeypatch.chdir(tmp_path)
    config = load_config_text(TINY, None, ["optimizer.target=myopt:Halving"])
    optimizer = build_optimizer(config.optimizer, torch.nn.Linear(2, 2).named_parameters())
    assert type(optimizer).__name__ == "Halving"
    assert "not both" in problems("optimizer.target=myopt:Halving", "optimizer.name=Adam")[
        "optimizer.target"].message
    assert "optimizer.target" in problems("optimizer.target=nomodule:Nope")


def test_warmup_then_cosine_chain():
    param = torch.zeros(1, requires_grad=True)
    config = optimizer_config(lr=1.0, schedule=[
        {"name": "LinearLR", "kwargs": {"start_factor": 0.25, "total_iters": 3}, "steps": 3},
        {"name": "CosineAnnealingLR", "kwargs": {"T_max": 4}}])
    optimizer = build_optimizer(config, [param])
    schedule = build_schedule(config.schedule, optimizer)
    lrs = []
    for _ in range(7):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs[:3] == pytest.approx([0.25, 0.5, 0.75])  # warmup
    assert lrs[3] == pytest.approx(1.0) and lrs[3] > lrs[4] > lrs[5] > lrs[6]  # cosine


def test_single_schedule_still_works_and_chains_are_checked():
    config = load_config_text(TINY, None, ["optimizer.schedule={name: StepLR, "
                                           "kwargs: {step_size: 1}}"])
    schedule = build_schedule(config.optimizer.schedule,
                              build_optimizer(config.optimizer, [torch.zeros(1,
                                                                            requires_grad=True)]))
    assert type(schedule).__name__ == "StepLR"
    found = problems("optimizer.schedule=[{name: LinearLR}, {name: CosineAnnealingLR, "
                     "kwargs: {T_max: 3}}]")
    assert "optimizer.schedule.0.steps" in found


# -- paths -------------------------------------------------------------------------------
def test_paths_in_the_file_start_at_its_folder_overrides_at_the_current_one(tmp_path,
                                                                          monkeypatch):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "run.yaml").write_text(TINY + "checkpoint: {dir: runs/ckpt}\n")
    monkeypatch.chdir(tmp_path)
    written = load_config("project/run.yaml")
    assert written.checkpoint.dir == os.path.join("project", "runs", "ckpt")
    overridden = load_config("project/run.yaml", ["checkpoint.dir=here/ckpt"])
    assert overridden.checkpoint.dir == "here/ckpt"
    absolute = str(pathlib.Path(tmp_path, "abs"))
    assert load_config("project/run.yaml", [f"checkpoint.dir={absolute}"]).checkpoint.dir \
        == absolute


def test_a_data_file_given_as_an_override_starts_at_the_current_folder(tmp_path,
                                                                      monkeypatch):
    import numpy as np
    (tmp_path / "project").mkdir()
    np.savez(tmp_path / "data.npz", x=np.random.rand(20, 3), y=np.arange(20) % 2)
    (tmp_path / "project" / "run.yaml").write_text(TINY)
    monkeypatch.chdir(tmp_path)
    config = load_config("project/run.yaml", ["dataset.source={kind: file, path: data.npz}"])
    assert config.dataset.source.path == "data.npz"


class Tables(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.users = torch.nn.Embedding(10, 4, sparse=True)
        self.bags = torch.nn.ModuleDict({"item": torch.nn.EmbeddingBag(12, 4)})
        self.head = torch.nn.Linear(8, 1)


def test_the_tables_get_their_own_optimizer_and_the_rest_this_one():
    from csrun.core import CombinedOptimizer
    from csrun.core.runner.optimizers import table_parameters
    model = Tables()
    config = optimizer_config(name="AdamW", lr=0.001, tables={"name": "SparseAdam",
                                                              "lr": 0.05})
    optimizer = build_optimizer(config, model.named_parameters(), table_parameters(model))
    assert isinstance(optimizer, CombinedOptimizer)
    dense, tables = optimizer.optimizers
    assert type(dense) is torch.optim.AdamW and type(tables) is torch.optim.SparseAdam
    assert tables.param_groups[0]["params"] == [model.users.weight, model.bags.item.weight]
    assert dense.param_groups[0]["params"] == list(model.head.parameters())
    assert [g["lr"] for g in optimizer.param_groups] == [0.001, 0.05]
    schedule = build_schedule(optimizer_config(schedule={"name": "StepLR", "kwargs": {
        "step_size": 1, "gamma": 0.5}}).schedule, optimizer)
    optimizer.step()
    schedule.step()  # one schedule scales both, as in TorchRec
    assert [g["lr"] for g in tables.param_groups + dense.param_groups] == [0.025, 0.0005]


def test_tables_without_a_table_in_the_model_are_a_config_problem():
    with pytest.raises(ConfigError) as caught:
        build_optimizer(optimizer_config(tables={"name": "Adagrad"}),
                        Block().named_parameters(), set())
    assert [p.path for p in caught.value.problems] == ["optimizer.tables"]
