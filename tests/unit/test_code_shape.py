"""The runner stays in parts a reader can hold: no class of ``core/runner`` grows past
~300 lines or ~20 methods (the session once had 970 lines and 40 methods; its parts
are the state, the batches, evaluation, checkpointing and the result)."""

from __future__ import annotations

import ast
import pathlib

RUNNER = pathlib.Path(__file__).resolve().parents[2] / "core" / "runner"
CLUSTER = RUNNER.parent / "cluster"
MAX_LINES, MAX_METHODS = 300, 20
MAX_CLUSTER_METHODS = 25  # issue 37: the ps client once had 34 methods


def _classes(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body
                       if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            yield node.name, node.end_lineno - node.lineno + 1, len(methods)


def test_no_runner_class_is_too_big():
    big = [f"{path.relative_to(RUNNER.parent.parent)}: {name} has {lines} lines, "
           f"{methods} methods" for path in sorted(RUNNER.rglob("*.py"))
           for name, lines, methods in _classes(path)
           if lines > MAX_LINES or methods > MAX_METHODS]
    assert not big, "split these by concern:\n" + "\n".join(big)


def test_no_cluster_class_is_too_big_or_reaches_into_anothers_fields():
    big = [f"{path.name}: {name} has {methods} methods" for path in sorted(CLUSTER.glob("*.py"))
           for name, _, methods in _classes(path) if methods > MAX_CLUSTER_METHODS]
    assert not big, "split these by concern:\n" + "\n".join(big)
    reaches = [f"{path.name}:{node.lineno}: .{node.attr} of {ast.unparse(node.value)}"
               for path in sorted(CLUSTER.glob("*.py"))
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.Attribute) and node.attr.startswith("_")
               and not node.attr.startswith("__")
               and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))]
    assert not reaches, "use a method of the other class:\n" + "\n".join(reaches)


def test_the_check_sees_a_big_class(tmp_path):
    source = tmp_path / "big.py"
    source.write_text("class Big:\n" + "".join(f"    def m{i}(self):\n        pass\n"
                                               for i in range(MAX_METHODS + 1)))
    assert [(name, methods) for name, _, methods in _classes(source)] == \
        [("Big", MAX_METHODS + 1)]
