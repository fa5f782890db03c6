"""Real ``csrun`` processes: exit codes, --json contents, Ctrl-C and --resume."""

import json
import signal
import time

import pytest
from pathlib import Path

pytestmark = pytest.mark.process  # the real CLI, signalled and resumed


def test_train_writes_the_json_ci_reads(csrun, tiny, tmp_path):
    done = csrun("train", tiny, "--json", "result.json")
    assert done.returncode == 0, done.stderr
    data = json.loads((tmp_path / "result.json").read_text())
    assert data["status"] == "completed" and data["exit_code"] == 0
    assert data["steps"] == data["total_steps"] == 12 and len(data["losses"]) == 12
    assert [r["device"] for r in data["per_replica"]] == ["CPU:0", "CPU:1"]
    assert all(r["examples"] > 0 for r in data["per_replica"])
    assert len(data["params_sha256"]) == 64
    assert data["metrics"]["eval_examples"] == 32 and data["throughput"]["examples_per_s"] > 0
    assert data["strategy"] == {"compute_devices": ["CPU:0", "CPU:1"], "replicas": 2,
                                "parameter_device": "CPU:0", "distribute": "global"}
    assert "params_sha256" in done.stdout and done.stderr == ""


def test_exit_codes_2_and_1(csrun, tiny, tmp_path):
    bad = csrun("train", tiny, "model.hiden=[3]", "strategy.compute_devices=[CPU:0,GPU:7]")
    assert bad.returncode == 2
    assert "did you mean 'hidden'?" in bad.stderr and "GPU:7" in bad.stderr
    assert "Traceback" not in bad.stderr and bad.stdout == ""
    failed = csrun("train", tiny, "optimizer.lr=1e38", "optimizer.name=SGD",
                   "--json", "failed.json")
    assert failed.returncode == 1, failed.stderr
    assert "the loss is" in failed.stderr and "Traceback" not in failed.stderr
    assert json.loads((tmp_path / "failed.json").read_text())["status"] == "failed"


def _wait_for_lines(path, count, process, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and len(path.read_text().splitlines()) >= count:
            return
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    raise AssertionError(f"{path} never reached {count} lines")


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_or_sigterm_saves_and_resume_ends_where_an_uninterrupted_run_ends(
        sig, code, csrun, spawn, tiny, tmp_path):
    long = ["train.epochs=null", "train.steps=400", "checkpoint.dir=ck",
            "checkpoint.every_steps=1000"]
    process = spawn("train", tiny, *long, "--metrics", "m.jsonl", "--json", "stopped.json")
    _wait_for_lines(tmp_path / "m.jsonl", 20, process)
    process.send_signal(sig)
    out, err = process.communicate(timeout=120)
    assert process.returncode == code, err
    stopped = json.loads((tmp_path / "stopped.json").read_text())
    assert stopped["status"] == "interrupted" and stopped["signal"] == sig.name
    assert "interrupted" in err and "--resume" in err
    saved = sorted((tmp_path / "ck").glob("ckpt-*.pt"))
    assert len(saved) == 1  # saved at the interrupt, though every_steps is 1000
    resumed = csrun("train", tiny, *long, "--resume", "--json", "resumed.json")
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from step" in resumed.stdout
    whole = csrun("train", tiny, *long[:2], "--json", "whole.json")
    assert whole.returncode == 0, whole.stderr
    first = json.loads((tmp_path / "resumed.json").read_text())
    second = json.loads((tmp_path / "whole.json").read_text())
    assert first["checkpoint"]["resumed_from_step"] > 0
    assert first["params_sha256"] == second["params_sha256"]
    assert first["losses"] == second["losses"]


def test_ci_smoke_script(shell, tiny):
    done = shell(Path(__file__).with_name("smoke.sh"), tiny)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "smoke: ok" in done.stdout
