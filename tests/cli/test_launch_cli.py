"""csrun launch through Typer's CliRunner: usage and config errors exit 2 before any task
starts; the outcome of a job is rendered and written as JSON (the job itself is stood in
for here; tests/integration starts real ones)."""

import json

import pytest

from csrun.core.runner.launch import LaunchResult
from csrun.core.config.problems import ConfigError
from tests.helpers.tiny_config import tiny_config

PS_TINY = tiny_config("strategy={kind: parameter_server, compute_devices: [CPU:0]}",
                      "dataset.source.features=4", "~dataset.holdout",
                      "dataset.steps=[{op: batch, size: 16}]", "model.hidden=[8]", "~optimizer",
                      "train={steps: 6}")


@pytest.fixture
def ps_tiny(tmp_path):
    path = tmp_path / "ps.yaml"
    path.write_text(PS_TINY)
    return path


@pytest.fixture(autouse=True)
def nothing_starts(monkeypatch):
    """Any attempt to start a task fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a task was started")
    monkeypatch.setattr("csrun.core.runner.launch.subprocess.Popen", refuse)


@pytest.mark.parametrize("args, says", [
    (["--workers", "0", "--ps", "1"], "--workers: 0 workers: the job needs at least one"),
    (["--workers", "2", "--ps", "0"], "--ps: 0 parameter servers"),
    (["--workers", "500", "--ps", "1"], "tasks on"),
    (["--workers", "2", "--ps", "1", "--logs", "{file}"], "--logs:"),
])
def test_bad_counts_and_paths_exit_2_before_anything_starts(cli, ps_tiny, args, says):
    args = [a.replace("{file}", str(ps_tiny)) for a in args]
    result = cli("launch", ps_tiny, *args)
    assert result.exit_code == 2, result.stderr
    assert says in result.stderr and "Traceback" not in result.stderr


def test_missing_options_and_config_exit_2(cli, ps_tiny, tmp_path):
    assert cli("launch", ps_tiny, "--ps", "1").exit_code == 2  # --workers is required
    assert cli("launch", ps_tiny, "--workers", "2").exit_code == 2
    result = cli("launch", tmp_path / "nope.yaml", "--workers", "2", "--ps", "1")
    assert result.exit_code == 2 and "not found" in result.stderr


def test_a_central_storage_config_is_refused_with_a_hint(cli, tiny):
    result = cli("launch", tiny, "--workers", "2", "--ps", "1")
    assert result.exit_code == 2
    assert "strategy.kind: is 'central_storage'; csrun launch starts a parameter-server " \
        "job" in result.stderr
    assert "strategy.kind=parameter_server" in result.stderr


def test_config_problems_are_reported_as_validate_does(cli, ps_tiny):
    # per-replica batches of 15 divide among a worker's replica, not the job's two
    result = cli("launch", ps_tiny, "optimizer.lr=-1", "dataset.distribute=per_replica",
                 "dataset.steps.0.size=15", "--workers", "2", "--ps", "1", "--json", "-")
    assert result.exit_code == 2
    data = json.loads(result.stdout)
    assert data["status"] == "invalid" and data["exit_code"] == 2
    assert {p["path"] for p in data["problems"]} == {"optimizer.lr", "dataset.steps.0.size"}


def test_a_cluster_in_the_file_must_not_fight_the_launcher(cli, ps_tiny):
    ps_tiny.write_text(PS_TINY.replace(
        "compute_devices: [CPU:0]}",
        "compute_devices: [CPU:0], cluster: {worker: ['h:1'], ps: ['h:2']}}"))
    result = cli("launch", ps_tiny, "--workers", "2", "--ps", "1")
    assert result.exit_code == 2 and "differs from TF_CONFIG's cluster" in result.stderr
    assert "csrun launch sets TF_CONFIG itself" in result.stderr


def test_a_task_in_the_file_is_refused_before_any_task_starts(cli, ps_tiny):
    # it matches the chief's TF_CONFIG, so only the other tasks would have failed
    result = cli("launch", ps_tiny, "strategy.task={type: worker, index: 0}",
                 "--workers", "2", "--ps", "1")
    assert result.exit_code == 2
    assert "strategy.task: is set in the config; csrun launch gives each task its own" \
        in result.stderr


def outcome(status, exit_code, **fields):
    base = dict(status=status, exit_code=exit_code, chief="worker:0",
                tasks=[{"task": "ps:0", "pid": 1, "exit_code": 0, "stdout": "a", "stderr": "b"},
                       {"task": "worker:0", "pid": 2, "exit_code": 0, "stdout": "c",
                        "stderr": "d"},
                       {"task": "worker:1", "pid": 3, "exit_code": -9, "stdout": "e",
                        "stderr": "f"}],
                result={"status": "completed", "final_loss": 0.1}, lost_workers=[],
                failed_task=None, error=None, tails={}, logs="/tmp/logs",
                cluster={"ps": ["127.0.0.1:1"]}, wall_s=3.0)
    return LaunchResult(**{**base, **fields})


def test_a_completed_job_with_a_lost_worker_exits_0_and_says_so(cli, ps_tiny, monkeypatch,
                                                                  tmp_path):
    monkeypatch.setattr("csrun.core.runner.launch.launch", lambda *a, **k: outcome(
        "completed", 0, lost_workers=["worker:1"]))
    result = cli("launch", ps_tiny, "--workers", "2", "--ps", "1", "--json",
                 tmp_path / "r.json", "--logs", tmp_path / "logs")
    assert result.exit_code == 0, result.stderr
    assert "csrun launch: 1 ps, 2 workers on loopback" in result.stdout
    assert "csrun launch: completed in 3.0 s (ps:0 exit 0, worker:0 exit 0, worker:1 " \
        "killed by SIGKILL)" in result.stdout
    assert "lost workers: worker:1" in result.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["result"]["final_loss"] == 0.1 and data["tasks"][2]["exit_code"] == -9


def test_a_failed_job_exits_1_naming_the_task_and_its_last_lines(cli, ps_tiny, monkeypatch,
                                                                 tmp_path):
    monkeypatch.setattr("csrun.core.runner.launch.launch", lambda *a, **k: outcome(
        "failed", 1, failed_task="ps:0", error="ps:0 failed first (killed by SIGKILL)",
        tails={"worker:0": ["error: parameter server ps:0 stopped answering"]}))
    result = cli("launch", ps_tiny, "--workers", "2", "--ps", "1", "--logs", tmp_path)
    assert result.exit_code == 1
    assert "error: ps:0 failed first (killed by SIGKILL)" in result.stderr
    assert "last stderr lines of worker:0:" in result.stderr
    assert "parameter server ps:0 stopped answering" in result.stderr


def test_an_interrupted_job_exits_with_the_signal_code(cli, ps_tiny, monkeypatch, tmp_path):
    monkeypatch.setattr("csrun.core.runner.launch.launch", lambda *a, **k: outcome(
        "interrupted", 143, signal="SIGTERM"))
    result = cli("launch", ps_tiny, "--workers", "2", "--ps", "1", "--logs", tmp_path)
    assert result.exit_code == 143 and "csrun launch: interrupted" in result.stdout


def test_plan_errors_are_config_errors():
    from csrun.core.runner.launch import plan_launch
    with pytest.raises(ConfigError) as info:
        plan_launch("x.yaml", workers=0, ps=0)
    assert [p.path for p in info.value.problems] == ["--workers", "--ps"]


def test_train_on_a_parameter_server_config_without_a_cluster_says_use_launch(
        cli, ps_tiny, monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    result = cli("train", ps_tiny)
    assert result.exit_code == 2 and "Traceback" not in result.stderr
    assert "strategy.cluster: kind: parameter_server needs a cluster" in result.stderr
    assert "csrun launch CONFIG --workers 2 --ps 1" in result.stderr
    monkeypatch.setenv("TF_CONFIG", "{'cluster': 1}")
    result = cli("validate", ps_tiny)
    assert result.exit_code == 2
    assert "environment TF_CONFIG: strategy.cluster: TF_CONFIG is not valid JSON" in result.stderr


def test_validate_takes_per_replica_batches_in_a_parameter_server_job(cli, ps_tiny,
                                                                       monkeypatch):
    # refused before each worker read only its share; now TF's dataset per worker
    monkeypatch.setenv("TF_CONFIG", json.dumps({
        "cluster": {"worker": ["127.0.0.1:2223", "127.0.0.1:2224"], "ps": ["127.0.0.1:2222"]},
        "task": {"type": "worker", "index": 1}}))
    result = cli("validate", ps_tiny, "dataset.distribute=per_replica")
    assert result.exit_code == 0, result.stderr
    result = cli("validate", ps_tiny, "dataset.distribute=per_replica",
                 "dataset.steps.0.size=15")
    assert result.exit_code == 2
    assert "the global batch size 15 does not divide among the job's 2 replicas" \
        in result.stderr
