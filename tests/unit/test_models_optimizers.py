"""Built-in models, imported models, losses, optimizers and schedules by name."""

import pytest
import torch

from csrun.core.config.schema import OptimizerConfig
from csrun.core.runner.models import build_model, check_model, make_loss
from csrun.core.runner.optimizers import build_optimizer
from csrun.core.runner.preflight.optimizer import check_optimizer
from csrun.core.config.problems import ConfigError
from pydantic import TypeAdapter

from csrun.core.config.schema import ModelConfig

MODEL = TypeAdapter(ModelConfig)


def model(**fields):
    return MODEL.validate_python(fields)


@pytest.mark.parametrize("fields, shape", [
    ({"kind": "linear"}, (64,)),
    ({"kind": "mlp", "hidden": [8, 4], "dropout": 0.1}, (64,)),
    ({"kind": "cnn", "channels": [4, 8], "batch_norm": True}, (1, 8, 8)),
    ({"kind": "cnn"}, (8, 8)),
])
def test_builtins_fit_their_inputs(fields, shape):
    torch.manual_seed(0)
    net = build_model(model(**fields), shape, 10)
    assert net(torch.rand(3, *shape)).shape == (3, 10)


def test_cnn_needs_images():
    with pytest.raises(ConfigError) as info:
        build_model(model(kind="cnn"), (64,), 10)
    assert "layout: image" in info.value.problems[0].hint


def test_imported_model_and_its_errors():
    net = build_model(model(kind="import", target="torch.nn:Linear",
                            kwargs={"in_features": 4, "out_features": 2}), (4,), 2)
    assert isinstance(net, torch.nn.Linear)
    with pytest.raises(ConfigError) as info:
        build_model(model(kind="import", target="torch.nn:Linear", kwargs={"in": 4}), (4,), 2)
    assert info.value.problems[0].path == "model.kwargs"
    with pytest.raises(ConfigError) as info:
        build_model(model(kind="import", target="no_such_module_xyz:Net"), (4,), 2)
    assert "cannot import" in info.value.problems[0].message


def test_check_model_catches_loss_and_shape_mismatches():
    assert check_model(model(kind="mlp"), (64,), 10, "classification") == []
    assert check_model(model(kind="linear", loss="mse"), (3,), 4, "classification")[0].path \
        == "model.loss"
    problems = check_model(model(kind="import", target="torch.nn:Identity"), (3,), 2,
                           "regression")
    assert "outputs [2, 3]" in problems[0].message


def test_losses_are_sums_over_examples():
    out, y = torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0], [0.0]])
    assert make_loss("mse")(out, y).item() == 10.0
    assert make_loss("l1")(out, y).item() == 4.0


def test_optimizers_by_name():
    param = torch.zeros(1, requires_grad=True)
    opt = build_optimizer(OptimizerConfig(name="AdamW", lr=0.1, kwargs={"weight_decay": 0.5}),
                          [param])
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["weight_decay"] == 0.5
    problems = check_optimizer(OptimizerConfig(name="SDG"))
    assert problems[0].path == "optimizer.name" and problems[0].hint == "did you mean 'SGD'?"
    problems = check_optimizer(OptimizerConfig(name="SGD", kwargs={"momentun": 0.9}))
    assert problems[0].path == "optimizer.kwargs" and "momentum" in problems[0].hint
    problems = check_optimizer(OptimizerConfig.model_validate(
        {"schedule": {"name": "CosineAnealingLR", "kwargs": {"T_max": 3}}}))
    assert problems[0].hint == "did you mean 'CosineAnnealingLR'?"
