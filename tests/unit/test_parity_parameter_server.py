"""The contrib ParameterServerStrategy's rules that need no running cluster: how a task
finds its cluster (TF's ``ParameterServerStrategy`` page: "either passed in to init() method
or parsed from the "TF_CONFIG" environment variable") and which ps holds each variable
(TF's replica device setter: round-robin in creation order). The job itself (workers, ps
tasks, faults) is pinned by tests/integration."""

from __future__ import annotations

import json

import pytest

import csrun.core as cs
from csrun.core.cluster.plan import placement


def test_variables_go_round_robin_over_the_ps_tasks_in_creation_order():
    assert placement([4, 4, 4, 4, 4], 2) == [0, 1, 0, 1, 0]
    assert placement([100, 1, 1, 1], 3) == [0, 1, 2, 0]


def test_balanced_placement_and_colocation():
    # balanced: each on the ps holding the fewest bytes so far (csrun's option)
    assert placement([100, 1, 1, 1], 2, "balanced") == [0, 1, 1, 1]
    # colocate_vars_with: variable 2 shares variable 0's ps
    assert placement([4, 4, 4], 2, colocate={2: 0}) == [0, 1, 0]
    with pytest.raises(ValueError, match="'round_robin' or 'balanced'"):
        placement([1], 1, "even")


def test_a_task_finds_its_cluster_as_in_tf(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    spec = {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    with pytest.raises(ValueError, match="no task type and index"):
        cs.ParameterServerStrategy(cluster_spec=spec)  # TF: task_type and task_id needed
    with pytest.raises(ValueError, match="task_type and task_id need a cluster_spec"):
        cs.ParameterServerStrategy(task_type="worker", task_id=0)
    resolver = cs.TFConfigClusterResolver(json.dumps(
        {"cluster": spec, "task": {"type": "worker", "index": 1}}))
    assert (resolver.task_type, resolver.task_id) == ("worker", 1)
    assert resolver.cluster_spec().as_dict() == spec
    # without a cluster: local central storage, runnable (TF's v1 strategy needs Estimator)
    local = cs.ParameterServerStrategy()
    assert local.cluster_resolver is None and local.num_replicas_in_sync == 1
