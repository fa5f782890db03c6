"""The benchmark's confidence intervals and target verdicts (benchmarks/targets.py)."""

import importlib.util
import math
import random
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "targets.py"
_spec = importlib.util.spec_from_file_location("csrun_benchmark_targets", _PATH)
targets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(targets)


def _below(n: int, k: int) -> float:
    """P(at most k of n fair coins come up heads)."""
    return sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n


@pytest.mark.parametrize("n, ranks", [(6, (1, 6)), (10, (2, 9)), (15, (4, 12)),
                                      (31, (10, 22)), (41, (14, 28))])
def test_interval_uses_the_textbook_ranks(n, ranks):
    values = [float(v) for v in random.Random(n).sample(range(1000), n)]
    ordered = sorted(values)
    assert targets.median_interval(values) == (ordered[ranks[0] - 1], ordered[ranks[1] - 1])


@pytest.mark.parametrize("n", [6, 7, 12, 21, 31, 60, 101])
def test_interval_is_the_narrowest_with_95_percent_coverage(n):
    low, _ = targets.median_interval(list(range(n)))
    k = int(low) + 1  # the rank of the lower bound
    assert _below(n, k - 1) <= 0.025 < _below(n, k)  # k is valid and k + 1 would not be


def test_too_few_values_give_no_interval():
    assert targets.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    assert targets.median_interval([]) is None
    assert targets.verdict(None, 0.95, at_least=True) == "too few rounds"


def test_interval_covers_the_true_median_about_95_percent_of_the_time():
    rng = random.Random(0)
    hits = sum(lo <= 0.0 <= hi for lo, hi in
               (targets.median_interval([rng.gauss(0, 1) for _ in range(31)])
                for _ in range(2000)))
    assert 0.94 <= hits / 2000 <= 0.995


@pytest.mark.parametrize("interval, expected", [((0.96, 0.99), "met"), ((0.95, 0.99), "met"),
                                                ((0.90, 0.949), "missed"),
                                                ((0.93, 0.95), "inconclusive"),
                                                ((0.93, 0.97), "inconclusive")])
def test_verdict_for_at_least_targets(interval, expected):
    assert targets.verdict(interval, 0.95, at_least=True) == expected


@pytest.mark.parametrize("interval, expected", [((40.0, 49.9), "met"), ((50.0, 60.0), "missed"),
                                                ((45.0, 50.0), "inconclusive"),
                                                ((45.0, 55.0), "inconclusive")])
def test_verdict_for_at_most_targets(interval, expected):
    assert targets.verdict(interval, 50.0, at_least=False) == expected


def test_judge_reads_a_result():
    ratios = {"ratio_vs_plain": 0.96, "ratio_ci95": (0.955, 0.97)}
    result = {"models": {"mlp": {"plain": {}, "csrun_R2": ratios}},
              "engine_overhead_rounds_us": {"R1": [20.0] * 9, "R2": [60.0 + i for i in range(9)]}}
    judged = {t["what"]: t for t in targets.judge(result)}
    assert set(judged) == {"mlp csrun_R2 / plain", "engine overhead R2 (µs per step)"}
    assert judged["mlp csrun_R2 / plain"]["verdict"] == "met"
    overhead = judged["engine overhead R2 (µs per step)"]
    assert overhead["median"] == 64.0 and overhead["verdict"] == "missed"


def test_judge_reads_the_engine_cost_as_a_best_round():
    """Issue 36 asks the best of 7 rounds of 1,000 empty steps: met or missed, no interval."""
    result = {"models": {},
              "engine_overhead_rounds_us": {"R1": [9.5, 12.0] + [11.0] * 5,
                                            "R2": [26.0, 30.0] + [28.0] * 5},
              "engine_overhead_best_us": {"R1": 9.5, "R2": 26.0}}
    judged = {t["what"]: t for t in targets.judge(result)}
    r1 = judged["engine overhead R1, best of 7 rounds (µs per step)"]
    r2 = judged["engine overhead R2, best of 7 rounds (µs per step)"]
    assert (r1["verdict"], r1["target"], r1["ci95"]) == ("met", "<= 10.0", None)
    assert (r2["verdict"], r2["median"]) == ("missed", 26.0)
