"""The csrun CLI through Typer's CliRunner: exit codes, output, --json."""

import json

import pytest
import typer

from csrun.cli.main import app


def test_version_and_help(cli):
    assert cli("--version").stdout.startswith("csrun ")
    result = cli("--help")
    assert result.exit_code == 0
    for command in ("train", "validate", "inspect-devices", "launch"):
        assert command in result.stdout


def test_validate_ok(cli, tiny):
    result = cli("validate", tiny, "train.steps=3")
    assert result.exit_code == 0
    assert "is valid" in result.stdout and "CPU:0, CPU:1" in result.stdout


def test_validate_reports_every_problem_with_location_and_hint(cli, tiny):
    tiny.write_text(tiny.read_text().replace("kind: mlp", "kind: mpl")
                    .replace("steps: 6", "stesp: 6"))
    result = cli("validate", tiny, "optimizer.lr=-1")
    assert result.exit_code == 2
    assert result.stdout == ""
    err = result.stderr
    assert "3 problems" in err and "Traceback" not in err
    line = 1 + [n.split(":")[0] for n in tiny.read_text().splitlines()].index("model")
    assert f"{tiny}:{line}: model.kind: unknown kind 'mpl'" in err
    assert "hint: did you mean 'mlp'?" in err
    assert "train.stesp: unknown key" in err and "did you mean 'steps'?" in err
    assert "override 'optimizer.lr=-1': optimizer.lr" in err


def test_validate_json_to_stdout(cli, tiny):
    result = cli("validate", tiny, "train.seed=5", "--json", "-")
    data = json.loads(result.stdout)
    assert data["status"] == "valid" and data["config"]["train"]["seed"] == 5
    assert data["config"]["optimizer"]["name"] == "SGD"  # defaults resolved
    bad = cli("validate", tiny, "train.seed=x", "--json", "-")
    data = json.loads(bad.stdout)
    assert bad.exit_code == 2 and data["status"] == "invalid" and data["exit_code"] == 2
    assert data["problems"][0]["path"] == "train.seed"


def test_missing_config_and_bad_usage_exit_2(cli, tmp_path):
    result = cli("train", tmp_path / "nope.yaml")
    assert result.exit_code == 2 and "not found" in result.stderr
    assert cli("train").exit_code == 2  # no CONFIG
    assert cli("train", "x.yaml", "--no-such-option").exit_code == 2
    assert cli("validate", tmp_path / "nope.yaml", "novalue").exit_code == 2


def test_train_renders_tables_and_summary(cli, tiny, tmp_path):
    result = cli("train", tiny, f"checkpoint.dir={tmp_path / 'ck'}", "--json",
                 tmp_path / "out.json", "--metrics", tmp_path / "m.jsonl")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "2 replicas on CPU:0, CPU:1; parameters on CPU:0" in out
    assert "distribute -> run" in out and "step 3/6" in out
    assert "replica" in out and "step time" in out and "held out: accuracy" in out
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["status"] == "completed" and data["exit_code"] == 0
    assert data["params_sha256"] in out
    assert len(data["per_replica"]) == 2 and data["steps"] == 6 and len(data["losses"]) == 6
    assert {"examples_per_s", "wall_s"} <= set(data["throughput"])
    assert data["checkpoint"]["last_step"] == 6
    assert len((tmp_path / "m.jsonl").read_text().splitlines()) == 6


def test_train_json_dash_keeps_stdout_pure_json(cli, tiny):
    result = cli("train", tiny, "--json", "-")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data["status"] == "completed"
    assert "params_sha256" in result.stderr  # the human summary went to stderr


def test_runtime_failure_exits_1_with_a_message(cli, tiny, tmp_path):
    result = cli("train", tiny, "optimizer.lr=1e38", "--json", tmp_path / "r.json")
    assert result.exit_code == 1
    assert "error: the loss is" in result.stderr and "replica" in result.stderr
    assert "Traceback" not in result.stderr
    assert json.loads((tmp_path / "r.json").read_text())["status"] == "failed"


def test_resume_without_checkpoint_dir_is_a_usage_error(cli, tiny):
    result = cli("train", tiny, "--resume")
    assert result.exit_code == 2 and "checkpoint.dir" in result.stderr


def test_unexpected_errors_are_one_line_not_a_traceback(cli, tiny, monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("kaboom")
    monkeypatch.setattr("csrun.core.runner.train.train_from_file", boom)
    result = cli("train", tiny)
    assert result.exit_code == 1
    assert "error: RuntimeError: kaboom" in result.stderr and "Traceback" not in result.stderr


def test_inspect_devices(cli):
    result = cli("inspect-devices")
    assert result.exit_code == 0
    assert "/job:localhost/replica:0/task:0/device:CPU:0" in result.stdout
    assert "default placement" in result.stdout
    data = json.loads(cli("inspect-devices", "--json").stdout)
    assert data["devices"][0]["short_name"] == "CPU:0"
    assert data["default_placement"]["parameter_device"] in ("CPU:0", "GPU:0")


# -- the CLI surface changes only on purpose ---------------------------------------------
SURFACE = {
    "train": ["config", "overrides", "--resume", "--json", "--plot", "--metrics",
              "--tensorboard"],
    "validate": ["config", "overrides", "--json"],
    "inspect-devices": ["--json"],
    "launch": ["config", "overrides", "--workers", "--ps", "--chief", "--resume", "--json",
               "--logs"],
}


def test_cli_surface_is_frozen():
    group = typer.main.get_command(app)
    assert sorted(group.commands) == sorted(SURFACE)
    for name, expected in SURFACE.items():
        params = [p.opts[0] if p.opts[0].startswith("--") else p.name
                  for p in group.commands[name].params if p.name != "help"]
        assert params == expected, f"csrun {name} options changed: {params}"


@pytest.mark.parametrize("command", sorted(SURFACE))
def test_every_command_has_help(cli, command):
    result = cli(command, "--help")
    assert result.exit_code == 0 and "Usage: csrun" in result.stdout
