"""Issues 4, 13, 14, 25, 26 and 36's targets, and how a noisy run's figures are judged against them.

A median of paired ratios from one run moves by ±0.05 on a VM whose speed swings ~1.6x
within seconds, so a bare median cannot say whether a target is met. Each median comes
with a distribution-free 95% confidence interval (order statistics of the rounds: no
noise model and no resampling, only the assumption that rounds are independent draws
around one median -- which a VM drifting between phases strains, see
docs/performance.md), and the verdict
reads the interval: ``met`` when all of it clears the target, ``missed`` when none of it
does, ``inconclusive`` when the run cannot tell (more rounds narrow it).
"""

from __future__ import annotations

import math
import statistics
from typing import Sequence

# (model, variant) -> the least median ratio csrun / plain PyTorch the issue asks for
RATIO_TARGETS = {("mlp", "csrun_R1"): 0.97, ("mlp", "csrun_R2"): 0.95,
                 ("mlp", "csrun_R4"): 0.90}
OVERHEAD_TARGET_US = {"R2": 50.0}  # the most µs per empty step the issue allows
# issue 36: an empty run + reduce, best of 7 rounds of 1,000 steps, on the 2-core VM (µs)
OVERHEAD_BEST_TARGET_US = {"R1": 10.0, "R2": 25.0}
# issue 36: one GPU replica with its parameters on the GPU / plain PyTorch on that GPU
GPU_REPLICA_TARGET = 0.97
# TensorFlow's CentralStorageStrategy on the same MLP, batch and 2-core VM (issue 14)
TF_CSS_MLP_EXAMPLES_PER_S = 31_000
# the user's plain loop after csrun ran in its process, against a process without csrun
PLAIN_AFTER_CSRUN_TARGET = 0.97
# issue 25: the plain loop through csrun.core.DataParallel on 2 logical CPU replicas /
# plain PyTorch (MLP)
DATA_PARALLEL_TARGET = 0.85
# issue 13: the runner's step / the hand-written library loop's, for a user model
RUNNER_OVERHEAD_TARGET = 1.05
# a soak's step time late in the run / early after the warm-up, each in reference steps
SOAK_SLOWDOWN_TARGET = 1.5
# issue 36: replicas of unequal speed, balanced split / the fastest replica alone
BATCH_SPLIT_TARGET = 1.0
# the most seconds csrun validate may take to refuse one bad config (docs/reliability.md)
BAD_CONFIG_LIMIT_S = 10.0
# the most seconds a shipped CPU config may take from the command line (README: quickstart
# "under a minute on 2 CPU cores")
SHIPPED_CONFIG_LIMIT_S = 60.0


def median_interval(values: Sequence[float], confidence: float = 0.95) -> tuple | None:
    """A confidence interval for the median of ``values``: ``(low, high)`` or None.

    The k-th smallest and k-th largest values, with k the largest rank at which the
    chance that k or fewer of n draws fall below the true median (a fair coin per draw)
    stays within (1 - confidence) / 2 on each side. None when n is too small for any
    interval at that confidence (fewer than 6 values at 95%).
    """
    n = len(values)
    tail = (1.0 - confidence) / 2
    cumulative, k = 0.0, 0
    while k < n:
        cumulative += math.comb(n, k) / 2 ** n  # P(exactly k values below the median)
        if cumulative > tail:
            break
        k += 1
    if k == 0:
        return None
    ordered = sorted(values)
    return ordered[k - 1], ordered[n - k]


def verdict(interval: tuple | None, target: float, at_least: bool) -> str:
    """``met``, ``missed`` or ``inconclusive`` (or ``too few rounds`` without an interval)."""
    if interval is None:
        return "too few rounds"
    low, high = interval
    if at_least:
        return "met" if low >= target else "missed" if high < target else "inconclusive"
    return "met" if high < target else "missed" if low >= target else "inconclusive"


def judge(result: dict) -> list[dict]:
    """Every target this run measured, with its median, interval and verdict."""
    out = []
    for (model, variant), target in RATIO_TARGETS.items():
        entry = result["models"].get(model, {}).get(variant)
        if entry is not None:
            interval = entry.get("ratio_ci95")
            out.append({"what": f"{model} {variant} / plain", "target": f">= {target}",
                        "median": entry["ratio_vs_plain"], "ci95": interval,
                        "verdict": verdict(interval, target, at_least=True)})
    for replicas, limit in OVERHEAD_TARGET_US.items():
        rounds = result.get("engine_overhead_rounds_us", {}).get(replicas)
        if rounds:
            interval = median_interval(rounds)
            out.append({"what": f"engine overhead {replicas} (µs per step)",
                        "target": f"< {limit}", "median": statistics.median(rounds),
                        "ci95": interval, "verdict": verdict(interval, limit, at_least=False)})
    for replicas, limit in OVERHEAD_BEST_TARGET_US.items():
        best = result.get("engine_overhead_best_us", {}).get(replicas)
        if best is not None:  # a best round, not a median: no interval to read
            rounds = len(result["engine_overhead_rounds_us"][replicas])
            out.append({"what": f"engine overhead {replicas}, best of {rounds} rounds "
                                f"(µs per step)", "target": f"<= {limit}", "median": best,
                        "stat": "best", "ci95": None,
                        "verdict": "met" if best <= limit else "missed"})
    check = result.get("plain_after_csrun")
    if check:
        interval = check["ratio_ci95"]
        out.append({"what": "plain loop after csrun / alone", "target":
                    f">= {PLAIN_AFTER_CSRUN_TARGET}", "median": check["ratio"], "ci95": interval,
                    "verdict": verdict(interval, PLAIN_AFTER_CSRUN_TARGET, at_least=True)})
    return out
