"""Sparse gradients in a parameter-server job are applied on the ps tasks with the
optimizer's sparse update: an optimizer without one is refused before anything runs,
from a config (exit 2, naming the parameter) and from the library."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

from csrun.core.cluster.embedding_lookup import SPARSE_OPTIMIZERS
from csrun.core.cluster.remote_store import check_sparse_support
from csrun.core.config.problems import ConfigError
from csrun.core.runner.preflight import load_config_text

MODEL = """\
import torch
from torch import nn


class Tagger(nn.Module):
    def __init__(self, sparse=True):
        super().__init__()
        self.table = nn.Embedding(16, 3, sparse=sparse)

    def forward(self, x):
        return self.table((x.abs() * 4).long().clamp(max=15)).mean(1)
"""

CONFIG = """\
strategy:
  kind: {kind}
dataset:
  source: {{kind: synthetic, examples: 32, features: 4, classes: 3}}
  steps:
    - {{op: batch, size: 8}}
model: {{kind: import, target: "sparse_tagger:Tagger", kwargs: {{sparse: {sparse}}}}}
optimizer: {{name: SGD, lr: 0.1}}
train: {{steps: 2}}
"""


@pytest.fixture
def tagger(tmp_path, monkeypatch):
    (tmp_path / "sparse_tagger.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("sparse_tagger", None)


TF_CONFIG = {"TF_CONFIG": '{"cluster": {"worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}, '
                          '"task": {"type": "worker", "index": 0}}'}


def test_a_ps_config_whose_optimizer_cannot_apply_sparse_gradients_is_refused(tagger):
    text = CONFIG.format(kind="parameter_server", sparse="true").replace("SGD", "Adam")
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, "c.yaml", environ=TF_CONFIG)
    (problem,) = [p for p in caught.value.problems if p.path == "optimizer.name"]
    assert "table.weight get sparse gradients" in problem.message
    assert "Adam" in problem.message
    assert "SGD, Adagrad, SparseAdam" in problem.hint and "sparse=False" in problem.hint


@pytest.mark.parametrize("setting, path", [
    ("kwargs: {weight_decay: 0.1}", "optimizer.kwargs"),
    ("param_groups: [{match: table, weight_decay: 0.1}]", "optimizer.param_groups"),
])
def test_a_setting_without_a_sparse_update_is_refused_naming_where(tagger, setting, path):
    text = CONFIG.format(kind="parameter_server", sparse="true").replace(
        "{name: SGD, lr: 0.1}", "{name: Adagrad, lr: 0.1, " + setting + "}")
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, "c.yaml", environ=TF_CONFIG)
    (problem,) = [p for p in caught.value.problems if p.path == path]
    assert "Adagrad with these settings cannot apply on the ps tasks" in problem.message


@pytest.mark.parametrize("kind, sparse", [("parameter_server", "false"),
                                          ("parameter_server", "true"),
                                          ("central_storage", "true")])
def test_sparse_tables_with_a_sparse_optimizer_pass(tagger, kind, sparse):
    config = load_config_text(CONFIG.format(kind=kind, sparse=sparse), "c.yaml",
                              environ=TF_CONFIG)
    assert config.model.kwargs == {"sparse": sparse == "true"}


def test_the_library_refuses_an_optimizer_without_a_sparse_update_before_any_push():
    table = nn.Embedding(8, 2, sparse=True)
    with pytest.raises(ValueError, match=r"Embedding.weight get sparse gradients .* Adam "
                                         r"with these settings cannot apply \(Adam does not "
                                         r"support sparse .*; use one of SGD, Adagrad, "
                                         r"SparseAdam"):
        check_sparse_support(torch.optim.Adam(table.parameters()), ["Embedding.weight"])
    with pytest.raises(ValueError, match=r"Adagrad with these settings cannot apply"):
        check_sparse_support(torch.optim.Adagrad(table.parameters(), weight_decay=0.1),
                             ["Embedding.weight"])
    check_sparse_support(torch.optim.Adagrad(table.parameters()), ["Embedding.weight"])


def _sparse_step(cls) -> bool:
    weight = nn.Parameter(torch.ones(6, 2))
    weight.grad = torch.sparse_coo_tensor(torch.tensor([[1, 4]]), torch.ones(2, 2), (6, 2))
    try:
        cls([weight], lr=0.1).step()
    except RuntimeError:
        return False
    return not torch.equal(weight.detach()[1], torch.ones(2))


def test_the_list_of_sparse_optimizers_is_torchs():
    """SPARSE_OPTIMIZERS is what torch applies sparse gradients with (a torch release
    that changes this fails here, naming the optimizer)."""
    optimizers = [c for c in vars(torch.optim).values() if isinstance(c, type)
                  and issubclass(c, torch.optim.Optimizer) and c is not torch.optim.Optimizer
                  and c.__name__ != "LBFGS"]  # LBFGS steps through a closure
    applies = sorted(c.__name__ for c in optimizers if _sparse_step(c))
    assert applies == sorted(SPARSE_OPTIMIZERS)


def test_the_tables_own_optimizer_is_checked_for_sparse_gradients_not_the_dense_one(tagger):
    """optimizer.tables trains the tables: AdamW beside SparseAdam passes; Adam for the
    tables is refused naming optimizer.tables.name."""
    text = CONFIG.format(kind="parameter_server", sparse="true").replace(
        "{name: SGD, lr: 0.1}", "{name: AdamW, lr: 0.1, tables: {name: SparseAdam}}")
    assert load_config_text(text, "c.yaml", environ=TF_CONFIG).optimizer.tables.name == \
        "SparseAdam"
    with pytest.raises(ConfigError) as caught:
        load_config_text(text.replace("SparseAdam", "Adam"), "c.yaml", environ=TF_CONFIG)
    (problem,) = [p for p in caught.value.problems if p.path == "optimizer.tables.name"]
    assert "table.weight get sparse gradients" in problem.message


def test_a_tables_optimizer_the_class_refuses_is_a_config_problem(tagger):
    text = CONFIG.format(kind="central_storage", sparse="true").replace(
        "{name: SGD, lr: 0.1}", "{name: AdamW, lr: 0.1, tables: {name: SparsAdam}}")
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, "c.yaml")
    (problem,) = [p for p in caught.value.problems if p.path == "optimizer.tables.name"]
    assert "SparseAdam" in problem.hint
    with pytest.raises(ConfigError) as caught:
        load_config_text(text.replace("SparsAdam}", "SparseAdam, kwargs: {momentum: 0.9}}"),
                         "c.yaml")
    assert [p.path for p in caught.value.problems] == ["optimizer.tables.kwargs"]


def test_sparse_adam_for_tables_built_dense_is_refused_before_training(tagger):
    text = CONFIG.format(kind="central_storage", sparse="false").replace(
        "{name: SGD, lr: 0.1}", "{name: AdamW, lr: 0.1, tables: {name: SparseAdam}}")
    with pytest.raises(ConfigError) as caught:
        load_config_text(text, "c.yaml")
    (problem,) = [p for p in caught.value.problems if p.path == "optimizer.tables.name"]
    assert "table.weight get dense ones (built with sparse=False)" in problem.message
    load_config_text(text.replace("SparseAdam", "Adagrad"), "c.yaml")
