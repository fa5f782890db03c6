"""Every size and count csrun reads from outside (an environment variable, a launcher's
variables, a name to match) is bounded before it is used, and a bad one is a problem
naming the variable (exit 2), not the unexpected-error path.

The bounds: ``CSRUN_LOGICAL_CPUS`` 1..4096, a launcher's world and node list at most
65536 processes, a did-you-mean compares words of at most 100 characters with at most
1000 choices.
"""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from csrun.cli.main import app
from csrun.core.cluster import launchers
from csrun.core.cluster.resolvers import ClusterError
from csrun.core.config import problems as problems_module
from csrun.core.config.problems import closest
from tests.helpers.tiny_config import tiny_config

PS = tiny_config("strategy={kind: parameter_server, num_ps: 1}", "~dataset.holdout")
SLURM = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]",
         "SLURM_JOB_ID": "7"}


@pytest.fixture
def ps_file(work):
    path = work / "ps.yaml"
    path.write_text(PS)
    return path


def named(outcome, variable: str) -> str:
    assert outcome.exit_code == 2, outcome.stderr
    text = " ".join(f"{p['origin']} {p['message']} {p['hint']}" for p in outcome.problems)
    assert variable in text, text
    return text


# -- CSRUN_LOGICAL_CPUS -------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", ["abc", "0", "-3", "200000", "9" * 5000, "１２", "4\n"])
def test_a_bad_logical_cpu_count_is_a_problem_naming_the_variable(
        validate, valid_file, monkeypatch, value):
    monkeypatch.setenv("CSRUN_LOGICAL_CPUS", value)
    outcome = validate(valid_file)
    if value == "4\n":  # surrounding space is no mistake
        assert outcome.exit_code == 0, outcome.stderr
        return
    assert "1..4096" in named(outcome, "CSRUN_LOGICAL_CPUS")
    assert outcome.stderr.startswith("error: 1 problem in the environment")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("value", ["abc", "200000"])
def test_inspect_devices_refuses_a_bad_logical_cpu_count(monkeypatch, value):
    monkeypatch.setenv("CSRUN_LOGICAL_CPUS", value)
    done = CliRunner().invoke(app, ["inspect-devices"], catch_exceptions=False)
    assert done.exit_code == 2, done.output
    assert "CSRUN_LOGICAL_CPUS" in done.stderr and "CSRUN_TRACEBACK" not in done.stderr


# -- a launcher's variables ---------------------------------------------------------------
@pytest.mark.parametrize("variables, said", [
    ({"SLURM_JOB_ID": "x"}, "SLURM_JOB_ID='x' is not a job number"),
    ({"SLURM_JOB_ID": "9" * 5000}, "SLURM_JOB_ID="),
    ({"SLURM_NTASKS": "300000000"}, "300000000 processes is not in 1..65536"),
    ({"SLURM_JOB_NODELIST": "node[0-99999999999]"}, "names more than 65536 hosts"),
    ({"SLURM_JOB_NODELIST": "n[0-65536]"}, "names more than 65536 hosts"),
    ({"SLURM_JOB_NODELIST": "n[0-9999][0-9999]"}, "names more than 65536 hosts"),
    ({"SLURM_JOB_NODELIST": "n" + "[1]" * 100_000}, "more than 8 brackets"),
    ({"SLURM_JOB_NODELIST": "n[" + "9" * 5000 + "]"}, "is malformed"),
])
@pytest.mark.timeout(120)
def test_slurm_variables_are_bounded_before_use(variables, said):
    with pytest.raises(ClusterError) as caught:
        launchers.launcher_cluster(1, {**SLURM, **variables})
    assert said in str(caught.value) and len(str(caught.value)) < 400


@pytest.mark.timeout(120)
@pytest.mark.parametrize("per_node, worker", [
    ("1(x99999999999)", "n1"), ("99999999999", "n1"), ("1" * 5000, "n1"),
    ("1(x999999999)", "n2"), ("1,1,1,1,1,1", "n2"), ("1," * 100_000, "n2")])
def test_tasks_per_node_are_bounded_before_use(per_node, worker):
    # Slurm's counts name each task's node; counts past the last host are not read, and
    # counts that cannot be right put every task on the first node
    found = launchers.launcher_cluster(1, {**SLURM, "SLURM_TASKS_PER_NODE": per_node})
    assert found.cluster == {"ps": ["n1:20007"], "worker": [f"{worker}:20007"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("variables, said", [
    ({"SLURM_JOB_ID": "x"}, "SLURM_JOB_ID"),
    ({"SLURM_JOB_NODELIST": "node[0-99999999999]"}, "more than 65536 hosts"),
    ({"RANK": "0", "WORLD_SIZE": "300000000", "MASTER_ADDR": "h", "MASTER_PORT": "1"},
     "300000000 processes"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1" * 5000},
     "MASTER_PORT"),
])
def test_validate_names_the_launchers_variable(validate, ps_file, monkeypatch, variables,
                                               said):
    for name, value in {**SLURM, **variables}.items():
        monkeypatch.setenv(name, value)
    named(validate(ps_file), said)


# -- a did-you-mean -----------------------------------------------------------------------
def test_a_did_you_mean_compares_a_bounded_amount_of_text(monkeypatch):
    work = []
    edits = problems_module._edits
    monkeypatch.setattr(problems_module, "_edits",
                        lambda a, b: work.append(len(a) * len(b)) or edits(a, b))
    names = ["Adam", "AdamW", "SGD", "RMSprop"] * 10_000
    assert closest("Adma", names) == "Adam"  # still found
    assert closest("Adma" * 475_000, names) is None  # 1.9 MB: no misspelling of a name
    assert closest("x" * 90, [f"{i:090d}" for i in range(100_000)]) is None
    assert sum(work) <= 2 * problems_module.CLOSEST_CHOICES * \
        problems_module.CLOSEST_WORD_MAX ** 2


@pytest.mark.timeout(120)
def test_a_huge_optimizer_name_is_refused_naming_it(validate, valid_file):
    outcome = validate(valid_file, "optimizer.name=" + "Adma" * 475_000)
    assert outcome.exit_code == 2
    assert [p["path"] for p in outcome.problems] == ["optimizer.name"]


# -- an override's key --------------------------------------------------------------------
@pytest.mark.parametrize("section", ["dataset.source.kwargs", "train", "nowhere"])
def test_an_override_key_deeper_than_a_config_nests_is_the_overrides(
        validate, valid_file, section):
    key = f"{section}.{'.'.join(['a'] * 5000)}"
    outcome = validate(valid_file, f"{key}=1")
    assert outcome.exit_code == 2
    [problem] = outcome.problems
    assert problem["origin"].startswith(f"override '{section}.a.a") and not problem["line"]
    assert problem["message"] == f"the key is {key.count('.') + 1} levels deep; a config " \
        "nests at most 64", problem
