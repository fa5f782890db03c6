"""The Python functions a call enters, counted by name: the engine's own work per step.

An empty step's cost is Python bookkeeping, so how many functions it enters (and which)
is its work, counted the same on a loaded machine as on a quiet one (issue 36: the
engine's cost per empty step is a benchmark figure; the tests count what it is made of).
Counted on the calling thread only: replicas in order run there.
"""

from __future__ import annotations

import collections
import sys
from typing import Any, Callable


def calls(fn: Callable[[], Any]) -> collections.Counter:
    """``fn()``'s Python function calls (generator and lambda frames included), by
    qualified name, e.g. ``Counter({"ReplicaServing.__init__": 2, ...})``."""
    counted: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            counted[frame.f_code.co_qualname] += 1
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counted
