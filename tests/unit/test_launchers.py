"""Clusters from torchrun's and Slurm's variables, and which source wins."""

import json

import pytest

from csrun.core.cluster.launchers import (expand_hostlist, launcher_cluster, slurm_cluster,
                                          torchrun_cluster)
from csrun.core.cluster.launchers import TorchrunClusterResolver
from csrun.core.cluster.resolvers import ClusterError
from csrun.core.config.problems import ConfigError
from csrun.core.runner.preflight import load_config_text

PS = """\
strategy: {kind: parameter_server, compute_devices: [CPU:0]}
dataset: {source: {kind: range, stop: 64}, steps: [{op: batch, size: 8}]}
model: {kind: linear}
train: {steps: 4}
"""
TORCHRUN = {"RANK": "2", "WORLD_SIZE": "4", "MASTER_ADDR": "h0", "MASTER_PORT": "29500"}
SLURM = {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "123456",
         "SLURM_JOB_NODELIST": "node[01-02]", "SLURM_TASKS_PER_NODE": "2(x2)"}


@pytest.mark.parametrize("text, hosts", [
    ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
    ("a1,b[8-10],c", ["a1", "b8", "b9", "b10", "c"]),
    ("r[1-2]-n[3-4]", ["r1-n3", "r1-n4", "r2-n3", "r2-n4"]),
    ("gpu[099-101]", ["gpu099", "gpu100", "gpu101"]),
])
def test_slurm_hostlists_expand(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[3-1]", "node[a]", "node[1", ""])
def test_malformed_hostlists_are_errors(text):
    with pytest.raises(ValueError):
        expand_hostlist(text)


def test_torchrun_ranks_ps_first_and_the_store_beside_torchruns_own():
    launched = torchrun_cluster(2, TORCHRUN)
    # MASTER_PORT is torchrun's own TCPStore: ps:0's store takes the next port
    assert launched.cluster == {"ps": ["h0:29501"] * 2, "worker": ["h0:29501"] * 2}
    assert launched.task == ("worker", 0)
    assert torchrun_cluster(2, {**TORCHRUN, "RANK": "1"}).task == ("ps", 1)
    assert torchrun_cluster(1, {**TORCHRUN, "CSRUN_PS_PORT": "4000"}).cluster["ps"] == \
        ["h0:4000"]
    resolver = TorchrunClusterResolver(1, TORCHRUN)
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)


def test_slurm_port_rule_and_nodes_by_block_distribution():
    launched = slurm_cluster(1, SLURM)
    assert launched.cluster == {"ps": ["node01:23456"],  # 20000 + job id % 10000
                                "worker": ["node01:23456", "node02:23456", "node02:23456"]}
    assert launched.task == ("ps", 0)
    step = {**SLURM, "SLURM_STEP_NODELIST": "gpu[7-8]", "MASTER_PORT": "6000",
            "SLURM_PROCID": "3"}
    launched = slurm_cluster(1, step)  # the step's nodes win; MASTER_PORT + 1
    assert launched.cluster["ps"] == ["gpu7:6001"] and launched.task == ("worker", 2)


@pytest.mark.parametrize("env, num_ps, message", [
    (TORCHRUN, None, "how many are ps tasks"),
    (TORCHRUN, 4, "leaves no worker among 4"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, 1, "MASTER_PORT not set"),
    ({**TORCHRUN, "RANK": "x"}, 1, "must be integers"),
    ({**SLURM, "SLURM_JOB_NODELIST": "n[2-1]"}, 1, "runs backwards"),
])
def test_launcher_problems_say_what_is_wrong(env, num_ps, message):
    with pytest.raises(ClusterError, match=message):
        launcher_cluster(num_ps, env)


def test_torchrun_wins_over_slurm_and_nothing_is_none():
    assert launcher_cluster(1, {**SLURM, **TORCHRUN}).source == "torchrun"
    assert launcher_cluster(1, SLURM).source == "Slurm"
    assert launcher_cluster(1, {"PATH": "/bin"}) is None


def load(environ, overrides=()):
    return load_config_text(PS, "c.yaml", list(overrides), environ=environ)


def test_config_from_torchrun_needs_num_ps_and_no_tf_config():
    config = load(TORCHRUN, ["strategy.num_ps=1"])
    assert config.strategy.num_ps == 1
    with pytest.raises(ConfigError) as info:
        load(TORCHRUN)
    (problem,) = info.value.problems
    assert problem.path == "strategy.cluster" and "strategy.num_ps" in problem.hint
    assert "torchrun" in problem.origin


def test_precedence_tf_config_then_config_then_torchrun_then_slurm():
    from csrun.core.runner.preflight.cluster import cluster_resolver
    tf = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"], "ps": ["b:2"]},
                                   "task": {"type": "worker", "index": 0}})}
    strategy = load(TORCHRUN, ["strategy.num_ps=1"]).strategy
    both = {**SLURM, **TORCHRUN, **tf}
    assert cluster_resolver(strategy, both).cluster_spec().as_dict()["ps"] == ["b:2"]
    assert cluster_resolver(strategy, {**SLURM, **TORCHRUN}).task_id == 1  # torchrun's
    assert cluster_resolver(strategy, SLURM).task_type == "ps"               # Slurm's
    explicit = load({}, ["strategy.cluster={worker: [a:1], ps: [b:2]}",
                         "strategy.task={type: worker, index: 0}",
                         "strategy.num_ps=1"]).strategy
    assert cluster_resolver(explicit, TORCHRUN).cluster_spec().as_dict()["ps"] == ["b:2"]


def test_num_ps_must_match_a_given_cluster_and_task_must_match_the_rank():
    tf = {"TF_CONFIG": json.dumps({"cluster": {"worker": ["a:1"], "ps": ["b:2"]},
                                   "task": {"type": "worker", "index": 0}})}
    with pytest.raises(ConfigError) as info:
        load(tf, ["strategy.num_ps=2"])
    assert [p.path for p in info.value.problems] == ["strategy.num_ps"]
    with pytest.raises(ConfigError) as info:
        load(TORCHRUN, ["strategy.num_ps=1", "strategy.task={type: ps, index: 0}"])
    assert "differs from torchrun's task worker:1" in info.value.problems[0].message


@pytest.mark.parametrize("port", ["²", "9" * 5000, "0", "70000", "x"])
def test_a_bad_store_port_is_a_cluster_error_naming_the_variable(port):
    with pytest.raises(ClusterError, match=r"the store's port .* is not in 1\.\.65535"):
        torchrun_cluster(1, {**TORCHRUN, "CSRUN_PS_PORT": port})
