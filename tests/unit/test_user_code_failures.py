"""A failure in the user's model or loss names the step (or the evaluation), the replica
and its device, the config key that brought the code in and the user's ``file:line``,
whatever the loss kind; a model that returns a dict or a ModelOutput with a named loss is
pointed to the recipe that fits it."""

from __future__ import annotations

import sys
import uuid

import pytest
import torch

from csrun.core.config.problems import ConfigError
from csrun.core.config.user_code import UserCodeError
from csrun.core.runner.preflight import load_config_text
from csrun.core.runner.train import train

USER_CODE = '''
import torch
import torch.nn.functional as F

CALLS = {"n": 0}


class Fails(torch.nn.Module):
    """Raises on its call number ``at`` (counting every replica's calls)."""
    def __init__(self, at=9):
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)
        self.at = at
    def forward(self, x):
        CALLS["n"] += 1
        if CALLS["n"] == self.at:
            raise ValueError("the user's bug")
        return self.lin(x)


class DictOut(torch.nn.Module):
    """A Hugging Face style model: a dict of outputs (a tensor for preflight's batch of 2)."""
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 3)
    def forward(self, x):
        logits = self.lin(x)
        return logits if len(x) <= 2 else {"logits": logits}


def loss(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")
'''

RAISES = next(n for n, line in enumerate(USER_CODE.splitlines(), 1) if "raise" in line)

TEXT = """\
strategy: {compute_devices: [CPU:0, CPU:1]}
dataset:
  source: {kind: synthetic, examples: 96, features: 6, classes: 3}
  holdout: 0.25
  steps: [{op: batch, size: 12}]
model: {kind: import, target: "USER:Fails", kwargs: {at: AT}}
train: {steps: 6}
"""


@pytest.fixture
def user(tmp_path, monkeypatch):
    name = f"user_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    return name


def failure(user, at: int, *overrides) -> UserCodeError:
    config = load_config_text(TEXT.replace("USER", user).replace("AT", str(at)), None,
                              list(overrides))
    sys.modules[user].CALLS["n"] = 0  # preflight ran the model once
    with pytest.raises(UserCodeError) as caught:
        train(config)
    return caught.value


@pytest.mark.parametrize("loss, blamed", [
    ("cross_entropy", "model.target: {user}:Fails (loss cross_entropy) failed"),
    ("{user}:loss", "model.loss: {user}:loss failed")])
def test_a_training_failure_names_the_step_replica_code_and_line(user, loss, blamed):
    # 2 replicas call the model twice a step: call 9 is step 5's, on either replica
    error = failure(user, 9, f"model.loss={loss.format(user=user)}")
    text = str(error)
    assert text.startswith("step 5, replica "), text
    replica = int(text.split("replica ")[1].split(" ")[0])
    assert f"replica {replica} (CPU:{replica}): " + blamed.format(user=user) in text
    assert text.endswith(f"ValueError: the user's bug (at {user}.py:{RAISES})"), text
    assert isinstance(error.__cause__, ValueError)


def test_an_evaluation_failure_names_the_evaluation(user):
    error = failure(user, 13, "train.steps=6")  # 12 calls train, the 13th evaluates
    assert str(error).startswith("the evaluation after step 6, replica "), str(error)
    assert str(error).endswith(f"(at {user}.py:{RAISES})")


def test_one_replica_names_its_device_too(user):
    error = failure(user, 4, "strategy.compute_devices=[CPU:0]")
    assert str(error).startswith("step 4, replica 0 (CPU:0): model.target: "), str(error)


def test_a_dict_output_with_a_named_loss_points_to_the_loss_function_recipe(user):
    text = TEXT.replace("USER", user).replace(", kwargs: {at: AT}", "").replace(
        "Fails", "DictOut")
    with pytest.raises(UserCodeError) as caught:
        train(load_config_text(text, None))  # preflight's batch of 2 got a tensor
    assert "cross_entropy needs the model's output as a tensor" in str(caught.value)
    assert f"{user}:DictOut returned a dict" in str(caught.value)
    assert "docs/own-training.md" in caught.value.hint


def test_preflight_refuses_a_dict_output_with_the_recipe(user, monkeypatch):
    monkeypatch.setattr(torch.nn.Linear, "forward",
                        lambda self, x: {"logits": x @ self.weight.T})
    with pytest.raises(ConfigError) as caught:
        load_config_text(TEXT.replace("USER", user).replace("AT", "0"), None)
    (problem,) = caught.value.problems
    assert problem.path == "model.loss" and "returned a dict" in problem.message
    assert "A model that returns a mean loss" in problem.hint


def test_a_ps_that_fails_inside_the_users_loss_is_the_clusters_failure_not_the_loss():
    # issue 39: a dead ps was reported as "model.loss: embpkg.emb:loss failed:
    # ParameterServerError: ... (at embpkg/emb.py:34)"
    from csrun.core.cluster.transport import ParameterServerError
    from csrun.core.runner.objectives import LossFunction

    def lookup_fails(model, batch):
        raise ParameterServerError("parameter server ps:0 (127.0.0.1:1) stopped answering")
    loss = LossFunction("builtins:len")
    loss._fn = lookup_fails
    with pytest.raises(ParameterServerError, match="stopped answering"):
        loss.stats(torch.nn.Linear(2, 2), (torch.zeros(3, 2), torch.zeros(3)))
