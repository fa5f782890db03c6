"""Parameter servers serving in threads of the test's process (loopback), and one
worker's strategy: ps jobs tested through the library without starting processes."""

import threading

from csrun.core import ParameterServerStrategy
from csrun.core.cluster.resolvers import SimpleClusterResolver
from csrun.core.cluster.server import ParameterServer
from csrun.core.cluster.transport import JobAborted
from csrun.core.runner.launch import free_ports


class Cluster:
    """``ps`` ps tasks serving in threads (``servers``), and worker:0's ``strategy`` (the
    chief) of a job of ``workers`` workers (the others are the test's to start)."""

    def __init__(self, ps: int, workers: int = 1, **kwargs):
        ports = free_ports(ps + workers)
        self.spec = {"worker": [f"127.0.0.1:{p}" for p in ports[:workers]],
                     "ps": [f"127.0.0.1:{p}" for p in ports[workers:]]}
        self.servers, self.threads = [None] * ps, []
        ready = [threading.Event() for _ in range(ps)]
        for k in range(ps):
            thread = threading.Thread(target=self._serve, args=(k, ready[k]), daemon=True)
            thread.start()
            self.threads.append(thread)
        for event in ready:
            event.wait(60)
        self.strategy = ParameterServerStrategy(cluster_spec=self.spec, task_type="worker",
                                                task_id=0, timeout=60, **kwargs)

    def _serve(self, k: int, ready: threading.Event) -> None:
        self.servers[k] = ParameterServer(SimpleClusterResolver(self.spec, "ps", k),
                                          timeout=60, chief="worker:0")
        ready.set()
        try:
            self.servers[k].serve()
        except JobAborted as exc:  # the job was ended after a failure (abort())
            self.ended_why = str(exc)

    def abort(self, reason: str) -> None:
        """End the job after a failure, as the chief does: every ps stops with it."""
        self.strategy.extended.abort(reason)
        self.aborted = True
        for thread in self.threads:
            thread.join(timeout=30)

    def close(self) -> None:
        if not getattr(self, "aborted", False):
            self.strategy.extended.finish(timeout=30)
        for thread in self.threads:
            thread.join(timeout=30)

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
