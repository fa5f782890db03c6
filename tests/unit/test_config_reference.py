"""docs/config.md is generated from the config models; it must be current and complete."""

import typing
from pathlib import Path

from pydantic import BaseModel

from csrun.core.config import schema as config_module
from csrun.core.config.reference import render_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_docs_config_md_is_current():
    assert DOC.read_text(encoding="utf-8") == render_reference(), (
        "docs/config.md is stale: run `python -m csrun.core.config.reference docs/config.md`")


def _models():
    return [obj for obj in vars(config_module).values()
            if isinstance(obj, type) and issubclass(obj, BaseModel)
            and obj.__module__ == config_module.__name__ and obj.__name__ != "_Section"]


def test_every_model_and_field_is_documented():
    models = _models()
    assert len(models) > 15
    for model in models:
        assert model.__doc__, f"{model.__name__} has no docstring"
        # a parameter group's other keys are the optimizer's options (checked against
        # the optimizer's defaults when it is built): the one open model
        extra = "allow" if model is config_module.ParamGroupConfig else "forbid"
        assert model.model_config.get("extra") == extra, model.__name__
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"


def test_every_field_appears_in_the_reference():
    text = render_reference()
    for name in config_module.RunConfig.model_fields:
        assert f"## `{name}`" in text
    for model in _models():
        if model is config_module.RunConfig:
            continue
        for name in model.model_fields:
            assert f"| `{name}` |" in text, f"{model.__name__}.{name} missing from config.md"
    assert "override > file > default" in text
    assert all(f"`{name}`" in text for name in config_module.LOSS_NAMES)


def test_an_option_is_not_taken_for_the_output_path(tmp_path, monkeypatch, capsys):
    from csrun.core.config.reference import main

    monkeypatch.chdir(tmp_path)
    assert main(["--help"]) == 0
    assert main(["-x"]) == 2
    assert main(["a.md", "b.md"]) == 2
    assert list(tmp_path.iterdir()) == []
    assert "usage:" in capsys.readouterr().out
