"""A worker that starts after the chief ended the job (issue 39): it ends with the
chief's reason, read from the job's store, instead of waiting for channels that the ps
tasks, stopping, no longer make, and then finding ps:0 gone ("stopped answering")."""

import pytest

from csrun.core import ParameterServerStrategy
from csrun.core.cluster import coordinator as coordinator_module
from csrun.core.cluster.coordinator import JobCoordinator
from csrun.core.cluster.transport import JobAborted
from tests.helpers.ps_cluster import Cluster

pytestmark = pytest.mark.timeout(180)

REASON = "the chief ended the job: worker:0 failed: IndexError: index out of range"


def _late_worker(cluster: Cluster) -> ParameterServerStrategy:
    return ParameterServerStrategy(cluster_spec=cluster.spec, task_type="worker", task_id=1,
                                   timeout=20)


def _ended(cluster: Cluster) -> None:
    """The chief fails and ends the job; ps:0 then waits for every task to read why."""
    cluster.strategy.extended.abort(REASON.split(": ", 1)[1])
    cluster.aborted = True


def test_a_worker_starting_after_the_chief_ended_the_job_ends_with_its_reason():
    with Cluster(2, workers=2) as cluster:
        _ended(cluster)
        with pytest.raises(JobAborted) as ended:
            _late_worker(cluster)
        assert str(ended.value) == REASON
        for thread in cluster.threads:  # every task heard: ps:0 need not wait longer
            thread.join(timeout=60)
            assert not thread.is_alive()
        assert cluster.ended_why == REASON


def test_a_worker_whose_channels_are_never_made_hears_the_reason_while_it_waits(monkeypatch):
    """The job ends between the worker's join and its channels' making (the race): the
    ps tasks, past their last look at the joins, never make them; the wait for a
    channel asks the store whether the job ended."""
    with Cluster(2, workers=2) as cluster:
        asked = []
        for server in cluster.servers:  # stopping: the joins are no longer looked at
            monkeypatch.setattr(server, "_accept", asked.append)
        _ended(cluster)
        # the job ended just after this worker looked (its join does not see it)
        joining, read, join = [], coordinator_module.read_abort, JobCoordinator.join_servers

        def unseen(store, heard):
            return None if joining else read(store, heard)

        def join_servers(self):
            joining.append(True)
            join(self)
            joining.clear()
        monkeypatch.setattr(coordinator_module, "read_abort", unseen)
        monkeypatch.setattr(JobCoordinator, "join_servers", join_servers)
        with pytest.raises(JobAborted) as ended:
            _late_worker(cluster)
        assert str(ended.value) == REASON
