"""Hypothesis strategies that break a valid csrun config, and what each break must cause.

A :class:`Break` is one change to :data:`VALID`: an unknown key, a value
of the wrong type, a negative or huge size, a number past 64 bits, unicode where a name
goes, a deleted required key, a list where a mapping goes. Each knows the dotted path a
problem must name, and whether the config *must* be refused (some changes, such as a
random device name that happens to exist, may leave it valid).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from typing import Any

import yaml
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from csrun.core.config import schema as config_module
from csrun.core.runner.optimizers import optimizer_names

# Each property runs this many examples; CSRUN_FUZZ_EXAMPLES raises it for a long local
# run. No deadline from hypothesis: timing is benchmarks/bad_configs.py's, not a test's.
FUZZ = settings(max_examples=int(os.environ.get("CSRUN_FUZZ_EXAMPLES", "100")),
                deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                      HealthCheck.function_scoped_fixture])

INT64_MAX = 2**63 - 1

# A valid config; tests break it in every way they can think of.
VALID = {
    "strategy": {"compute_devices": ["CPU:0", "CPU:1"], "parameter_device": "CPU:0",
                 "execution": "auto"},
    "dataset": {
        "source": {"kind": "synthetic", "examples": 64, "features": 4, "classes": 3,
                   "seed": 0},
        "holdout": 0.25,
        "steps": [{"op": "shuffle", "buffer": 64}, {"op": "batch", "size": 16},
                  {"op": "prefetch", "buffer": 2}],
    },
    "model": {"kind": "mlp", "hidden": [8], "dropout": 0.0},
    "optimizer": {"name": "SGD", "lr": 0.1, "kwargs": {"momentum": 0.9}},
    "train": {"steps": 4, "seed": 0, "log_every": 2},
    "checkpoint": {"every_steps": 0, "keep": 2},
}

# Leaves that must be positive (> 0; classes >= 2), and those that may be 0 but no less.
POSITIVE = {("dataset", "source", "examples"), ("dataset", "source", "features"),
            ("dataset", "source", "classes"), ("dataset", "steps", 0, "buffer"),
            ("dataset", "steps", 1, "size"), ("dataset", "steps", 2, "buffer"),
            ("model", "hidden", 0), ("optimizer", "lr"), ("train", "steps"),
            ("train", "log_every"), ("checkpoint", "keep")}
NON_NEGATIVE = {("dataset", "source", "seed"), ("checkpoint", "every_steps"),
                ("dataset", "holdout"), ("model", "dropout")}
# Sizes so big that no machine holds them (or that are harmless when valid, such as a
# batch bigger than the data): either way, a quick answer.
HUGE_SIZES = {("dataset", "source", "examples"), ("dataset", "source", "features"),
              ("dataset", "source", "classes"), ("dataset", "steps", 0, "buffer"),
              ("dataset", "steps", 1, "size"), ("dataset", "steps", 2, "buffer"),
              ("model", "hidden", 0), ("train", "steps"), ("train", "log_every"),
              ("checkpoint", "keep"), ("checkpoint", "every_steps")}
# String leaves whose valid values are known: anything else must be refused.
CHOICES = {("strategy", "execution"): {"auto", "ordered", "concurrent"},
           ("dataset", "source", "kind"): {"range", "synthetic", "file", "digits"},
           ("dataset", "steps", 0, "op"): {"shuffle", "batch", "repeat", "take", "skip",
                                           "shard", "map", "normalize", "prefetch"},
           ("model", "kind"): {"linear", "mlp", "cnn", "import"},
           ("optimizer", "name"): set(optimizer_names())}
CHOICES[("dataset", "steps", 1, "op")] = CHOICES[("dataset", "steps", 2, "op")] = \
    CHOICES[("dataset", "steps", 0, "op")]
REQUIRED = [("dataset",), ("model",), ("dataset", "source"), ("dataset", "steps"),
            ("dataset", "source", "kind"), ("model", "kind"), ("dataset", "steps", 1),
            ("train", "steps"), ("dataset", "steps", 1, "size")]


def _field_names() -> set[str]:
    names = set(config_module.SECTIONS)
    for obj in vars(config_module).values():
        if isinstance(obj, type) and issubclass(obj, config_module.BaseModel):
            names |= set(obj.model_fields)
    return names


KNOWN_FIELDS = _field_names()


@dataclasses.dataclass
class Break:
    """One broken config: ``data`` (or ``override`` applied to the valid one) and what
    must follow: a problem at (or around) ``path``; exit 2 unless ``may_pass``."""

    kind: str
    data: Any
    path: tuple
    value: Any = None
    may_pass: bool = False

    @property
    def dotted(self) -> str:
        return ".".join(str(p) for p in self.path)

    def override(self) -> str | None:
        """The same break as one ``key=value`` override, if it can be spelt as one."""
        if not self.path or self.kind == "delete" or not all(
                _override_part(p) for p in self.path):
            return None
        value = flow_yaml(self.value)
        return f"{self.dotted}={value}" if value is not None else None


def _override_part(part: Any) -> bool:
    # a dotted key splits at "." and ends at "="; digits would make it a list index
    if isinstance(part, int):
        return True
    return bool(part) and part == part.strip() and not (set(part) & {".", "="}) and \
        not (part.isascii() and part.isdigit())


def flow_yaml(value: Any) -> str | None:
    """``value`` as one line of YAML, or None when YAML cannot give it back unchanged."""
    text = yaml.safe_dump(value, default_flow_style=True, allow_unicode=True,
                          width=math.inf).strip()
    text = text.removesuffix("\n...").removesuffix("...").strip()
    if "\n" in text:
        return None
    try:
        same = yaml.safe_load(text) == value
    except yaml.YAMLError:
        return None
    return text if same else None


def block_yaml(data: Any) -> str | None:
    """``data`` as a block-style YAML file, or None when it would not read back equal."""
    text = yaml.safe_dump(data, default_flow_style=False, allow_unicode=True,
                          sort_keys=False)
    try:
        return text if yaml.safe_load(text) == data else None
    except yaml.YAMLError:
        return None


_NUMBERS = [TypeAdapter(kind) for kind in (float, int, bool)]


def _numberlike(text: str) -> bool:
    """Whether pydantic reads ``text`` as a number (``" 5 "``, ``"1e3"``, ``"true"``)."""
    for adapter in _NUMBERS:
        try:
            adapter.validate_python(text)
            return True
        except ValidationError:
            pass
    return False


def _nodes(data: Any, path: tuple = ()) -> list[tuple[tuple, Any]]:
    found = [(path, data)]
    if isinstance(data, dict):
        for key, value in data.items():
            found += _nodes(value, path + (key,))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            found += _nodes(value, path + (i,))
    return found


def _replaced(data: Any, path: tuple, value: Any) -> Any:
    data = copy.deepcopy(data)
    if not path:
        return value
    node = data
    for part in path[:-1]:
        node = node[part]
    node[path[-1]] = value
    return data


def _deleted(data: Any, path: tuple) -> Any:
    data = copy.deepcopy(data)
    node = data
    for part in path[:-1]:
        node = node[part]
    del node[path[-1]]
    return data


# -- values ---------------------------------------------------------------------------------
texts = st.text(max_size=40)
not_numbers = texts.filter(lambda t: not _numberlike(t))
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                    texts)
containers = st.one_of(st.lists(scalars, max_size=3),
                       st.dictionaries(texts, scalars, max_size=3))


def _unknown_keys() -> st.SearchStrategy[str]:
    return st.text(min_size=1, max_size=30).filter(lambda k: k not in KNOWN_FIELDS)


@st.composite
def breaks(draw, valid: dict) -> Break:
    """Any one :class:`Break` of ``valid``."""
    nodes = _nodes(valid)
    kind = draw(st.sampled_from(["unknown_key", "wrong_type", "negative", "past_int64",
                                 "huge", "unicode", "delete", "not_a_mapping"]))
    if kind == "unknown_key":
        path, _ = draw(st.sampled_from([(p, v) for p, v in nodes if isinstance(v, dict)]))
        key, value = draw(_unknown_keys()), draw(scalars | containers)
        # an unknown key in kwargs is the optimizer's to refuse (or, by chance, to take)
        return Break(kind, _replaced(valid, path + (key,), value), path + (key,), value,
                     may_pass="kwargs" in path)
    if kind == "delete":
        path = draw(st.sampled_from(REQUIRED))
        return Break(kind, _deleted(valid, path), path)
    if kind == "not_a_mapping":
        path, _ = draw(st.sampled_from([(p, v) for p, v in nodes if isinstance(v, dict)
                                        and p[-1:] != ("kwargs",)]))
        value = draw(st.lists(scalars, max_size=3) | texts | st.integers())
        return Break(kind, _replaced(valid, path, value), path, value)
    return _leaf_break(draw, valid, nodes, kind)


def _leaf_break(draw, valid: dict, nodes: list, kind: str) -> Break:
    leaves = [(p, v) for p, v in nodes if not isinstance(v, (dict, list))]
    numbers = [(p, v) for p, v in leaves if isinstance(v, (int, float))]
    if kind == "wrong_type":
        path, old = draw(st.sampled_from(leaves))
        wrong = (not_numbers | containers) if isinstance(old, (int, float)) else \
            (st.integers() | st.floats(allow_nan=False) | containers)
        value = draw(wrong)
        return _leaf(kind, valid, path, value)
    if kind == "negative":
        path = draw(st.sampled_from(sorted(POSITIVE | NON_NEGATIVE, key=str)))
        value = draw(_below_range(path, _at(valid, path)))
        return _leaf(kind, valid, path, value)
    if kind == "past_int64":
        path, _ = draw(st.sampled_from([(p, v) for p, v in numbers if type(v) is int]))
        value = draw(st.integers(min_value=INT64_MAX + 1) |
                     st.integers(max_value=-INT64_MAX - 2))
        return _leaf(kind, valid, path, value)
    if kind == "huge":
        path = draw(st.sampled_from(sorted(HUGE_SIZES, key=str)))
        value = draw(st.integers(min_value=10**12, max_value=INT64_MAX))
        return _leaf(kind, valid, path, value, may_pass=True)
    path, _ = draw(st.sampled_from([(p, v) for p, v in leaves if isinstance(v, str)]))
    choices = CHOICES.get(path)
    value = draw(st.text(min_size=1, max_size=40).filter(
        lambda t: choices is None or t not in choices))
    return _leaf("unicode", valid, path, value, may_pass=choices is None)


def _below_range(path: tuple, old: Any) -> st.SearchStrategy:
    """Numbers just out of a field's range at the low end, and far below it."""
    if isinstance(old, float):
        top = 0.0 if path in POSITIVE else -1e-12  # -0.0 passes ">= 0"
        return st.floats(max_value=top, allow_nan=False, allow_infinity=False)
    top = {("dataset", "source", "classes"): 1}.get(path, 0 if path in POSITIVE else -1)
    return st.integers(max_value=top)


def _at(data: Any, path: tuple) -> Any:
    for part in path:
        data = data[part]
    return data


def _leaf(kind: str, valid: dict, path: tuple, value: Any, may_pass: bool = False) -> Break:
    # a number in optimizer.kwargs is whatever torch makes of it: refused or not
    may_pass = may_pass or "kwargs" in path
    return Break(kind, _replaced(valid, path, value), path, value, may_pass)


def related(problem_path: str, broken: str) -> bool:
    """Whether a problem at ``problem_path`` is about the change at ``broken``: the same
    key, a key inside it (``model.kind`` of a replaced ``model``), or the section or list
    around it (``train`` when ``train.steps`` was deleted)."""
    if not broken or problem_path == broken:
        return True
    return broken.startswith(problem_path + ".") or problem_path.startswith(broken + ".")


SIMPLE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
