"""Record TensorFlow 2.21's parameter-server plan: partitioners and variable placement.

Writes ``tests/golden/ps_plan.json``, which ``tests/unit/test_ps_plan_golden.py`` pins
csrun against. Run it with a Python that has TensorFlow (not the project's venv, which
has none):

    python3 -m venv /tmp/tfvenv && /tmp/tfvenv/bin/pip install tensorflow-cpu==2.21.0
    /tmp/tfvenv/bin/python tests/golden/record_ps_plan.py      # about a minute on 2 cores

Two kinds of cases, each with its inputs spelled out in the JSON so that a test can
replay it without TensorFlow:

* ``call``: a partitioner of ``tf.distribute.experimental.partitioners``
  (``FixedShardsPartitioner``, ``MinSizePartitioner``, ``MaxSizePartitioner``) built
  with the given arguments and called with a shape, a dtype and maybe ``axis=``:
  its result, or the error (type, message, and whether construction or the call raised).
* ``plan``: variables created in order in the scope of a
  ``tf.distribute.experimental.ParameterServerStrategy`` over ``num_ps`` in-process ps
  servers (gRPC on loopback), with a ``variable_partitioner`` (one of the above, a custom
  callable returning a fixed result, or none) and some created under
  ``strategy.extended.colocate_vars_with(earlier variable)``: each variable's shards
  (shape, ps task) in row order, every call the strategy made to the partitioner (the
  shapes it was asked about), or the error that stopped the creation (and at which
  variable). A variable colocated with a *partitioned* one lands on the coordinator in
  TF 2.21 (``eager colocate_with`` reads the ShardedVariable there): its ps is "chief".

An error is ``crash: true`` unless it is one of TF's own checks (``DESIGNED``): TF
failing on an input it does not check (an ``IndexError`` indexing a scalar's shape, a
``ZeroDivisionError`` for zero rows, ``range(2.5)``); the test then asks that csrun
refuse that input with a clear ``ValueError`` or ``TypeError`` of its own. String dtypes
are not recorded: torch has none.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().with_name("ps_plan.json")
DTYPES = ["float32", "float64", "float16", "bfloat16", "int8", "int32", "int64", "bool"]


# -- the cases ----------------------------------------------------------------------------
def fixed(n):
    return {"class": "FixedShardsPartitioner", "kwargs": {"num_shards": n}}


def min_size(min_shard_bytes=None, max_shards=None, bytes_per_string=None):
    kwargs = {"min_shard_bytes": min_shard_bytes, "max_shards": max_shards,
              "bytes_per_string": bytes_per_string}
    return {"class": "MinSizePartitioner", "kwargs": {k: v for k, v in kwargs.items()
                                                      if v is not None}}


def max_size(max_shard_bytes, max_shards=None, bytes_per_string=None, none_max=False):
    kwargs = {"max_shard_bytes": max_shard_bytes, "max_shards": max_shards,
              "bytes_per_string": bytes_per_string}
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if none_max:
        kwargs["max_shards"] = None
    return {"class": "MaxSizePartitioner", "kwargs": kwargs}


def custom(value, plain=False, as_tuple=False):
    """A callable that returns ``value`` whatever it is asked (``as_tuple``: a tuple);
    ``plain``: for csrun a bare function rather than a ``Partitioner`` subclass."""
    return {"custom": "constant", "value": value, "tuple": as_tuple, "plain": plain}


def var(shape, dtype="float32", colocate_with=None):
    return {"shape": list(shape), "dtype": dtype, "colocate_with": colocate_with}


def call_cases() -> list[dict]:
    cases = []

    def add(name, partitioner, shape, dtype="float32", axis=None):
        cases.append({"id": f"call/{name}/{list(shape)}/{dtype}" + (
            "" if axis is None else f"/axis={axis}"), "kind": "call",
            "partitioner": partitioner, "shape": list(shape), "dtype": dtype, "axis": axis})

    shapes = [(10, 3), (7,), (1, 4), (0, 4), (), (4, 2, 3), (2, 5), (4_000_000, 32)]
    for n in [1, 2, 3, 5, 0, -1, 2.5, 2.0, "2"]:
        for shape in shapes:
            add(f"fixed({n!r})", fixed(n), shape)
    for shape in [(10, 3), (1, 4), (0, 4), (4, 2, 3), (3,)]:
        for axis in [0, 1, 2]:
            add(f"fixed(2),axis", fixed(2), shape, axis=axis)
    # MinSize: one shard per min_shard_bytes, rounded up, at most max_shards and rows
    grid = [(1, 100), (1.5, 100), (2.5, 100), (4, 2), (4, 10), (7, 3), (16, 4), (64, 100),
            (100, 100), (100.5, 100), (400, 8), (1024, 1000), (256 << 10, 1), (256 << 10, 4),
            (256 << 10, 64), (0.5, 4)]
    for min_bytes, max_shards in grid:
        for shape in [(6, 1), (10, 4), (100,), (1024, 1024), (4_000_000, 32), (1, 8),
                      (0, 4), (5, 3, 2)]:
            add(f"min_size({min_bytes},{max_shards})", min_size(min_bytes, max_shards), shape)
    for dtype in DTYPES:
        for shape in [(100,), (33, 3)]:
            add("min_size(7,100)", min_size(7, 100), shape, dtype)
            add("max_size(10,none)", max_size(10), shape, dtype)
    for min_bytes in [1.5, 2.5, 3.5, 100.5]:  # TF divides by the float and rounds up
        for shape in [(100,), (1000,), (10, 3), (7, 7)]:
            add(f"min_size({min_bytes},1000)", min_size(min_bytes, 1000), shape, "int8")
            add(f"max_size({min_bytes})", max_size(min_bytes), shape, "int8")
    add("min_size()", min_size(), (76800, 1))  # TF's defaults: 256 KiB, one shard
    add("min_size(max_shards=4)", min_size(max_shards=4), (76800, 1))
    add("min_size(4,3)", min_size(4, 3), ())
    for bad in [dict(min_shard_bytes=0), dict(min_shard_bytes=-1), dict(max_shards=0),
                dict(max_shards=-2), dict(bytes_per_string=0), dict(bytes_per_string=4),
                dict(bytes_per_string=1.5), dict(min_shard_bytes=8, bytes_per_string=100)]:
        add(f"min_size({bad})", min_size(**bad), (10, 4))
    for axis in [0, 1, 2]:
        add("min_size(4,3),axis", min_size(4, 3), (10, 3), axis=axis)
        add("min_size(4,3),axis", min_size(4, 3), (1, 4), axis=axis)
    # MaxSize: as few shards as keep each under max_shard_bytes, at most max_shards
    for max_bytes, max_shards in [(4, None), (4, 2), (1024, None), (12, None), (13, None),
                                  (1, None), (1.5, None), (100.5, 3), (16, 0), (3, 1000)]:
        for shape in [(6, 1), (10, 3), (1, 4), (0, 4), (7,), (4, 2, 3), (1024, 1024)]:
            add(f"max_size({max_bytes},{max_shards})", max_size(max_bytes, max_shards), shape)
    add("max_size(4,max_shards=None)", max_size(4, none_max=True), (6, 1))
    add("max_size(4)", max_size(4), ())
    for bad in [dict(max_shard_bytes=0), dict(max_shard_bytes=-3), dict(max_shard_bytes=8,
                max_shards=-1), dict(max_shard_bytes=8, bytes_per_string=0),
                dict(max_shard_bytes=8, bytes_per_string=2)]:
        add(f"max_size({bad})", max_size(**bad), (10, 4))
    for axis in [0, 1, 2]:
        add("max_size(4),axis", max_size(4), (10, 3), axis=axis)
    return cases


def plan_cases() -> list[dict]:
    cases = []

    def add(name, num_ps, partitioner, variables):
        cases.append({"id": f"plan/ps{num_ps}/{name}", "kind": "plan", "num_ps": num_ps,
                      "partitioner": partitioner, "variables": variables})

    mixed = [var((5, 2)), var((3,)), var(()), var((7, 4)), var((1, 4)), var((2, 2, 2)),
             var((6,), "int64")]
    for num_ps in [1, 2, 3, 4]:
        add("round_robin/mixed", num_ps, None, mixed)
        add("round_robin/one", num_ps, None, [var((4, 4))])
        add("round_robin/zero_rows", num_ps, None, [var((0, 4)), var((3,)), var((0,))])
    # colocate_vars_with: TF does not count a colocated variable in the round-robin
    issue = [var((4,)), var((4,), colocate_with=0), var((4,)), var((4,)),
             var((4,), colocate_with=2), var((4,))]
    for num_ps in [2, 3, 4]:
        add("colocate/issue_37", num_ps, None, issue)
        add("colocate/chain", num_ps, None, [var((3, 2)), var((2,), colocate_with=0),
                                             var((5,), colocate_with=1), var((2, 2)),
                                             var((1,))])
        add("colocate/many_on_first", num_ps, None, [var((2,))] + [
            var((2,), colocate_with=0) for _ in range(4)] + [var((2,)), var((2,))])
        add("colocate/interleaved", num_ps, None, [
            var((2,)), var((2,)), var((2,), colocate_with=1), var((2,)),
            var((2,), colocate_with=0), var((2,)), var((2,), colocate_with=3), var((2,))])
        add("colocate/scalar_and_zero_rows", num_ps, None, [
            var(()), var((0, 3), colocate_with=0), var((0, 3)), var((), colocate_with=2),
            var((3,))])
    for num_ps in [2, 3]:
        # colocated variables are never partitioned; one colocated with a partitioned
        # variable goes to the coordinator in TF 2.21
        add("colocate/fixed(2)/with_whole", num_ps, fixed(2), [
            var((1, 4)), var((6, 4), colocate_with=0), var((6, 4)), var((5,))])
        add("colocate/fixed(2)/with_partitioned", num_ps, fixed(2), [
            var((6, 4)), var((6, 4), colocate_with=0), var((5,))])
        add("colocate/min_size/with_whole", num_ps, min_size(16, 4), [
            var((2,)), var((40, 2), colocate_with=0), var((40, 2)), var((3,))])
    # FixedShards: min(n, rows) shards, the first rows % n one row longer
    for n in [1, 2, 3, 4, 5, 7]:
        for rows in [0, 1, 2, 3, 5, 10]:
            add(f"fixed({n})/rows{rows}", 3, fixed(n), [var((rows, 2))])
    for num_ps in [1, 2, 3, 4]:
        add("fixed(3)/sequence", num_ps, fixed(3), [
            var((10, 2)), var((3,)), var(()), var((1, 5)), var((8,)), var((4, 2, 3))])
    for n in [0, -1, 2.5, 2.0, "2"]:
        add(f"fixed({n!r})/one_row_then_rows", 2, fixed(n), [var((1, 2)), var((7, 2))])
        add(f"fixed({n!r})/one_row_only", 2, fixed(n), [var((1, 2)), var(())])
    # MinSize
    for min_bytes, max_shards in [(1, 100), (1.5, 100), (2.5, 100), (4, 3), (16, 4),
                                  (100, 100), (100.5, 100), (256 << 10, 4), (0.5, 2)]:
        for shape, dtype in [((100,), "int8"), ((10, 4), "float32"), ((6, 1), "float64"),
                             ((1, 8), "float32"), ((0, 4), "float32"), ((5, 3, 2), "int32")]:
            add(f"min_size({min_bytes},{max_shards})/{list(shape)}/{dtype}", 3,
                min_size(min_bytes, max_shards), [var(shape, dtype)])
    add("min_size(4,3,bytes_per_string=4)", 2, min_size(4, 3, 4), [var((10, 4))])
    add("min_size(bytes_per_string=0)", 2, min_size(4, 3, 0), [var((10, 4))])
    # MaxSize
    for max_bytes, max_shards in [(4, None), (12, 2), (1024, None), (1.5, None), (16, 0)]:
        for shape in [(6, 1), (10, 3), (1, 4), (0, 4), (7,)]:
            add(f"max_size({max_bytes},{max_shards})/{list(shape)}", 2,
                max_size(max_bytes, max_shards), [var(shape)])
    # custom partitioners: which results TF accepts, and which it refuses
    table = [[2], [2, 1, 1], [2, 1], [3, 1], [1, 2], [0, 1], [], None, [2.0, 1], [-1, 1],
             ["2", 1], [True, 1], [1], [5, 1, 1, 1]]
    for value in table:
        for shape in [(4, 4), (1, 4), (0, 4), (), (6,)]:
            add(f"custom({value!r})/{list(shape)}", 2, custom(value), [var(shape), var((3,))])
    add("custom((2,1))/tuple", 2, custom([2, 1], as_tuple=True), [var((4, 4))])
    for value in [[2, 1], [2]]:
        add(f"custom_plain_function({value!r})", 2, custom(value, plain=True),
            [var((4, 4)), var((1, 4)), var((3, 3))])
    # dtypes and ranks
    for dtype in DTYPES:
        add(f"min_size(7,100)/{dtype}", 2, min_size(7, 100), [var((9, 2), dtype)])
    add("fixed(3)/rank3_and_rank1", 3, fixed(3), [var((5, 2, 3)), var((2,)), var((4, 1, 1, 1))])
    return cases


# -- recording ----------------------------------------------------------------------------
# TF's own checks of a partitioner's arguments and of its result; any other error is
# TF failing on an input it does not check (a crash)
DESIGNED = ("Argument `min_shard_bytes` must be positive", "Argument `max_shards` must be",
            "Argument `bytes_per_string` must be positive",
            "Argument `max_shard_bytes` must be positive", "Both max_shard_bytes",
            "max_shards must be positive", "variable_partitioner must return",
            "Cannot partition variable along axis")


def error_of(exc: BaseException, **where) -> dict:
    """The error as the golden keeps it: ``crash`` unless one of TF's own checks."""
    return {"error": {"type": type(exc).__name__, "message": str(exc),
                      "crash": not str(exc).startswith(DESIGNED)}, **where}


def plain(value):
    """A partitioner's result as JSON (numpy ints as ints)."""
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "item") and not isinstance(value, (str, bool)):
        return value.item()
    return value


def make_partitioner(tf, spec, calls: list | None = None):
    """TF's partitioner for ``spec`` (None: no partitioner); ``calls`` gets every shape
    the strategy asks it about."""
    if spec is None:
        return None
    if "custom" in spec:
        def inner(shape, dtype, **kwargs):
            value = spec["value"]
            return tuple(value) if spec["tuple"] else (list(value) if value is not None else None)
    else:
        inner = getattr(tf.distribute.experimental.partitioners, spec["class"])(**spec["kwargs"])
    if calls is None:
        return inner

    def recording(shape, dtype, **kwargs):
        calls.append(list(shape.as_list()))
        return inner(shape, dtype, **kwargs)
    return recording


def record_call(tf, case: dict) -> dict:
    try:
        partitioner = make_partitioner(tf, case["partitioner"])
    except Exception as exc:  # noqa: BLE001 -- recorded, whatever TF raised
        return error_of(exc, at="construct")
    kwargs = {} if case["axis"] is None else {"axis": case["axis"]}
    try:
        return {"result": plain(partitioner(tf.TensorShape(case["shape"]),
                                            getattr(tf, case["dtype"]), **kwargs))}
    except Exception as exc:  # noqa: BLE001
        return error_of(exc, at="call")


def where(variable) -> list[dict]:
    shards = getattr(variable, "variables", None) or [variable]
    out = []
    for shard in shards:
        device = shard.device
        ps = int(device.split("/task:")[1].split("/")[0]) if "/job:ps/" in device else \
            device.split("/job:")[1].split("/")[0]
        out.append({"shape": shard.shape.as_list(), "ps": ps})
    return out


def record_plan(tf, resolver, case: dict) -> dict:
    calls: list = []
    try:
        partitioner = make_partitioner(tf, case["partitioner"], calls)
        strategy = tf.distribute.experimental.ParameterServerStrategy(
            resolver, variable_partitioner=partitioner)
    except Exception as exc:  # noqa: BLE001
        return {**error_of(exc, at="construct"), "calls": calls}
    created = []
    with strategy.scope():
        for index, spec in enumerate(case["variables"]):
            dtype = getattr(tf, spec["dtype"])
            value = tf.zeros(spec["shape"], dtype)
            try:
                if spec["colocate_with"] is None:
                    created.append(tf.Variable(value))
                else:
                    with strategy.extended.colocate_vars_with(created[spec["colocate_with"]]):
                        created.append(tf.Variable(value))
            except Exception as exc:  # noqa: BLE001
                return {**error_of(exc, at="variable", variable=index), "calls": calls}
    return {"variables": [where(v) for v in created], "calls": calls}


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def plan_worker(num_ps: int) -> int:
    """Record the plan cases of ``num_ps`` (read from stdin) against in-process servers."""
    import tensorflow as tf
    cases = json.load(sys.stdin)
    ports = free_ports(num_ps + 2)
    cluster = tf.train.ClusterSpec({
        "chief": [f"127.0.0.1:{ports[0]}"], "worker": [f"127.0.0.1:{ports[1]}"],
        "ps": [f"127.0.0.1:{p}" for p in ports[2:]]})
    servers = [tf.distribute.Server(cluster, job_name="worker", task_index=0, start=True)]
    servers += [tf.distribute.Server(cluster, job_name="ps", task_index=k, start=True)
                for k in range(num_ps)]
    resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
        cluster, task_type="chief", task_id=0, rpc_layer="grpc")
    json.dump({case["id"]: record_plan(tf, resolver, case) for case in cases}, sys.stdout)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=OUT, help="the golden JSON to write")
    parser.add_argument("--plan-worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.plan_worker:
        return plan_worker(args.plan_worker)
    import tensorflow as tf
    calls, plans = call_cases(), plan_cases()
    ids = [c["id"] for c in calls + plans]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise SystemExit(f"duplicate case ids: {duplicated}")
    for case in calls:
        case["tf"] = record_call(tf, case)
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    for num_ps in sorted({c["num_ps"] for c in plans}):
        mine = [c for c in plans if c["num_ps"] == num_ps]  # one cluster per process
        done = subprocess.run([sys.executable, __file__, "--plan-worker", str(num_ps)],
                              input=json.dumps(mine), capture_output=True, text=True,
                              env=env, timeout=600, check=False)
        if done.returncode:
            raise SystemExit(f"recording ps={num_ps} failed:\n{done.stderr[-4000:]}")
        results = json.loads(done.stdout)
        for case in mine:
            case["tf"] = results[case["id"]]
    golden = {"meta": {"tensorflow": tf.__version__, "python": sys.version.split()[0],
                       "recorded": datetime.date.today().isoformat(),
                       "command": "python tests/golden/record_ps_plan.py",
                       "cases": len(ids)},
              "cases": calls + plans}
    args.out.write_text(json.dumps(golden, indent=1) + "\n")
    print(f"{len(calls)} call cases, {len(plans)} plan cases -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
