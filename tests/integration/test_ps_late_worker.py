"""Channels made late or never (issue 39). A worker that starts after the chief ended
the job ends with the chief's reason, read from the job's store, instead of waiting for
channels that the ps tasks, stopping, no longer make, and then finding ps:0 gone
("stopped answering"). A worker that dies between its join and its end of a channel
leaves each ps waiting in a rendezvous of that channel's own, its books free."""

import pytest
import torch

from csrun.core import ParameterServerStrategy
from csrun.core.cluster import coordinator as coordinator_module
from csrun.core.cluster import server, store_keys as keys
from csrun.core.cluster.coordinator import JobCoordinator
from csrun.core.cluster.transport import JobAborted
from tests.helpers.ps_cluster import Cluster

pytestmark = pytest.mark.timeout(180)

REASON = "the chief ended the job: worker:0 failed: IndexError: index out of range"


def _late_worker(cluster: Cluster) -> ParameterServerStrategy:
    return ParameterServerStrategy(cluster_spec=cluster.spec, task_type="worker", task_id=1,
                                   timeout=20)


@pytest.fixture(autouse=True)
def brief_wait(monkeypatch):
    """ps:0 waits 5 s, not 15, for every task to read why the job ended: in one process
    the chief's channels stay open, so its ps threads wait that long for it to go."""
    monkeypatch.setattr(server, "ABORT_HEARD_S", 5.0)


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


def test_a_worker_that_dies_between_its_join_and_its_channel_does_not_stop_the_ps():
    """A worker asked each ps for a channel and died before making its end: each ps waits
    for it in a rendezvous of its own, while its books still answer (a step's count, the
    chief's end of the job)."""
    with Cluster(2, workers=2) as cluster:
        store = cluster.strategy.extended.coordinator.store
        for k in range(2):  # worker:1's join, as join_servers writes it, and nothing more
            slot = store.add(keys.ps_joins(k), 1)
            store.set(keys.ps_join(k, slot), "worker:1#1")
        with cluster.strategy.scope():
            model = torch.nn.Linear(3, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):  # each push is counted in the books by the ps that applied it
            cluster.strategy.run(lambda: model(torch.ones(2, 3)).sum().backward())
            optimizer.step()
            optimizer.zero_grad()
        assert cluster.strategy.extended.coordinator.steps_done() == 3
        lost = cluster.strategy.extended.finish(timeout=2)  # worker:1 never pushed
        assert lost == ["worker:1"]
        cluster.aborted = True  # ended: nothing for the cluster's close to finish
    for thread in cluster.threads:  # the chief ended the job: every ps stopped
        assert not thread.is_alive()
