"""Sparse gradients in a parameter-server job: not pushed yet, so refused loudly, before
anything runs from a config and at the step from the library (the transport failed with
``reshape is not implemented for sparse tensors`` at the first ``optimizer.step()``)."""

from __future__ import annotations

import sys
import textwrap
import types

import pytest
import torch
from torch import nn

from csrun.core.cluster.parameter_server_strategy import RemoteParameterStore
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


def test_a_ps_config_with_a_sparse_embedding_is_refused_naming_it(tagger):
    with pytest.raises(ConfigError) as caught:
        load_config_text(CONFIG.format(kind="parameter_server", sparse="true"), "c.yaml",
                         environ=TF_CONFIG)
    (problem,) = [p for p in caught.value.problems if p.path == "model.kwargs"]
    assert "table make sparse gradients" in problem.message
    assert "sparse=False" in problem.hint and "central_storage" in problem.hint


@pytest.mark.parametrize("kind, sparse", [("parameter_server", "false"),
                                          ("central_storage", "true")])
def test_dense_tables_in_ps_and_sparse_ones_in_central_storage_pass(tagger, kind, sparse):
    config = load_config_text(CONFIG.format(kind=kind, sparse=sparse), "c.yaml",
                              environ=TF_CONFIG)
    assert config.model.kwargs == {"sparse": sparse == "true"}


def test_the_library_refuses_to_push_a_sparse_gradient():
    store = RemoteParameterStore.__new__(RemoteParameterStore)
    table = nn.Embedding(8, 2, sparse=True)
    table(torch.tensor([1, 3])).sum().backward()
    assert table.weight.grad.is_sparse
    pushed = []
    store.flush_pending = lambda: None
    store.ensure_optimizer = lambda optimizer: None
    store.owns = lambda tensor: True
    store._ids, store._owner = {table.weight: 0}, [0]
    store.client = types.SimpleNamespace(num_ps=1, push_pull=lambda *a: pushed.append(a))
    with pytest.raises(RuntimeError, match=r"variable 0 \(shape \(8, 2\)\) has a sparse "
                                           r"gradient .* sparse=False"):
        store.before_optimizer_step(torch.optim.SGD(table.parameters(), lr=0.1))
    assert pushed == []
