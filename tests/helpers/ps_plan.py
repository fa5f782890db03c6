"""TensorFlow 2.21's recorded parameter-server plan (``tests/golden/ps_plan.json``), and
the same cases answered by csrun.

The golden holds each case's inputs and TF's answer (``tests/golden/record_ps_plan.py``
says how it was recorded): ``call`` cases call a partitioner directly, ``plan`` cases
create variables in a ``ParameterServerStrategy`` scope. This module replays them
through csrun's API, in one place, so that a rewrite of the cluster layer changes
``csrun_call``/``csrun_plan`` here and nothing else:

* ``csrun.core.FixedShardsPartitioner``, ``MinSizePartitioner``, ``MaxSizePartitioner``,
  built with TF's keywords and called as ``partitioner(shape, dtype)`` (a tuple, a torch
  dtype; ``axis=k`` when the case has one);
* ``csrun.core.Partitioner``, the base of a user's own partitioner (a plain function is
  passed as it is where the case says ``plain``);
* ``csrun.core.cluster.plan.ShardingPlan.of(tensors, num_ps, "round_robin", colocate,
  partitioner)`` on meta tensors, read through ``plan.shards_of(i)`` (``shard.rows``,
  ``shard.ps``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

import csrun.core as cs

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "ps_plan.json"
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                "bfloat16": torch.bfloat16, "int8": torch.int8, "int32": torch.int32,
                "int64": torch.int64, "bool": torch.bool}
REFUSALS = ("ValueError", "TypeError")  # a clear refusal where TF crashes


@functools.cache
def golden() -> dict:
    """The recorded file: ``meta`` (TF's version, the date) and ``cases``."""
    return json.loads(GOLDEN.read_text())


def cases(kind: str) -> list[dict]:
    return [case for case in golden()["cases"] if case["kind"] == kind]


def _constant(spec: dict):
    value = spec["value"]

    def constant(shape, dtype, **kwargs):
        if value is None:
            return None
        return tuple(value) if spec["tuple"] else list(value)
    return constant


def make_partitioner(spec: dict | None, calls: list | None = None):
    """csrun's partitioner for a golden spec (None: none); ``calls`` gets the shape of
    every call made to it."""
    if spec is None:
        return None

    def noted(function):
        def call(shape, dtype, **kwargs):
            if calls is not None:
                calls.append(list(shape))
            return function(shape, dtype, **kwargs)
        return call

    if "custom" in spec:
        constant = noted(_constant(spec))
        if spec["plain"]:
            return constant
        return type("Constant", (cs.Partitioner,),
                    {"__call__": lambda self, shape, dtype, **kw: constant(shape, dtype, **kw)})()
    cls = getattr(cs, spec["class"])
    # a subclass that notes each call: the class's other methods all still run
    noting = type(cls.__name__, (cls,), {"__call__": lambda self, shape, dtype, **kw: noted(
        functools.partial(cls.__call__, self))(shape, dtype, **kw)})
    return noting(**spec["kwargs"])


def error(exc: Exception) -> dict:
    return {"error": type(exc).__name__, "message": str(exc)}


def csrun_call(case: dict) -> dict:
    """A partitioner called directly: its result, or the error (construction or call)."""
    try:
        partitioner = make_partitioner(case["partitioner"])
        kwargs = {} if case["axis"] is None else {"axis": case["axis"]}
        return {"result": list(partitioner(tuple(case["shape"]),
                                           TORCH_DTYPES[case["dtype"]], **kwargs))}
    except Exception as exc:  # noqa: BLE001 -- compared with TF's error
        return error(exc)


def csrun_plan(case: dict) -> dict:
    """The case's variables planned over ``num_ps`` ps tasks: each one's shards (shape,
    ps) and the partitioner's calls, or the error."""
    from csrun.core.cluster.plan import ShardingPlan
    calls: list = []
    try:
        partitioner = make_partitioner(case["partitioner"], calls)
        specs = case["variables"]
        tensors = [torch.empty(v["shape"], dtype=TORCH_DTYPES[v["dtype"]], device="meta")
                   for v in specs]
        colocate = {i: v["colocate_with"] for i, v in enumerate(specs)
                    if v["colocate_with"] is not None}
        plan = ShardingPlan.of(tensors, case["num_ps"], "round_robin", colocate, partitioner)
        variables = [[{"shape": [s.rows, *v["shape"][1:]] if v["shape"] else [], "ps": s.ps}
                      for s in plan.shards_of(i)] for i, v in enumerate(specs)]
    except Exception as exc:  # noqa: BLE001
        return error(exc)
    return {"variables": variables, "calls": calls}


def same_numbers(got, expected) -> bool:
    """Equal, and ints where TF has ints (2.0 is not TF's 2, nor True its 1)."""
    if isinstance(expected, list):
        return isinstance(got, (list, tuple)) and len(got) == len(expected) and all(
            same_numbers(g, e) for g, e in zip(got, expected))
    return type(got) is type(expected) and got == expected


def check_error(got: dict, tf: dict) -> None:
    """TF refused: csrun must too, with TF's type, or a clear one where TF crashed."""
    expected = tf["error"]
    assert "error" in got, f"TF refuses ({expected['type']}: {expected['message']}); " \
                           f"csrun gives {got}"
    if expected["crash"]:
        assert got["error"] in REFUSALS, (
            f"TF crashes ({expected['type']}: {expected['message']}); csrun must refuse "
            f"clearly, not {got['error']}: {got['message']}")
    else:
        assert got["error"] == expected["type"], (
            f"TF raises {expected['type']}: {expected['message']}; csrun {got['error']}: "
            f"{got['message']}")


def check(got: dict, tf: dict, kind: str) -> None:
    """csrun's answer ``got`` is TF's: raises AssertionError saying how it is not."""
    if "error" in tf:
        return check_error(got, tf)
    assert "error" not in got, f"TF gives {tf}; csrun raises {got['error']}: {got['message']}"
    if kind == "call":
        assert same_numbers(got["result"], tf["result"]), \
            f"TF returns {tf['result']}, csrun {got['result']}"
        return
    assert got["variables"] == tf["variables"], \
        f"TF places {tf['variables']}, csrun {got['variables']}"
    assert got["calls"] == tf["calls"], \
        f"TF asks its partitioner about {tf['calls']}, csrun about {got['calls']}"
