"""The cluster transport's waits, in one process: a call given up on is counted while it
is still in native code (the CLI then leaves by ``os._exit``: a daemon thread returning
from torch's C++ while the interpreter finalizes aborted the process, exit 134), and an
unreachable store is told from a frozen one."""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time

import pytest

from csrun.core.cluster import transport
from csrun.core.cluster.transport import (BoundedStore, Caller, JobAborted,
                                          ParameterServerError, Stopped, bounded,
                                          calls_running, unreachable)
from csrun.core.runner.launch import free_ports


def test_a_call_given_up_on_counts_as_running_until_it_returns():
    before, release = calls_running(), threading.Event()
    with pytest.raises(ParameterServerError, match="a test call did not answer within 0.2 s"):
        bounded(release.wait, 0.2, "a test call")
    assert calls_running() == before + 1
    release.set()
    deadline = time.monotonic() + 10
    while calls_running() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls_running() == before


def test_a_wait_that_hears_the_job_ended_raises_its_reason_and_gives_the_call_up():
    """A channel whose ps stopped after the job's failure is never made: the wait asks
    whether the job ended, now and then, and ends with the reason."""
    caller, release, asked = Caller("a test caller"), threading.Event(), []

    def ended():
        asked.append(True)
        return "the chief ended the job: worker:0 failed" if len(asked) == 2 else None
    with pytest.raises(JobAborted, match="^the chief ended the job: worker:0 failed$"):
        caller.wait(caller.submit(release.wait), 60, "ps:0's channel", ended=ended)
    assert len(asked) == 2
    with pytest.raises(ParameterServerError, match="still busy with a call given up on"):
        caller.submit(lambda: None)  # the thread is still in the call given up on
    release.set()


def test_a_wait_whose_call_answers_gives_its_value_whatever_the_job_says():
    caller, asked = Caller("a test caller"), []
    assert caller.wait(caller.submit(lambda: 7), 60, "a call",
                       ended=lambda: asked.append(True)) == 7


@contextlib.contextmanager
def _listening(answer):
    """A server on a free port that calls ``answer(connection)`` for each connection."""
    server = socket.create_server(("127.0.0.1", free_ports(1)[0]))
    held = []

    def serve():
        with contextlib.suppress(OSError):
            while True:
                connection, _ = server.accept()
                held.append(connection)
                answer(connection)
    threading.Thread(target=serve, daemon=True).start()
    try:
        yield server.getsockname()[1]
    finally:
        server.close()
        for connection in held:
            connection.close()


def _reset(connection):
    connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        connection.recv(10)
    connection.close()


def test_nothing_listening_is_connection_refused():
    assert "nothing accepts connections there (connection refused)" in \
        unreachable("127.0.0.1", free_ports(1)[0])


def test_a_program_that_resets_is_not_a_store():
    with _listening(_reset) as port:
        assert "accepts connections and closes them" in unreachable("127.0.0.1", port)


def test_a_program_that_speaks_first_is_not_a_store():
    with _listening(lambda connection: connection.sendall(b"SSH-2.0\r\n")) as port:
        assert "answered what a store would not" in unreachable("127.0.0.1", port)


def test_a_silent_peer_is_not_unreachable_but_frozen():
    with _listening(lambda connection: None) as port:
        assert unreachable("127.0.0.1", port) is None


def test_a_bounded_store_hearing_a_signal_gives_up_a_frozen_call_at_once():
    """The job's store answers every call within ``strategy.timeout_s`` or fails; a view
    that hears ``stop`` gives a frozen call up as soon as the signal comes (Stopped), and
    a store without one still waits (a task stopping cleanly keeps its books)."""
    class Frozen:  # a store that takes the call and never answers
        def __init__(self):
            self.release, self.calls = threading.Event(), 0

        def check(self, keys):
            self.calls += 1
            stop.set()  # the signal comes while the call is in the store
            self.release.wait()
            return True

    stop, raw = threading.Event(), Frozen()
    store = BoundedStore(raw, 3600, "a frozen store")
    try:
        with pytest.raises(Stopped, match="a frozen store"):
            store.hearing(stop).check(["job/done"])
        assert raw.calls == 1
        with pytest.raises(ParameterServerError, match="still busy with a call given up on"):
            store.check(["job/done"])  # one connection: its thread is still in that call
    finally:
        raw.release.set()


def test_a_long_poll_asks_less_and_less_often_up_to_its_most():
    """An idle ps asks the store for joins and the job's end at most every
    ``IDLE_POLL_S`` (it asked every 20 ms: 2 idle ps cost 5% of a core)."""
    slept, asked = [], []
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transport.time, "sleep", slept.append)
        assert transport.poll_until(lambda: len(asked.append(1) or asked) > 12, poll=0.02,
                                    most=0.2)
    assert slept[0] == 0.02 and slept[-1] == 0.2 and slept == sorted(slept)
    assert len(slept) == 12 and sum(s < 0.2 for s in slept) == 6
