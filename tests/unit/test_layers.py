"""csrun.core's layers: imports point down only, and no module imports itself in a circle.

Every import counts, including those inside functions and under ``TYPE_CHECKING``: an
import deferred into a function still ties the two modules together, it only hides it.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

CORE = pathlib.Path(__file__).resolve().parents[2] / "core"
CLI = CORE.parent / "cli"
# bottom to top: a module may import from its own layer and the ones before it
LAYERS = ("config", "distribute", "cluster", "data", "runner")


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(CORE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("csrun", "core") + parts)


def _package_of(path: pathlib.Path, name: str) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _imports(path: pathlib.Path, modules: set[str], name: str | None = None) -> set[str]:
    """The project modules ``path`` (the module ``name``) imports, anywhere in the file."""
    name = name or _module_name(path)
    package = _package_of(path, name)
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from pkg import mod` names a module; `from mod import name` names the module
            targets = [f"{stem}.{alias.name}" for alias in node.names] + [stem]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in CORE.rglob("*.py")}
    modules = set(files)
    return {name: _imports(path, modules) for name, path in files.items()}


def _cli_graph() -> dict[str, set[str]]:
    """The CLI's modules and what they import of the CLI and of csrun.core."""
    files = {f"csrun.cli.{p.stem}" if p.stem != "__init__" else "csrun.cli": p
             for p in CLI.glob("*.py")}
    modules = set(files) | set(_graph())
    return {name: _imports(path, modules, name) for name, path in files.items()}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[2]) if len(parts) > 2 and parts[2] in LAYERS else None


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle, as a path of module names, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return path[path.index(target):] + [target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_every_module_lives_in_a_layer():
    loose = [m for m in _graph() if _layer(m) is None and m != "csrun.core"]
    assert not loose, f"modules outside the layers {LAYERS}: {loose}"


def test_no_import_circle():
    graph = _graph()
    # a package's __init__ re-exports its modules; counting that edge would make every
    # `from .pkg.mod import x` inside the package a circle through its own __init__
    for name in graph:
        graph[name] = {t for t in graph[name] if not name.startswith(t + ".")}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_no_import_circle_in_the_cli():
    graph = {name: {t for t in targets if t.startswith("csrun.cli.")}
             for name, targets in _cli_graph().items() if name != "csrun.cli"}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_config_layer_imports_nothing_of_csrun_but_itself():
    """The schema is the bottom: everything may read a config, it reads nothing."""
    outside = [f"{m} -> {t}" for m, targets in _graph().items() if _layer(m) == 0
               for t in sorted(targets) if _layer(t) != 0]
    assert not outside, "\n".join(outside)


def test_imports_point_down_only():
    upward = []
    for module, targets in _graph().items():
        mine = _layer(module)
        upward += [f"{module} -> {t}" for t in sorted(targets)
                   if mine is not None and (_layer(t) or 0) > mine]
        if module == "csrun.core":  # the package's face exports the library, not the runner
            upward += [f"{module} -> {t}" for t in targets if _layer(t) == len(LAYERS) - 1]
    assert not upward, "imports pointing up a layer:\n" + "\n".join(upward)


def test_the_checker_sees_a_circle_hidden_in_a_function(tmp_path):
    """The check must not be blind to the deferred imports it exists to catch."""
    source = tmp_path / "context.py"
    source.write_text("import torch\n\ndef f():\n    from .strategy import Strategy\n"
                      "    from ..runner import session\n"
                      "if TYPE_CHECKING:\n    from csrun.core.config.schema import RunConfig\n")
    modules = {"csrun.core.distribute.strategy", "csrun.core.runner.session",
               "csrun.core.config.schema", "csrun.core.distribute.context"}
    found = _imports(source, modules, "csrun.core.distribute.context")
    assert found == modules - {"csrun.core.distribute.context"}
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("path", sorted(CLI.glob("*.py")), ids=lambda p: p.name)
def test_cli_imports_only_public_core_modules(path):
    """The CLI parses and renders: it calls csrun.core and never reaches into privates."""
    tree = ast.parse(path.read_text())
    private = [alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
               and (node.module or "").startswith("csrun.core")
               for alias in node.names if alias.name.startswith("_")]
    assert not private, f"{path.name} imports private names {private}"
