"""Where ``csrun launch`` leaves its tasks' logs (issue 27): a temporary folder is removed
when the job went well and kept, and named, when it failed or lost a worker; a folder
given with ``--logs`` always stays. Stand-in tasks (tiny Python scripts) play the job."""

from __future__ import annotations

import io
import sys
import types

import pytest
from rich.console import Console

from csrun.cli.render import View
from csrun.core.runner.launch import LaunchPlan, launch

pytestmark = pytest.mark.process

CLUSTER = {"ps": ["127.0.0.1:1"], "worker": ["127.0.0.1:2", "127.0.0.1:3"]}


class StandInPlan(LaunchPlan):
    """A plan whose tasks run ``scripts[task]`` instead of ``csrun train``."""

    scripts: dict

    def command(self, task):
        return [sys.executable, "-c", self.scripts.get(task, "")]


def plan(folder, temporary: bool, **scripts) -> StandInPlan:
    made = StandInPlan("c.yaml", [], CLUSTER, "worker:0", False, folder,
                       types.SimpleNamespace(strategy=types.SimpleNamespace(timeout_s=5)),
                       logs_temporary=temporary)
    made.scripts = {k.replace("_", ":"): v for k, v in scripts.items()}
    return made


@pytest.mark.timeout(60)
def test_a_temporary_folder_goes_when_the_job_went_well(tmp_path):
    result = launch(plan(tmp_path / "logs", True))
    assert result.status == "completed"
    assert not (tmp_path / "logs").exists() and result.logs is None
    assert all(t["stdout"] is None for t in result.tasks)  # no path to a removed file


@pytest.mark.timeout(60)
@pytest.mark.parametrize("scripts, status", [
    ({"worker_0": "raise SystemExit(1)"}, "failed"),
    # a lost worker (killed: a worker exiting 1 on its own fails the job, issue 39)
    ({"worker_1": "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"}, "completed"),
])
def test_a_temporary_folder_stays_when_something_went_wrong(tmp_path, scripts, status):
    result = launch(plan(tmp_path / "logs", True, **scripts))
    assert result.status == status
    assert result.logs == str(tmp_path / "logs")
    assert (tmp_path / "logs" / "worker-0.stderr.log").exists()


@pytest.mark.timeout(60)
def test_a_folder_given_with_logs_stays(tmp_path):
    result = launch(plan(tmp_path / "logs", False))
    assert result.status == "completed" and result.logs == str(tmp_path / "logs")
    assert (tmp_path / "logs" / "ps-0.stdout.log").exists()


@pytest.mark.timeout(60)
def test_the_summary_says_where_the_logs_are(tmp_path):
    for temporary, says in ((True, "logs: removed with their temporary folder"),
                            (False, f"logs: {tmp_path / 'logs'}")):
        view = View()
        view.out = Console(file=io.StringIO(), width=200)
        view.launch_summary(launch(plan(tmp_path / "logs", temporary)))
        assert says in view.out.file.getvalue()
