"""Concurrent CPU replicas as the members of the caller's own OpenMP team.

torch's CPU kernels run on GNU OpenMP (libgomp) on Linux. After every parallel region the
team's idle members spin for a while (up to ~100 ms by default) waiting for the next one.
A plain loop profits: its next matrix product starts at once. Replicas on threads of
their own do not: after the optimizer step, the caller's spinning team members hold the
cores the replicas need, and 2 logical CPU replicas ran at ~0.46x plain PyTorch unless
Python was started with ``OMP_WAIT_POLICY=PASSIVE`` (a setting read once, at start-up,
that also slows plain code).

So, when each replica's share of the cores is one thread, the replicas run *as* that
team: one parallel region of N members, member *i* runs replica *i*. The members that
would spin are the ones doing the work, torch's kernels inside see a parallel region and
run on one thread (as the replica's share asks), and no thread is added to the process,
so OpenMP's settings for the user's own code stay as they were.

libgomp is reached through :class:`.torch_internals.GnuOpenMP` (its ``GOMP_parallel``
entry point, the one GCC emits for ``#pragma omp parallel``): torch exposes no way to run
Python on its team. It is the copy torch's own library was bound to, never another one
loaded first. Where the runtime is another (LLVM's libomp, macOS, Windows)
:func:`find_team` returns None and replicas run on threads of their own, as before.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Callable, Sequence

from . import torch_internals
from .torch_internals import GnuOpenMP

__all__ = ["OpenMPTeam", "find_team"]

_UNSET = object()
_found: object = _UNSET
_finding = threading.Lock()
_forks_watched = False


class OpenMPTeam:
    """Runs callables as the members of one parallel region of the calling thread."""

    def __init__(self, omp: GnuOpenMP):
        self.omp = omp

    def run(self, members: Sequence[Callable[[], None]],
            spare: Callable[[int, Callable[[], None]], None], size: int | None = None
            ) -> tuple[list[int], BaseException | None]:
        """Run every member at once, member 0 on the calling thread; return when all have.

        The region has ``size`` members (default: one per member). Member 0 hands the
        members the region lacks (beyond ``size``, or beyond a smaller team OpenMP gave:
        a region inside another region gets one thread) to ``spare(index, member)``,
        which must start them at once on threads of its own: members may wait for each
        other.

        Returns the members that never started and the first exception a member raised
        (None if none did): a Ctrl-C lands in the main thread at any line, so member 0
        may stop before it started its own member or handed the others on; the caller
        must not wait for those.
        """
        omp, errors, count = self.omp, [], len(members)
        size = count if size is None else min(size, count)
        started = [False] * count

        def member(_data) -> None:
            # Nothing may unwind into C (ctypes would print it and go on); a signal's
            # exception may be raised in the except clause too: hence the second guard.
            try:
                try:
                    index = omp.thread_num()
                    if index == 0:
                        for missing in range(omp.num_threads(), count):
                            started[missing] = True
                            spare(missing, members[missing])
                    if index < count:
                        started[index] = True
                        members[index]()
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        # A signal's exception can also be raised as member 0 is entered, before its
        # first line: ctypes then hands it to sys.unraisablehook, taken back here.
        previous = sys.unraisablehook

        def escaped(unraisable) -> None:
            if unraisable.object is member:
                errors.append(unraisable.exc_value)
            else:
                previous(unraisable)
        try:  # a signal can also land here, as the region begins or after it ended
            try:
                sys.unraisablehook = escaped
                omp.parallel(member, size)
            finally:
                sys.unraisablehook = previous
        except BaseException as exc:  # noqa: BLE001 - reported with the members it missed
            errors.append(exc)
        return [i for i, began in enumerate(started) if not began], \
            (errors[0] if errors else None)

    def in_parallel(self) -> bool:
        return bool(self.omp.in_parallel())


def find_team() -> OpenMPTeam | None:
    """The libgomp that torch runs on, as an :class:`OpenMPTeam`; None where there is
    none (another OpenMP runtime or platform), or ``CSRUN_OPENMP_TEAM=0`` turns it off.

    Found once per process: a child made by ``os.fork`` finds it again (its own
    environment may turn it off, and it must not act on what its parent found)."""
    global _found
    if _found is _UNSET:
        with _finding:
            if _found is _UNSET:
                _watch_forks()
                _found = _load() if os.environ.get("CSRUN_OPENMP_TEAM", "1") != "0" else None
    return _found  # type: ignore[return-value]


def _watch_forks() -> None:
    """Forget the team in a forked child; registered on first use, not at import."""
    global _forks_watched
    if not _forks_watched:
        os.register_at_fork(after_in_child=_forget)
        _forks_watched = True


def _forget() -> None:
    global _found, _finding
    _found = _UNSET
    _finding = threading.Lock()  # the parent may have forked while another thread held it


def _load() -> OpenMPTeam | None:
    omp = torch_internals.torch_gnu_openmp()
    return None if omp is None else OpenMPTeam(omp)
