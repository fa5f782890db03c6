"""The tiny config the tests train, written once, and its variants.

Two logical CPU replicas, a synthetic 3-class problem and a small MLP, a few steps a
second. A test that needs another config derives it from this one with
:func:`tiny_config`, in csrun's override syntax, so that what it changes is spelt out::

    tiny_config("train.steps=6", "model.hidden=[8]", "~strategy.parameter_device")

Every variant is written in :data:`TINY`'s layout (sections one a line, the dataset's
steps one a line), so a line number or a text replacement means the same in each.

The parameter-server jobs that the process tests start share another base,
:func:`ps_config`'s (one CPU replica per worker, a bigger synthetic problem), derived the
same way, so each test states only how its job differs::

    ps_config("train.steps=400", "checkpoint={dir: ck, every_steps: 10, keep: 2}")
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

_SOURCE = yaml.safe_load("""\
strategy: {compute_devices: [CPU:0, CPU:1], parameter_device: CPU:0}
dataset:
  source: {kind: synthetic, examples: 96, features: 6, classes: 3}
  holdout: 0.25
  steps:
    - {op: shuffle, buffer: 128}
    - {op: batch, size: 16}
model: {kind: mlp, hidden: [16]}
optimizer: {name: Adam, lr: 0.01}
train: {steps: 40, log_every: 10}
""")
_PS_SOURCE = yaml.safe_load("""\
strategy: {kind: parameter_server, compute_devices: [CPU:0], timeout_s: 60}
dataset:
  source: {kind: synthetic, examples: 256, features: 8, classes: 3}
  holdout: 0.25
  steps:
    - {op: shuffle, buffer: 256}
    - {op: batch, size: 32}
model: {kind: mlp, hidden: [16]}
optimizer: {name: SGD, lr: 0.05}
train: {steps: 40, log_every: 10}
""")
# the tables' jobs: a user's model of embedding tables (ranker.py, the test's own) trained
# with Adagrad on 512 examples of 6 features
TABLE_JOB = ("dataset.source.examples=512", "dataset.source.features=6",
             "dataset.steps.0.buffer=512", 'model={kind: import, target: "ranker:Ranker"}',
             "optimizer={name: Adagrad, lr: 0.1}")


def ps_config(*overrides: str) -> str:
    """The parameter-server jobs' shared config with ``overrides`` applied (as
    :func:`tiny_config`'s), as YAML text: a job of ``kind: parameter_server`` whose
    tasks come from ``TF_CONFIG`` or ``csrun launch``, one CPU replica per worker."""
    return _derived(_PS_SOURCE, overrides)


def tiny_config(*overrides: str) -> str:
    """:data:`TINY` with ``overrides`` applied, as YAML text.

    Args:
        overrides: ``KEY=VALUE`` sets the dotted ``KEY`` (list items by index) to the YAML
            ``VALUE``, a whole section or list when ``VALUE`` is one; ``~KEY`` removes it.

    Example: ``tiny_config("train={epochs: 2}")`` trains two epochs instead of 40 steps.
    """
    return _derived(_SOURCE, overrides)


def _derived(source: dict, overrides: tuple[str, ...]) -> str:
    data = copy.deepcopy(source)
    for override in overrides:
        key, is_set, value = override.partition("=")
        if bool(is_set) == key.startswith("~"):
            raise ValueError(f"{override!r}: write KEY=VALUE or ~KEY")
        *parents, last = key.lstrip("~").split(".")
        node = data
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        last = int(last) if isinstance(node, list) else last
        if key.startswith("~"):
            del node[last]
        else:
            node[last] = yaml.safe_load(value)
    return "".join(f"{key}:{_block(value, 1)}" for key, value in data.items())


def _block(value: Any, depth: int) -> str:
    """``value`` after its key: on the same line when it fits in flow style (it holds no
    list of mappings), else on the lines below, indented."""
    indent = "  " * depth
    if isinstance(value, dict) and not _flows(value):
        return "\n" + "".join(f"{indent}{k}:{_block(v, depth + 1)}" for k, v in value.items())
    if isinstance(value, list) and not _flows(value):
        return "\n" + "".join(f"{indent}- {_flow(v)}\n" for v in value)
    return f" {_flow(value)}\n"


def _flows(value: Any) -> bool:
    if isinstance(value, list) and any(isinstance(v, dict) for v in value):
        return False
    children = value.values() if isinstance(value, dict) else value
    return all(_flows(v) for v in children) if isinstance(value, (dict, list)) else True


def _flow(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_flow(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flow(v) for v in value) + "]"
    plain = str(value)  # as a person writes it, where YAML reads it back the same
    if isinstance(value, str) and yaml.safe_load(f"[{plain}]") == [value]:
        return plain
    return yaml.safe_dump([value], default_flow_style=True, width=1 << 16)[1:-2]


TINY = tiny_config()
