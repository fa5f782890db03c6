"""csrun's one JSON parser (:mod:`csrun.core.config.strict_json`): what ``json.loads``
takes silently is an error with its place, and every JSON csrun reads goes through it."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

import csrun.core
from csrun.core.config.strict_json import MAX_DEPTH, loads


@pytest.mark.parametrize("text, said, line, column", [
    ('{"task": {"type": "ps"}, "task": {"type": "worker"}}', 'the key "task" is given twice',
     1, 1),
    ('{"cluster": {\n  "worker": ["a:1"],\n  "worker": ["b:2"]}}', 'the key "worker" is given '
     'twice', 1, 13),
    ('[1, {"a": 1, "a": 1}]', 'the key "a" is given twice', 1, 5),
    ('{"x": NaN}', "NaN is not a JSON number", 1, 7),
    ('[-Infinity]', "-Infinity is not a JSON number", 1, 2),
    ('[1e400]', "1e400 is past the largest float", 1, 2),
    ('{"index": ' + "7" * 5000 + "}", "an integer of 5000 digits", 1, 11),
    ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), f"nest more than {MAX_DEPTH} deep", 1,
     MAX_DEPTH + 1),
    (b"\xff{}", "not UTF-8", 1, 1),
    ('{"a": 1,}', "Expecting property name", 1, 9),
])
def test_what_json_loads_would_take_silently_is_an_error_with_its_place(text, said, line,
                                                                         column):
    with pytest.raises(json.JSONDecodeError) as caught:
        loads(text)
    assert said in caught.value.msg
    assert (caught.value.lineno, caught.value.colno) == (line, column)


def test_plain_json_reads_as_json_loads_reads_it():
    text = json.dumps({"a": [1, 2.5, None, True, "é"], "b": {"c": -3, "d": ""},
                       "nested": [[[]]] * 3, "big": 2**70})
    assert loads(text) == json.loads(text)
    assert loads(text.encode()) == json.loads(text)
    nested = "[" * MAX_DEPTH + "]" * MAX_DEPTH  # as deep as allowed
    assert loads(nested) == json.loads(nested)


def test_every_json_csrun_reads_goes_through_the_strict_parser():
    """No json.load/json.loads in csrun.core or csrun.cli but the parser's own; the ps
    transport's messages between csrun's own tasks are the exception listed here."""
    root = pathlib.Path(csrun.core.__file__).parent.parent
    internal = {"core/cluster/client.py", "core/cluster/transport.py",  # csrun to csrun
                "core/cluster/coordinator.py", "core/cluster/heartbeat.py"}  # (values the job's own tasks put in its store)
    found = []
    for path in sorted((root / "core").rglob("*.py")) + sorted((root / "cli").rglob("*.py")):
        name = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr in ("load", "loads") and \
                    isinstance(node.value, ast.Name) and node.value.id == "json":
                found.append(name)
    assert set(found) <= internal | {"core/config/strict_json.py"}, found
