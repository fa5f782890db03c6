"""Config loading: precedence, overrides, and errors that say what, where and how to fix."""

import textwrap
import tracemalloc

import pytest

from csrun.core.config.overrides import parse_override
from csrun.core.config.schema import RunConfig
from csrun.core.runner.preflight import load_config, load_config_text
from csrun.core.config.problems import ConfigError, did_you_mean

BASE = textwrap.dedent("""\
    strategy:
      compute_devices: [CPU:0, CPU:1]
    dataset:
      source: {kind: range, stop: 64}
      steps:
        - {op: batch, size: 8}
    model:
      kind: linear
    train:
      steps: 4
    """)


def load(text=BASE, overrides=()):
    return load_config_text(text, "c.yaml", overrides)


def problems(text=BASE, overrides=()):
    with pytest.raises(ConfigError) as info:
        load(text, overrides)
    return info.value.problems


def test_defaults_fill_what_the_file_omits():
    config = load()
    assert isinstance(config, RunConfig)
    assert config.optimizer.name == "SGD" and config.optimizer.lr == 0.01
    assert config.train.seed == 0 and config.train.log_every == 50
    assert config.checkpoint.dir is None
    assert config.strategy.parameter_device is None


def test_override_beats_file_beats_default():
    config = load(BASE + "optimizer: {lr: 0.5}\n",
                  ["optimizer.lr=0.25", "train.seed=7", "dataset.steps.0.size=16"])
    assert config.optimizer.lr == 0.25  # override > file
    assert config.train.seed == 7  # override > default
    assert config.dataset.steps[0].size == 16  # list index in a dotted path
    assert load(BASE + "optimizer: {lr: 0.5}\n").optimizer.lr == 0.5  # file > default


def test_override_values_are_yaml():
    config = load(overrides=["strategy.compute_devices=[CPU:2, CPU:3]",
                             "dataset.steps.1={op: prefetch, buffer: 3}",
                             "checkpoint.dir=runs/x"])
    assert config.strategy.compute_devices == ["CPU:2", "CPU:3"]
    assert config.dataset.steps[1].op == "prefetch"  # index == length appends
    assert config.checkpoint.dir == "runs/x"  # a section the file lacks


def test_parse_override_rejects_malformed():
    assert parse_override("a.b.0=x") == (("a", "b", 0), "x")
    for bad in ("noequals", "=3", "a..b=1"):
        with pytest.raises(ConfigError) as info:
            parse_override(bad)
        assert "key=value" in str(info.value)


def test_every_problem_at_once_with_file_line_and_hint():
    text = BASE.replace("kind: linear", "kind: linaer").replace("steps: 4", "stesp: 4")
    text += "optimizer: {name: Adma}\ntrian: {}\n"
    found = {p.path: p for p in problems(text, ["checkpoint.keep=0"])}
    assert set(found) == {"model.kind", "train.stesp", "optimizer.name", "trian",
                          "checkpoint.keep"}
    assert found["model.kind"].line == 8 and found["model.kind"].file == "c.yaml"
    assert found["model.kind"].hint == "did you mean 'linear'?"
    assert found["train.stesp"].hint == "did you mean 'steps'?"
    assert found["train.stesp"].line == 10
    assert found["optimizer.name"].hint == "did you mean 'Adam'?"
    assert found["trian"].hint == "did you mean 'train'?"
    assert found["checkpoint.keep"].origin == "override 'checkpoint.keep=0'"
    # a section-level check that the misspelt key explains is not reported again
    bare = problems(BASE.replace("steps: 4", "epochs: null"))
    assert "exactly one of steps and epochs" in bare[0].message


def test_missing_device_lists_the_available_ones(big_cpu_index):
    found = problems(overrides=[f"strategy.compute_devices=[CPU:0, CPU:{big_cpu_index}]"])
    assert [p.path for p in found] == ["strategy.compute_devices.1"]
    assert "does not exist" in found[0].message
    assert found[0].hint.startswith("available: CPU:0..")


def test_repeated_device_and_missing_gpu():
    found = problems(overrides=["strategy.compute_devices=[CPU:1, cpu:1]"])
    assert "repeats" in found[0].message
    import torch
    if not torch.cuda.is_available():
        found = problems(overrides=["strategy.parameter_device=GPU:0"])
        assert found[0].path == "strategy.parameter_device"
        assert "no GPU" in found[0].hint


def test_required_sections_and_fields():
    found = {p.path: p for p in problems("train: {steps: 1}\n")}
    assert set(found) == {"dataset", "model"}
    assert "missing" in found["dataset"].message
    found = {p.path for p in problems(BASE.replace("stop: 64", "start: 1"))}
    assert found == {"dataset.source.stop"}


def test_pipeline_problems():
    no_batch = BASE.replace("- {op: batch, size: 8}", "- {op: repeat, count: 2}")
    assert [p.path for p in problems(no_batch)] == ["dataset.steps"]
    forever = BASE.replace("steps: 4", "epochs: 1").replace(
        "- {op: batch, size: 8}", "- {op: batch, size: 8}\n    - {op: repeat}")
    assert [p.path for p in problems(forever)] == ["train.epochs"]
    found = problems(overrides=["dataset.distribute=per_replica", "dataset.steps.0.size=7"])
    assert found[0].path == "dataset.steps.0.size" and "divide" in found[0].message
    assert "multiple of 2" in found[0].hint
    empty = problems(overrides=["dataset.steps.0.size=100", "dataset.steps.0.drop_remainder=true"])
    assert "no full step" in empty[0].message


def test_model_must_fit_the_data():
    found = problems(overrides=["model={kind: cnn}"])
    assert found[0].path == "model.kind" and "image" in found[0].message
    found = problems(overrides=["model.loss=cross_entropy"])
    assert found[0].path == "model.loss"
    found = problems(overrides=["model={kind: import, target: torch.nn:Lineer}"])
    assert found[0].hint == "did you mean 'Linear'?"
    found = problems(overrides=["model={kind: import, target: torch.nn:Linear, "
                                "kwargs: {in_features: 1, out_features: 3}}"])
    assert "outputs [2, 3]" in found[0].message


def test_optimizer_and_schedule_arguments_are_checked():
    found = {p.path: p for p in problems(overrides=[
        "optimizer.kwargs={momentum: -1}",
        "optimizer.schedule={name: StepLR, kwargs: {step: 3}}"])}
    assert "momentum" in found["optimizer.kwargs"].message
    assert "step_size" in found["optimizer.schedule.kwargs"].hint


def test_yaml_is_read_safely():
    found = problems("model: !!python/object/apply:os.system ['echo hi']\n")
    assert "plain YAML" in found[0].hint
    found = problems("a: 1\na: 2\n")
    assert found[0].path == "a" and found[0].line == 2 and "duplicate" in found[0].message
    found = problems("train:\n  steps: [1,\n")
    assert found[0].line is not None and "invalid YAML" in found[0].message
    assert "mapping of sections" in problems("- 1\n- 2\n")[0].message


@pytest.mark.timeout(60)
def test_alias_bomb_is_rejected_before_it_expands():
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for name, prev in zip("bcdefghij", "abcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    tracemalloc.start()
    try:
        found = problems("\n".join(lines) + "\n")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # 9**10 values would take tens of GB; the loader stops at its limit (~14 MiB here)
    assert peak < 64 * 2**20, f"{peak / 2**20:.0f} MiB"
    assert "alias" in found[0].message


def test_missing_file_suggests_a_sibling(tmp_path):
    (tmp_path / "quickstart.yaml").write_text(BASE)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "quickstrat.yaml")
    assert info.value.problems[0].hint == "did you mean 'quickstart.yaml'?"
    assert load_config(tmp_path / "quickstart.yaml").train.steps == 4


def test_missing_file_suggests_a_sibling_whose_name_has_a_quote(tmp_path):
    # regression: the name was cut back out of did_you_mean's message, and an apostrophe
    # made repr() switch quotes: a KeyError instead of the hint
    (tmp_path / "bob's.yaml").write_text(BASE)
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "bobs.yaml")
    assert info.value.problems[0].hint == 'did you mean "bob\'s.yaml"?'


def test_did_you_mean():
    assert did_you_mean("Adma", ["Adam", "Adamax", "SGD"]) == "did you mean 'Adam'?"
    assert did_you_mean("sgd", ["SGD", "ASGD"]) == "did you mean 'SGD'?"
    assert did_you_mean("zzzz", ["SGD"]) is None


@pytest.mark.parametrize("override, steps, epochs", [("train.steps=50", 50, None),
                                                     ("train.epochs=2", None, 2)])
def test_an_override_replaces_its_exclusive_partner_from_the_file(override, steps, epochs,
                                                                  tmp_path):
    """override > file: train.steps=50 over a file that sets epochs was refused as
    "both are set"."""
    from csrun.core.runner.preflight import load_config
    path = tmp_path / "c.yaml"
    other = "epochs: 3" if steps else "steps: 7"
    path.write_text(f"""\
strategy: {{compute_devices: [CPU:0]}}
dataset:
  source: {{kind: synthetic, examples: 64, features: 4, classes: 3}}
  steps: [{{op: batch, size: 16}}]
model: {{kind: mlp, hidden: [8]}}
optimizer: {{name: SGD, lr: 0.1}}
train: {{{other}}}
""")
    train = load_config(path, [override]).train
    assert (train.steps, train.epochs) == (steps, epochs)
    with pytest.raises(ConfigError, match="both are set"):  # both overridden: refused
        load_config(path, ["train.steps=5", "train.epochs=1"])


def test_a_batch_larger_than_a_pass_is_a_problem():
    """It ran silently, every step on all 72 examples under a 'global batch 128' header."""
    text = """\
strategy: {compute_devices: [CPU:0]}
dataset:
  source: {kind: synthetic, examples: 96, features: 4, classes: 3}
  holdout: 0.25
  steps: [{op: shuffle, buffer: 8}, {op: batch, size: 128}]
model: {kind: mlp, hidden: [8]}
optimizer: {name: SGD, lr: 0.1}
train: {steps: 5}
"""
    with pytest.raises(ConfigError) as info:
        load_config_text(text, "c.yaml")
    [problem] = info.value.problems
    assert problem.path == "dataset.steps.1.size" and problem.line == 5
    assert "larger than the 72 examples a pass yields" in problem.message
    # repeated before batching, the batches are full: fine
    load_config_text(text.replace("{op: batch", "{op: repeat, count: 2}, {op: batch"))
