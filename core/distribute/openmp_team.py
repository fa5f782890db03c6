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

libgomp is reached through ctypes (its ``GOMP_parallel`` entry point, the one GCC emits
for ``#pragma omp parallel``): torch exposes no way to run Python on its team. Where the
runtime is another (LLVM's libomp, macOS, Windows) :func:`find_team` returns None and
replicas run on threads of their own, as before.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Callable, Sequence

import torch

__all__ = ["OpenMPTeam", "find_team"]

_MEMBER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_UNSET = object()
_found: object = _UNSET


class OpenMPTeam:
    """Runs callables as the members of one parallel region of the calling thread."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        lib.GOMP_parallel.argtypes = [_MEMBER, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        lib.GOMP_parallel.restype = None
        for name in ("omp_get_thread_num", "omp_get_num_threads", "omp_in_parallel"):
            getattr(lib, name).restype = ctypes.c_int

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
        lib, errors, count = self._lib, [], len(members)
        size = count if size is None else min(size, count)
        started = [False] * count

        def member(_data) -> None:
            # Nothing may unwind into C (ctypes would print it and go on); a signal's
            # exception may be raised in the except clause too: hence the second guard.
            try:
                try:
                    index = lib.omp_get_thread_num()
                    if index == 0:
                        for missing in range(lib.omp_get_num_threads(), count):
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
            callback = _MEMBER(member)  # kept alive until the region has ended
            try:
                sys.unraisablehook = escaped
                lib.GOMP_parallel(callback, None, size, 0)
            finally:
                sys.unraisablehook = previous
        except BaseException as exc:  # noqa: BLE001 - reported with the members it missed
            errors.append(exc)
        return [i for i, began in enumerate(started) if not began], \
            (errors[0] if errors else None)

    def in_parallel(self) -> bool:
        return bool(self._lib.omp_in_parallel())


def find_team() -> OpenMPTeam | None:
    """The libgomp that torch loaded, as an :class:`OpenMPTeam`; None where there is none
    (another OpenMP runtime or platform), or ``CSRUN_OPENMP_TEAM=0`` turns it off."""
    global _found
    if _found is _UNSET:
        _found = _load() if os.environ.get("CSRUN_OPENMP_TEAM", "1") != "0" else None
    return _found  # type: ignore[return-value]


def _load() -> OpenMPTeam | None:
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    path = _loaded_libgomp()
    if path is None:
        return None
    try:  # RTLD_NOLOAD: the copy torch uses, never a second runtime
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return OpenMPTeam(lib)
    except (OSError, AttributeError):
        return None


def _loaded_libgomp() -> str | None:
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libgomp"):
                    return path
    except OSError:
        pass
    return None
