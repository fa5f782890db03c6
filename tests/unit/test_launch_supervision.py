"""csrun launch's supervision with stand-in tasks (tiny Python scripts, no torch): how a
job is judged from its tasks' exits, what a failure names, how signals are forwarded."""

import json
import os
import signal
import sys
import threading
import time
import types

import pytest

from csrun.core.cluster.coordinator import echoes
from csrun.core.runner.launch import (LaunchPlan, TaskExited, TaskOutput, TaskStarted,
                               describe_exit, launch)

CLUSTER = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}
CLUSTER_TASKS = ["ps:0", "worker:0", "worker:1"]
EXIT_ON_TERM = ("import signal, sys, time\n"
                "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
                "time.sleep(60)\n")


class FakePlan(LaunchPlan):
    """A plan whose tasks run the given scripts instead of ``csrun train``."""

    scripts: dict

    def command(self, task):
        return [sys.executable, "-c", self.scripts[task]]


def plan(tmp_path, **scripts):
    made = FakePlan("c.yaml", [], CLUSTER, "worker:0", False, tmp_path,
                    types.SimpleNamespace(strategy=types.SimpleNamespace(timeout_s=5)))
    made.scripts = {"ps:0": "", "worker:0": "", "worker:1": ""}
    made.scripts.update({k.replace("_", ":"): v for k, v in scripts.items()})
    return made


def run(made, stop=None, received=()):
    events = []
    result = launch(made, events.append, stop, received)
    return result, events


def codes(result):
    return {t["task"]: t["exit_code"] for t in result.tasks}


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_job_whose_tasks_all_end_well_completes(tmp_path):
    made = plan(tmp_path, worker_0="print('hello'); print('to stderr', file=__import__("
                                   "'sys').stderr); print('no newline', end='')")
    result, events = run(made)
    assert result.status == "completed" and result.exit_code == 0
    assert codes(result) == {"ps:0": 0, "worker:0": 0, "worker:1": 0}
    assert result.lost_workers == [] and result.error is None and result.failed_task is None
    started = [e for e in events if isinstance(e, TaskStarted)]
    assert [e.task for e in started] == ["ps:0", "worker:0", "worker:1"]
    assert [e.chief for e in started] == [False, True, False]
    lines = [(e.task, e.stream, e.line) for e in events if isinstance(e, TaskOutput)]
    assert ("worker:0", "stdout", "hello") in lines
    assert ("worker:0", "stderr", "to stderr") in lines
    assert (tmp_path / "worker-0.stdout.log").read_text() == "hello\nno newline"
    assert {e.task for e in events if isinstance(e, TaskExited)} == set(CLUSTER_TASKS)


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_lost_worker_does_not_fail_the_job(tmp_path):
    result, _ = run(plan(tmp_path, worker_1="import os, signal; "
                                            "os.kill(os.getpid(), signal.SIGKILL)",
                         worker_0="import time; time.sleep(0.5)"))
    assert result.status == "completed" and result.exit_code == 0
    assert result.lost_workers == ["worker:1"] and codes(result)["worker:1"] == -9


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_worker_that_fails_on_its_own_fails_the_job_naming_it(tmp_path):
    result, _ = run(plan(tmp_path, worker_1="import sys; print('error: worker 1 of 2 has no "
                                            "example', file=sys.stderr); sys.exit(1)",
                         worker_0="import time; time.sleep(0.5)"))
    assert result.status == "failed" and result.exit_code == 1
    assert result.failed_task == "worker:1"
    assert result.error == "worker:1 failed first (exit 1): worker 1 of 2 has no example"


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_worker_the_chief_saw_rejoin_is_not_reported_lost(tmp_path):
    result_file = tmp_path / "worker-0.result.json"
    chief = ("import json, time; time.sleep(0.5); open(%r, 'w').write(json.dumps("
             "{'cluster': {'lost_workers': [], 'rejoined_workers': ['worker:1']}}))"
             % str(result_file))
    result, _ = run(plan(tmp_path, worker_1="import os, signal; "
                                            "os.kill(os.getpid(), signal.SIGKILL)",
                         worker_0=chief))
    assert result.status == "completed" and result.lost_workers == []


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_failed_ps_fails_the_job_and_is_named_first(tmp_path):
    result, _ = run(plan(tmp_path, ps_0="import sys; print('ps broke', file=sys.stderr); "
                                        "sys.exit(1)",
                         worker_0="import sys, time; time.sleep(1); "
                                  "print('error: parameter server ps:0 stopped answering',"
                                  " file=sys.stderr); print('  (set CSRUN_TRACEBACK=1 to "
                                  "see the traceback)', file=sys.stderr); sys.exit(1)"))
    assert result.status == "failed" and result.exit_code == 1
    assert result.failed_task == "ps:0"
    # the chief's error line, not the hint after it (issue 39: the hint was named)
    assert result.error == ("ps:0 failed first (exit 1): ps broke; the chief worker:0 then "
                            "exit 1: parameter server ps:0 stopped answering")
    assert result.tails["ps:0"] == ["ps broke"]


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_task_echoing_the_chiefs_failure_is_not_named_first(tmp_path):
    # the ps hears the chief's reason and exits before the chief does: the chief is named
    echo = ("import sys; print('error: the chief ended the job: worker:0 failed: bad "
            "checkpoint', file=sys.stderr); sys.exit(1)")
    result, _ = run(plan(tmp_path, ps_0=echo,
                         worker_0="import sys, time; time.sleep(1); print('error: bad "
                                  "checkpoint', file=sys.stderr); sys.exit(1)"))
    assert result.status == "failed" and result.failed_task == "worker:0"
    assert result.error.startswith("worker:0 failed first (exit 1): bad checkpoint")


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_worker_echoing_a_ps_failed_request_is_not_named_first(tmp_path):
    # worker:1 hears ps:0's failure on the chief's request and exits first: ps:0 is named
    line = "ps:0 failed on a request of worker:0: IsADirectoryError: ck/x.safetensors"
    echo = f"import sys; print('error: {line}', file=sys.stderr); sys.exit(1)"
    late = f"import sys, time; time.sleep(1); print('error: {line}', file=sys.stderr); " \
           "sys.exit(1)"
    result, _ = run(plan(tmp_path, worker_1=echo, worker_0=late, ps_0=late))
    assert result.status == "failed" and result.failed_task == "ps:0", result.error
    assert result.error.startswith(f"ps:0 failed first (exit 1): {line}")


def test_which_lines_echo_another_tasks_failure():
    line = "ps:1 failed on a request of worker:0: KeyError: 'shard 7'"
    assert echoes("worker:1", line) and echoes("worker:0", line) and echoes("ps:0", line)
    assert not echoes("ps:1", line)  # its own
    assert echoes("ps:0", "the chief ended the job: worker:0 failed: bad checkpoint")
    assert not echoes("worker:0", "step 13: IndexError: index out of range")
    assert not echoes("worker:1", "model.loss failed on a request of the user: no")


@pytest.mark.process
@pytest.mark.timeout(60)
def test_when_the_chief_fails_the_others_are_stopped(tmp_path):
    forever = "import time; time.sleep(60)"
    result, _ = run(plan(tmp_path, worker_0="raise SystemExit(1)", ps_0=forever,
                         worker_1=forever))
    assert result.status == "failed" and result.failed_task == "worker:0"
    assert codes(result) == {"ps:0": -signal.SIGTERM, "worker:0": 1,
                             "worker:1": -signal.SIGTERM}
    assert result.lost_workers == []  # stopped by the launcher, not lost


@pytest.mark.process
@pytest.mark.timeout(60)
def test_a_stop_forwards_the_signal_and_the_job_is_interrupted(tmp_path):
    stop = threading.Event()
    made = plan(tmp_path, ps_0="", worker_0=EXIT_ON_TERM, worker_1=EXIT_ON_TERM)
    timer = threading.Timer(1.0, stop.set)
    timer.start()
    result, _ = run(made, stop, ["SIGTERM"])
    assert result.status == "interrupted" and result.exit_code == 143
    assert result.signal == "SIGTERM" and result.lost_workers == []
    assert codes(result) == {"ps:0": 0, "worker:0": 143, "worker:1": 143}


@pytest.mark.process
@pytest.mark.timeout(60)
def test_the_chief_result_is_read_back(tmp_path):
    made = plan(tmp_path)
    payload = {"status": "completed", "cluster": {"lost_workers": ["worker:1"]}}
    made.scripts["worker:0"] = (f"open({str(made.result_path)!r}, 'w').write("
                                f"{json.dumps(json.dumps(payload))})")
    result, _ = run(made)
    assert result.result == payload and result.lost_workers == ["worker:1"]


def test_plan_gives_each_task_its_tf_config_and_command(tmp_path):
    made = LaunchPlan("c.yaml", ["train.steps=5"], {**CLUSTER, "chief": ["127.0.0.1:4"]},
                      "chief:0", True, tmp_path, None)
    assert made.tasks == ["ps:0", "chief:0", "worker:0", "worker:1"]
    assert json.loads(made.tf_config("worker:1")) == {
        "cluster": {**CLUSTER, "chief": ["127.0.0.1:4"]}, "task": {"type": "worker",
                                                                    "index": 1}}
    assert made.command("ps:0")[-4:] == ["csrun.cli", "train", "c.yaml", "train.steps=5"]
    assert made.command("worker:1")[-1] == "--resume"
    assert made.command("chief:0")[-3:] == ["--resume", "--json", str(made.result_path)]


def test_describe_exit():
    assert describe_exit(0) == "exit 0" and describe_exit(143) == "exit 143"
    assert describe_exit(-9) == "killed by SIGKILL" and describe_exit(None) == "still running"


@pytest.mark.process
@pytest.mark.timeout(60)
def test_an_error_in_the_launcher_kills_every_task_it_started(tmp_path):
    # e.g. `csrun launch ... | head`: writing an event fails; tasks in their own
    # sessions would otherwise run on as orphans
    forever = "import time; time.sleep(60)"
    made = plan(tmp_path, ps_0=forever, worker_0=forever, worker_1=forever)
    started = []

    def on_event(event):
        if isinstance(event, TaskStarted):
            started.append(event.pid)
            if len(started) == 2:
                raise BrokenPipeError("stdout closed")

    with pytest.raises(BrokenPipeError):
        launch(made, on_event)
    deadline = time.monotonic() + 10
    alive = started
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in started if _alive(pid)]
        time.sleep(0.05)
    assert alive == []


def _alive(pid):
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return False
    return done == 0


def test_launched_tasks_share_the_cores_and_sleep_when_idle(monkeypatch):
    from csrun.core.runner.launch import thread_settings
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert thread_settings("worker:1", 2, {}) == {"OMP_NUM_THREADS": "4",
                                                  "OMP_WAIT_POLICY": "PASSIVE"}
    assert thread_settings("ps:0", 2, {})["OMP_NUM_THREADS"] == "1"
    assert thread_settings("chief:0", 16, {})["OMP_NUM_THREADS"] == "1"
    # what the user set is kept: neither is given
    assert thread_settings("worker:0", 2, {"OMP_NUM_THREADS": "3",
                                           "OMP_WAIT_POLICY": "ACTIVE"}) == {}


def test_every_launched_task_gets_the_thread_settings(tmp_path, monkeypatch):
    from csrun.core.runner.launch import _environment
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    env = _environment(plan(tmp_path), "worker:0")
    assert env["OMP_WAIT_POLICY"] == "PASSIVE" and int(env["OMP_NUM_THREADS"]) >= 1
