"""TensorFlow's recorded outputs: the golden cases, decoded and compared.

The golden cases (``tests/golden/golden.json``, a copy of the project's shared
``../shared/golden/golden.json``) are outputs recorded from real TensorFlow 2.21 running
``tf.distribute.experimental.CentralStorageStrategy``; see the README next to the original
for how TF's terms map to csrun's. The copy lives in the repository so the spec tests run
in every checkout; ``tests/unit/test_golden_copy.py`` checks it against the original.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

import csrun.core as cs

GOLDEN_PATH = Path(__file__).resolve().parents[1] / "golden" / "golden.json"

_TORCH_DTYPES = {
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bool": torch.bool,
}

@functools.cache
def cases() -> dict:
    """Every golden case by id (``cases()["__meta__"]``: the file's meta)."""
    with GOLDEN_PATH.open() as fh:  # part of the repository: missing is an error
        data = json.load(fh)
    found = {case["id"]: case for case in data["cases"]}
    found["__meta__"] = data.get("meta", {})
    return found


def make_strategy(num_replicas: int, **options) -> cs.CentralStorageStrategy:
    """The golden strategy S<R>: compute CPU:1..CPU:R, parameters on CPU:0."""
    opts = cs.StrategyOptions(**options) if options else None
    return cs.CentralStorageStrategy([f"CPU:{i}" for i in range(1, num_replicas + 1)],
                                     "CPU:0", options=opts)


def decode(enc: Any) -> Any:
    """A golden encoding as torch tensors / numpy values / plain Python values."""
    if isinstance(enc, list):
        return [decode(v) for v in enc]
    if not isinstance(enc, dict):
        return enc
    if "error" in enc and len(enc) == 1:
        return enc  # a recorded exception: the caller checks it explicitly
    if {"value", "dtype", "shape"} <= enc.keys() and len(enc) == 3:
        dtype = _TORCH_DTYPES.get(enc["dtype"])
        if dtype is None:  # e.g. TF strings
            return enc["value"]
        return torch.tensor(enc["value"], dtype=dtype).reshape(enc["shape"])
    if "ndarray" in enc:
        return np.array(enc["ndarray"], dtype=enc["dtype"]).reshape(enc["shape"])
    if "np_scalar" in enc:
        return np.dtype(enc["dtype"]).type(enc["np_scalar"])
    if "kind" in enc and "values" in enc:
        return [decode(v) for v in enc["values"]]
    if "result" in enc and len(enc) == 1:
        return decode(enc["result"])
    return {k: decode(v) for k, v in enc.items()}


def _as_tensor(value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach()
    if isinstance(value, cs.Variable):
        return value.tensor.detach()
    return torch.as_tensor(np.asarray(value))


def expect(actual: Any, encoded: Any, check_dtype: bool = True, atol: float = 1e-6,
           rtol: float = 0.0, path: str = "value") -> None:
    """Assert ``actual`` matches the golden ``encoded`` value (see module docstring)."""
    expected = decode(encoded)
    _compare(actual, expected, check_dtype, atol, rtol, path)


def _compare(actual, expected, check_dtype, atol, rtol, path):
    if isinstance(expected, dict) and "error" in expected and len(expected) == 1:
        raise AssertionError(f"{path}: the golden value is a recorded error {expected}; "
                             "check it with pytest.raises")
    if isinstance(expected, (torch.Tensor, np.ndarray, np.generic)):
        exp = _as_tensor(expected)
        act = _as_tensor(actual)
        assert tuple(act.shape) == tuple(exp.shape), \
            f"{path}: shape {tuple(act.shape)} != golden {tuple(exp.shape)} ({act} vs {exp})"
        if check_dtype:
            assert act.dtype == exp.dtype, f"{path}: dtype {act.dtype} != golden {exp.dtype}"
        act, exp = act.cpu(), exp.cpu()
        if exp.is_floating_point() or act.is_floating_point():
            diff = (act.double() - exp.double()).abs()
            bound = atol + rtol * exp.double().abs()
            assert bool((diff <= bound).all()), \
                f"{path}: {act.tolist()} != golden {exp.tolist()} (atol={atol}, rtol={rtol})"
        else:
            assert act.tolist() == exp.tolist(), \
                f"{path}: {act.tolist()} != golden {exp.tolist()}"
        return
    if isinstance(expected, dict):
        assert isinstance(actual, dict), f"{path}: expected a dict, got {type(actual)}"
        assert set(actual) == set(expected), f"{path}: keys {set(actual)} != {set(expected)}"
        for key in expected:
            _compare(actual[key], expected[key], check_dtype, atol, rtol, f"{path}[{key!r}]")
        return
    if isinstance(expected, list):
        if isinstance(actual, cs.DistributedValues):
            actual = list(actual.values)
        assert isinstance(actual, (list, tuple)), \
            f"{path}: expected a sequence of {len(expected)}, got {type(actual).__name__}"
        assert len(actual) == len(expected), \
            f"{path}: {len(actual)} elements != golden {len(expected)} ({actual!r})"
        for i, (a, e) in enumerate(zip(actual, expected)):
            _compare(a, e, check_dtype, atol, rtol, f"{path}[{i}]")
        return
    if isinstance(expected, float):
        a = float(_as_tensor(actual)) if not isinstance(actual, (int, float)) else actual
        assert math.isclose(a, expected, rel_tol=rtol, abs_tol=atol), \
            f"{path}: {a} != golden {expected}"
        return
    if isinstance(expected, bool) or expected is None or isinstance(expected, str):
        assert actual == expected, f"{path}: {actual!r} != golden {expected!r}"
        return
    if isinstance(expected, int):
        if isinstance(actual, torch.Tensor):
            assert not actual.is_floating_point(), f"{path}: {actual} is not an integer"
            actual = int(actual)
        assert actual == expected and not isinstance(actual, float), \
            f"{path}: {actual!r} != golden {expected!r}"
        return
    assert actual == expected, f"{path}: {actual!r} != golden {expected!r}"


def tf_spec_string(spec: Any) -> str:
    """Render csrun's ``element_spec`` the way TF prints its specs, for comparison.

    ``TensorSpec((None,), torch.int64)`` -> ``TensorSpec(shape=(None,), dtype=tf.int64,
    name=None)``; PerReplicaSpec, dicts and tuples are rendered like TF's reprs.
    """
    if isinstance(spec, cs.PerReplicaSpec):
        return "PerReplicaSpec(" + ", ".join(tf_spec_string(s) for s in spec) + ")"
    if isinstance(spec, cs.TensorSpec):
        dtype = str(spec.dtype).replace("torch.", "tf.")
        return f"TensorSpec(shape={tuple(spec.shape)!r}, dtype={dtype}, name=None)"
    if isinstance(spec, dict):
        return "{" + ", ".join(f"{k!r}: {tf_spec_string(v)}" for k, v in spec.items()) + "}"
    if isinstance(spec, tuple):
        inner = ", ".join(tf_spec_string(v) for v in spec)
        return f"({inner},)" if len(spec) == 1 else f"({inner})"
    if isinstance(spec, list):
        return "[" + ", ".join(tf_spec_string(v) for v in spec) + "]"
    return repr(spec)
