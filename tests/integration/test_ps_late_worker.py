"""Channels made late or never (issue 39). A worker that starts after the chief ended
the job ends with the chief's reason, read from the job's store, instead of waiting for
channels that the ps tasks, stopping, no longer make, and then finding ps:0 gone
("stopped answering"); one that starts after a normal end says the job already
finished. A worker that dies between its join and its end of a channel leaves each ps
waiting in a rendezvous of that channel's own, its books free; a signal while its
channels are made is heard though the store is frozen."""

import threading

import pytest
import torch

from csrun.core import ParameterServerStrategy
from csrun.core.cluster import server, store_keys as keys
from csrun.core.cluster.coordinator import JobCoordinator
from csrun.core.cluster.transport import JobAborted, JobFinished, Stopped
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
        joining, read, join = [], JobCoordinator.check_open, JobCoordinator.join_servers

        def unseen(self):
            return None if joining else read(self)

        def join_servers(self):
            joining.append(True)
            join(self)
            joining.clear()
        monkeypatch.setattr(JobCoordinator, "check_open", unseen)
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


def test_a_worker_starting_after_the_job_finished_normally_is_told_so_at_once():
    """The chief ended the job normally (DONE, no failure) and the ps tasks stop: a worker
    that starts then says the job already finished, instead of waiting
    ``strategy.timeout_s`` for channels no ps makes and blaming ps:0."""
    with Cluster(2, workers=2) as cluster:
        cluster.strategy.extended.coordinator.store.set(keys.DONE, "1")  # as end_job does
        with pytest.raises(JobFinished, match=r"^the job already finished: the chief ended "
                                              r"it normally before worker:1 joined"):
            _late_worker(cluster)
        assert cluster.strategy.extended.finish(timeout=2) == ["worker:1"]  # never pushed
        cluster.aborted = True  # ended: nothing for the cluster's close to finish


class _Frozen:
    """A store connection that takes every call and never answers; the signal comes
    while the call waits in it (``stop`` is set there)."""

    def __init__(self, stop: threading.Event):
        self.stop, self.release = stop, threading.Event()

    def __getattr__(self, name):
        def call(*args, **kwargs):
            self.stop.set()
            self.release.wait()
            raise RuntimeError("released by the test")
        return call


def test_a_signal_while_a_channel_is_made_is_heard_though_the_store_is_frozen(monkeypatch):
    """While a worker's channels are made it asks the store whether the job ended; with
    the store frozen, a first Ctrl-C or SIGTERM (``stop``) ends the wait at once
    (Stopped: the task reports it stopped while waiting), not after
    ``strategy.timeout_s`` (here 30 s: it said ps:0's channel did not answer)."""
    with Cluster(2, workers=2) as cluster:
        for server in cluster.servers:  # the ps tasks never make this worker's channels
            monkeypatch.setattr(server, "_accept", [].append)
        stop, frozen, join = threading.Event(), [], JobCoordinator.join_servers

        def join_servers(self):  # joined, and then the store freezes
            join(self)
            frozen.append(_Frozen(stop))
            self.store.raw = frozen[0]
        monkeypatch.setattr(JobCoordinator, "join_servers", join_servers)
        try:
            with pytest.raises(Stopped, match="parameter server ps:0"):
                ParameterServerStrategy(cluster_spec=cluster.spec, task_type="worker",
                                        task_id=1, timeout=30, stop=stop)
        finally:
            for store in frozen:
                store.release.set()
        assert stop.is_set()
        assert cluster.strategy.extended.finish(timeout=2) == ["worker:1"]
        cluster.aborted = True
