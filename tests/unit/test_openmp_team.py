"""Concurrent CPU replicas run as the caller's OpenMP team (csrun.core.distribute.openmp_team)."""

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.nn.functional as F

import csrun.core as cs
from csrun.core.distribute.openmp_team import find_team
from csrun.core.distribute.replica_run import ExecutionPolicy

team = find_team()
needs_team = pytest.mark.skipif(team is None, reason="torch here does not run on GNU OpenMP")


def _strategy(n=2, execution="concurrent"):
    return cs.CentralStorageStrategy([f"CPU:{i}" for i in range(n)], "CPU:0",
                                     options=cs.StrategyOptions(execution=execution))


def _threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


@pytest.fixture
def two_threads():
    """Each of 2 replicas gets one intra-op thread: the case the team serves."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def ctrl_c_raises():
    """SIGINT raises KeyboardInterrupt, as in a Python started from a terminal. A process
    started in the background by a shell without job control (a CI runner's script,
    ``cmd &``, ``nohup``) inherits SIGINT ignored, and Python keeps it so: the signal
    these tests send would then be dropped and nothing raised."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    # Garbage left by earlier tests, collected while the signal's KeyboardInterrupt is
    # raised, runs weakref callbacks that swallow it ("Exception ignored in: WeakSet
    # ._remove"): collected first, and not during the test.
    gc.collect()
    gc.disable()
    yield
    gc.enable()
    signal.signal(signal.SIGINT, previous)


@needs_team
@pytest.mark.xfail(tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
                   < (2, 5), strict=True,
                   reason="torch 2.4's own libgomp ends one idle team thread and starts "
                          "another at each run (the replicas still run as the team)")
def test_replicas_run_as_the_team_and_add_no_thread(two_threads):
    strategy = _strategy()
    torch.ones(1 << 18).sum()  # the caller's team exists, as after any torch op

    def where():
        cs.get_replica_context().all_reduce("SUM", torch.tensor(1.0))
        return [threading.get_native_id(), team.in_parallel(), torch.get_num_threads()]
    before = _threads()
    first, second = strategy.experimental_local_results(strategy.run(where))
    assert _threads() == before  # replica 1 ran on a thread OpenMP already had
    assert first[0] == threading.get_native_id() and second[0] != first[0]
    assert first[1:] == second[1:] == [True, 1]


@needs_team
def test_more_intra_op_threads_than_replicas_keep_worker_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(4)  # a share of 2 each: replicas need teams of their own
    try:
        strategy = _strategy()
        inside = strategy.experimental_local_results(
            strategy.run(lambda: torch.tensor(team.in_parallel())))
    finally:
        torch.set_num_threads(before)
    assert [bool(v) for v in inside] == [False, False]


@needs_team
def test_a_short_team_hands_its_missing_members_to_threads():
    # A region inside a region gets one thread; members must still all run at once
    # (they may wait for each other), so member 0 starts the rest on spare threads.
    met = threading.Barrier(2, timeout=10)
    seen = []

    def spare(index, member):
        seen.append(index)
        threading.Thread(target=member).start()

    def inner():
        assert team.run([met.wait, met.wait], spare) == ([], None)
    assert team.run([inner, lambda: None], spare) == ([], None)
    assert seen == [1]


@needs_team
def test_a_member_that_raises_is_reported_with_those_never_started():
    def boom():
        raise KeyboardInterrupt  # as a Ctrl-C landing in member 0

    missed, error = team.run([boom, lambda: None, lambda: None],
                             spare=lambda i, m: threading.Thread(target=m).start(), size=2)
    assert missed == [] and isinstance(error, KeyboardInterrupt)


def _gradients(strategy):
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                    torch.nn.Linear(64, 10))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)
    dist = iter(strategy.experimental_distribute_dataset([(x, y)]))

    def step(xs, ys):
        loss = cs.compute_average_loss(F.cross_entropy(model(xs), ys, reduction="none"))
        loss.backward()
        return loss.detach()
    losses = strategy.run(step, args=next(dist))
    return ([p.grad.clone() for p in model.parameters()],
            [float(v) for v in strategy.experimental_local_results(losses)])


@needs_team
def test_results_equal_worker_threads_bit_for_bit(two_threads, monkeypatch):
    team_grads, team_losses = _gradients(_strategy())
    again_grads, again_losses = _gradients(_strategy())
    monkeypatch.setattr(ExecutionPolicy, "team", lambda self: None)
    thread_grads, thread_losses = _gradients(_strategy())
    assert team_losses == again_losses == thread_losses
    for a, b, c in zip(team_grads, again_grads, thread_grads):
        assert torch.equal(a, b) and torch.equal(a, c)


@needs_team
@pytest.mark.timeout(60)
def test_ctrl_c_while_the_team_runs_is_raised_after_it(two_threads, ctrl_c_raises):
    # Sent from replica 1, so it lands in the caller at any point of member 0: inside
    # replica 0, in its wait, or as the member is entered (ctypes would print that one
    # and go on; the run then waited forever for a replica 0 that never ran). Repeated:
    # where it lands is up to the scheduler.
    strategy = _strategy()
    for _ in range(5):
        finished = []

        def slow(finished=finished):
            if cs.get_replica_context().replica_id_in_sync_group == 1:
                os.kill(os.getpid(), signal.SIGINT)  # from inside: it cannot come late
                time.sleep(0.2)
                finished.append(1)
        with pytest.raises(KeyboardInterrupt):
            strategy.run(slow)
        assert finished == [1]  # raised once replica 1 had stopped, not while it ran
    again = strategy.run(lambda: torch.tensor(cs.get_replica_context().replica_id_in_sync_group))
    assert [int(v) for v in strategy.experimental_local_results(again)] == [0, 1]


@needs_team
@pytest.mark.timeout(60)
def test_ctrl_c_while_replicas_beside_the_team_run_is_raised_after_them(two_threads,
                                                                         ctrl_c_raises):
    # 4 replicas on 2 threads: 0 and 1 are the region, 2 and 3 run on threads beside
    # it and are waited for in Python after the region ended. A Ctrl-C there escaped
    # while replica 3 still ran user code (found in review).
    strategy = _strategy(4)
    for _ in range(3):
        finished = []

        def slow(finished=finished):
            if cs.get_replica_context().replica_id_in_sync_group == 3:
                time.sleep(0.1)  # the region has ended: the caller waits in Python
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)
                finished.append(1)
        with pytest.raises(KeyboardInterrupt):
            strategy.run(slow)
        assert finished == [1]


@needs_team
@pytest.mark.timeout(60)
def test_ctrl_c_before_the_region_starts_stops_the_run(two_threads, monkeypatch):
    # A signal landing in the team's own code before any member started: nothing runs,
    # so nothing may be waited for (the run then hung until a second Ctrl-C).
    strategy = _strategy()
    strategy.run(lambda: None)

    def interrupted(_member, _size):
        raise KeyboardInterrupt
    monkeypatch.setattr(team.omp, "parallel", interrupted)
    with pytest.raises(KeyboardInterrupt):
        strategy.run(lambda: time.sleep(0.01))
    monkeypatch.undo()
    again = strategy.run(lambda: torch.tensor(cs.get_replica_context().replica_id_in_sync_group))
    assert [int(v) for v in strategy.experimental_local_results(again)] == [0, 1]


def _mkl_threads() -> int:
    for line in torch.__config__.parallel_info().splitlines():
        if "mkl_get_max_threads()" in line:
            return int(line.split(":")[-1])
    pytest.skip("torch here has no MKL")


@needs_team
def test_the_callers_thread_counts_come_back_after_the_team(two_threads):
    # Replica 0 runs on the caller inside the region, where its one-thread share set
    # MKL's count for this thread and torch's for new threads; the region's end hides
    # that from torch.get_num_threads(), and the user's own matrix products then ran on
    # one thread (0.7x plain).
    strategy = _strategy()
    strategy.run(lambda: torch.ones(8, 8) @ torch.ones(8, 8))
    assert _mkl_threads() == 2
    seen = []
    fresh = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    fresh.start()
    fresh.join()
    assert seen == [2]


@needs_team
@pytest.mark.timeout(30)
def test_replicas_beyond_the_team_run_beside_it_and_meet_it(two_threads):
    # 4 replicas on 2 intra-op threads: a region of 2 (no OpenMP thread added), the other
    # 2 on worker threads; all four meet in one all_reduce
    strategy = _strategy(4)

    def where():
        total = cs.get_replica_context().all_reduce("SUM", torch.tensor(1.0))
        return torch.tensor([float(team.in_parallel()), float(total)])
    rows = [v.tolist() for v in strategy.experimental_local_results(strategy.run(where))]
    assert rows == [[1.0, 4.0], [1.0, 4.0], [0.0, 4.0], [0.0, 4.0]]


# -- which libgomp, and after fork --------------------------------------------------------
def _python(code: str, **env) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **env})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.process  # starts a fresh interpreter
@needs_team
@pytest.mark.parametrize("loaded", ["before torch", "after torch"])
def test_the_team_is_torchs_libgomp_when_another_copy_is_loaded(tmp_path, loaded):
    # Another wheel's libgomp (its own soname) in the same process: its regions are
    # invisible to torch's kernels, which then start teams of their own beside the
    # replicas. Loaded after torch it maps below torch's copy, where the first libgomp
    # in /proc/self/maps used to be taken.
    original = open(team.omp.path, "rb").read()
    assert original.count(b"libgomp.so.1\0") == 1
    other = tmp_path / "libgomp-other.so.1"
    other.write_bytes(original.replace(b"libgomp.so.1\0", b"libgomx.so.1\0"))
    out = _python(f"""
        import ctypes, os
        if {loaded == "before torch"}:
            ctypes.CDLL({str(other)!r})
        import torch
        ctypes.CDLL({str(other)!r})
        from csrun.core.distribute.openmp_team import find_team
        mapped = {{line.split()[-1] for line in open("/proc/self/maps") if "libgomp" in line}}
        team = find_team()
        torch.set_num_threads(2)
        torch.ones(1 << 22).sum()
        threads = len(os.listdir("/proc/self/task"))
        team.run([lambda: torch.ones(1 << 22).sum()] * 2, spare=None)
        print(len(mapped), team.omp.path, len(os.listdir("/proc/self/task")) - threads)
    """)
    assert out.split() == ["2", team.omp.path, "0"]


@pytest.mark.process  # forks
@needs_team
def test_a_forked_child_finds_the_team_again():
    out = _python("""
        import os
        from csrun.core.distribute import openmp_team
        parent = openmp_team.find_team()
        for turn_off in (False, True):
            pid = os.fork()
            if pid == 0:  # the child: what it finds is its own
                if turn_off:
                    os.environ["CSRUN_OPENMP_TEAM"] = "0"
                team = openmp_team.find_team()
                ok = team is None if turn_off else (team is not parent
                                                    and team.omp.path == parent.omp.path)
                os._exit(0 if ok else 1)
            print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        print(openmp_team.find_team() is parent)
    """)
    assert out.split() == ["0", "0", "True"]


@pytest.mark.process  # starts a fresh interpreter
def test_nothing_is_registered_for_fork_until_the_team_is_first_looked_for():
    out = _python("""
        import os
        import torch  # torch's own imports register some (logging, random)
        calls = []
        real = os.register_at_fork
        os.register_at_fork = lambda **kw: (calls.append(kw), real(**kw))
        import csrun.core
        from csrun.core.distribute import openmp_team
        print(len(calls))
        openmp_team.find_team()
        openmp_team.find_team()
        print(len(calls))
    """)
    assert out.split() == ["0", "1"]
