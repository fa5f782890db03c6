"""csrun's parameter-server plan against TensorFlow 2.21's, case by recorded case.

``tests/golden/ps_plan.json`` holds what TF 2.21 did (recorded by
``tests/golden/record_ps_plan.py``, which says how): its partitioners called directly
(``call`` cases) and the shards, ps tasks and partitioner calls of variables created in a
``ParameterServerStrategy`` scope (``plan`` cases: round-robin placement,
``colocate_vars_with``, Fixed/MinSize/MaxSize and custom partitioners, scalars, zero-
and one-row variables). Each case is replayed through csrun (``tests/helpers/ps_plan.py``
names the API it calls) and must give TF's answer: the same result, or shards on the
same ps tasks after the same partitioner calls; where TF raises one of its own checks,
the same exception type (messages are csrun's own); where TF crashes on an input it
does not check (``crash`` in the golden), a ``ValueError`` or ``TypeError``.

The cases where csrun answers otherwise on purpose are ``DEVIATIONS``, each one a row
of docs/tf-parity.md: for them the test asserts csrun's documented answer (and that it
is not TF's, so that an entry cannot outlive its deviation). There are no xfails here:
a case that differs and is not a deviation fails.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Callable

import pytest

from tests.helpers.ps_plan import cases, check, csrun_call, csrun_plan, golden

PARITY_DOC = Path(__file__).resolve().parents[2] / "docs" / "tf-parity.md"
ANSWER = {"call": csrun_call, "plan": csrun_plan}


@dataclasses.dataclass(frozen=True)
class Deviation:
    """A documented deviation: its row in docs/tf-parity.md (``row``, text it starts
    with), why csrun chose it, and csrun's answer for a case (``answer(case)``)."""

    row: str
    reason: str
    answer: Callable[[dict], dict]

    def cases(self, ids: list[str]) -> dict[str, "Deviation"]:
        return {case_id: self for case_id in ids}


def _refused(error: str, message: str) -> Callable[[dict], dict]:
    return lambda case: {"error": error, "message": message}


def _on_targets_ps(case: dict) -> dict:
    """TF's answer with the coordinator ('chief') replaced by the ps of the colocated
    variable's target (its first shard)."""
    answer = copy.deepcopy(case["tf"])
    for index, spec in enumerate(case["variables"]):
        if spec["colocate_with"] is not None:
            target = answer["variables"][spec["colocate_with"]][0]["ps"]
            for shard in answer["variables"][index]:
                shard["ps"] = target
    return answer


# TF keeps any count and fails only when a variable is made (range() of 2.5: a TypeError;
# 2.0 too); csrun refuses a count that is not an int when the partitioner is built
NOT_A_COUNT = Deviation(
    "| partitioner counts that are not whole numbers |",
    "FixedShardsPartitioner(2.5) or (2.0): TF returns [2.5, 1] and fails making a variable "
    "with more rows; csrun refuses the count when the partitioner is built",
    _refused("TypeError", "num_shards must be a whole number"))
# TF builds Fixed(0)/(-1) and returns [0, 1] / [-1, 1]; its strategy then refuses them
# (ValueError, TypeError) when a variable is made; csrun refuses them when built
NOT_POSITIVE = Deviation(
    "| partitioner counts that are not whole numbers |",
    "FixedShardsPartitioner(0) or (-1): TF builds it and refuses it at the first "
    "variable; csrun refuses it when built",
    _refused("ValueError", "num_shards must be at least 1"))
# TF 2.21's eager colocate_with reads a ShardedVariable's device on the coordinator and
# creates the colocated variable there, outside every ps; csrun keeps it on a ps, with
# its target's first shard (not counted in the round-robin, as TF)
COLOCATED_WITH_PARTITIONED = Deviation(
    "| colocated with a partitioned variable |",
    "colocated with a partitioned variable: TF puts it on the coordinator ('chief'), "
    "csrun on the ps of the target's first shard",
    _on_targets_ps)

DEVIATIONS: dict[str, Deviation] = {
    **NOT_A_COUNT.cases([
        "call/fixed(2.5)/[10, 3]/float32", "call/fixed(2.5)/[7]/float32",
        "call/fixed(2.5)/[1, 4]/float32", "call/fixed(2.5)/[0, 4]/float32",
        "call/fixed(2.5)/[4, 2, 3]/float32", "call/fixed(2.5)/[2, 5]/float32",
        "call/fixed(2.5)/[4000000, 32]/float32",
        "call/fixed(2.0)/[10, 3]/float32", "call/fixed(2.0)/[7]/float32",
        "call/fixed(2.0)/[1, 4]/float32", "call/fixed(2.0)/[0, 4]/float32",
        "call/fixed(2.0)/[4, 2, 3]/float32", "call/fixed(2.0)/[2, 5]/float32",
        "call/fixed(2.0)/[4000000, 32]/float32",
        "plan/ps2/fixed(2.5)/one_row_only", "plan/ps2/fixed(2.0)/one_row_only"]),
    **NOT_POSITIVE.cases([
        f"call/fixed({n})/{shape}/float32" for n in (0, -1)
        for shape in ("[10, 3]", "[7]", "[1, 4]", "[0, 4]", "[4, 2, 3]", "[2, 5]",
                      "[4000000, 32]")]),
    **COLOCATED_WITH_PARTITIONED.cases([
        "plan/ps2/colocate/fixed(2)/with_partitioned",
        "plan/ps3/colocate/fixed(2)/with_partitioned"]),
}


def _params(kind: str, deviating: bool) -> list:
    return [pytest.param(case, id=case["id"]) for case in cases(kind)
            if (case["id"] in DEVIATIONS) == deviating]


@pytest.mark.parametrize("case", _params("call", deviating=False))
def test_a_partitioner_answers_as_tfs(case):
    check(csrun_call(case), case["tf"], "call")


@pytest.mark.parametrize("case", _params("plan", deviating=False))
def test_variables_are_sharded_and_placed_as_tf_places_them(case):
    check(csrun_plan(case), case["tf"], "plan")


@pytest.mark.parametrize("case", _params("call", True) + _params("plan", True))
def test_a_documented_deviation_gives_csruns_documented_answer(case):
    deviation, got = DEVIATIONS[case["id"]], ANSWER[case["kind"]](case)
    with pytest.raises(AssertionError):  # not TF's answer, or the entry is stale
        check(got, case["tf"], case["kind"])
    expected = deviation.answer(case)
    if "error" in expected:
        assert got.get("error") == expected["error"], (deviation.reason, got)
        assert expected["message"] in got["message"], (deviation.reason, got)
    else:
        check(got, expected, case["kind"])


def test_every_deviation_is_a_row_of_the_parity_doc():
    rows = [line for line in PARITY_DOC.read_text().splitlines() if line.startswith("| ")]
    for deviation in set(DEVIATIONS.values()):
        [row] = [line for line in rows if line.startswith(deviation.row)]
        assert "**deviates**" in row
        assert "test_ps_plan_golden.py::test_a_documented_deviation_gives_csruns_" \
               "documented_answer" in row


def test_the_golden_is_tf_2_21s_and_every_deviation_names_a_case():
    meta = golden()["meta"]
    assert meta["tensorflow"].startswith("2.21.")
    ids = [case["id"] for case in golden()["cases"]]
    assert len(ids) == len(set(ids)) == meta["cases"]
    assert not set(DEVIATIONS) - set(ids), "stale DEVIATIONS entries"


def test_the_comparison_tells_a_moved_variable_and_a_crash_apart():
    [case] = [c for c in cases("plan") if c["id"] == "plan/ps3/colocate/issue_37"]
    moved = copy.deepcopy(case["tf"])
    moved["variables"][3][0]["ps"] = 0
    with pytest.raises(AssertionError, match="TF places"):
        check(moved, case["tf"], "plan")
    crash = {"error": {"type": "ZeroDivisionError", "message": "", "crash": True}}
    with pytest.raises(AssertionError, match="must refuse clearly"):
        check({"error": "IndexError", "message": "x"}, crash, "plan")
    check({"error": "ValueError", "message": "zero rows"}, crash, "plan")
