"""Security: YAML read with a safe loader only; model import paths come only from the
user's config; checkpoints load without running pickled code. Each malicious input is
first shown to work (its marker file appears when it is unpickled unsafely), then shown
to do nothing to csrun."""

from __future__ import annotations

import ast
import json
import pickle
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

import csrun.core as core
import csrun.core.config.targets as targets
from csrun.cli.main import app
from csrun.core.runner.digests import file_sha256
from tests.helpers.tiny_config import TINY

SOURCES = sorted((Path(core.__file__).parent).rglob("*.py")) + \
    sorted((Path(sys.modules["csrun.cli.main"].__file__).parent).glob("*.py"))
RUN = ["checkpoint.dir=ck", "train.steps=4"]


def _cli(*args):
    done = CliRunner().invoke(app, [*args, "--json", "r.json"], catch_exceptions=False)
    return done, json.loads(Path("r.json").read_text())


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny.yaml").write_text(TINY)
    return tmp_path


# -- YAML --------------------------------------------------------------------------------
TAGS = {  # tag -> whether PyYAML's unsafe loader runs it (shown before csrun refuses it)
    '!!python/object/apply:os.system ["touch {marker}"]': True,
    '!!python/object/apply:subprocess.check_call [[touch, "{marker}"]]': True,
    '!<tag:yaml.org,2002:python/object/apply:os.system> ["touch {marker}"]': True,
    '!!python/object/new:os.system ["touch {marker}"]': False,
    '!python/object/apply:os.system ["touch {marker}"]': False,
    "!!python/name:os.system": False,
    "!!python/module:os": False,
}


# a live payload starts `touch` (run by the unsafe loader, to show that it is live)
@pytest.mark.parametrize("tag", [pytest.param(t, marks=pytest.mark.process) if TAGS[t] else t
                                 for t in sorted(TAGS)])
@pytest.mark.parametrize("where", ["file", "override", "%TAG directive"])
def test_yaml_python_tags_are_refused_and_never_run(tag, where, folder):
    marker = folder / "pwned"
    value = tag.format(marker=marker)
    if TAGS[tag]:  # the payload is live: an unsafe loader runs it
        yaml.unsafe_load(f"x: {value}\n")
        assert marker.exists()
        marker.unlink()
    text, overrides = TINY, []
    if where == "file":
        text = TINY.replace("model: {kind: mlp, hidden: [16]}", f"model: {value}")
    elif where == "override":
        overrides = [f"model={value}"]
    else:  # the same tag spelt through a %TAG handle
        handle = value.replace("!!python/", "!py!")
        text = "%TAG !py! tag:yaml.org,2002:python/\n---\n" + TINY.replace(
            "model: {kind: mlp, hidden: [16]}", f"model: {handle}")
    (folder / "c.yaml").write_text(text)
    done, result = _cli("validate", "c.yaml", *overrides)
    assert done.exit_code == 2 and result["status"] == "invalid"
    assert not marker.exists()
    problem = result["problems"][0]
    assert "could not determine a constructor for the tag" in problem["message"]
    assert problem["hint"] == "csrun reads plain YAML only (no !!python tags)"
    assert "Traceback" not in done.stderr


def _calls(tree: ast.AST, dotted: str) -> list[ast.Call]:
    """Calls of ``dotted`` (``yaml.load``) in ``tree``."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            if name == dotted or name.endswith("." + dotted):
                found.append(node)
    return found


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_the_source_never_loads_unsafely(source):
    """No unsafe YAML loader, pickle, eval or exec anywhere in csrun; every torch.load is
    weights_only=True; no np.load allows pickles; the one dynamic import is import_object."""
    text = source.read_text()
    tree = ast.parse(text)
    names = {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    unsafe = {"yaml.load", "yaml.load_all", "yaml.unsafe_load", "yaml.full_load",
              "yaml.Loader", "yaml.UnsafeLoader", "yaml.FullLoader", "yaml.CLoader",
              "pickle.load", "pickle.loads", "pickle.Unpickler", "marshal.loads"}
    assert names & unsafe == set()
    called = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert called & {"eval", "exec", "__import__", "compile"} == set()
    for call in _calls(tree, "torch.load"):
        keywords = {k.arg: ast.unparse(k.value) for k in call.keywords}
        assert keywords.get("weights_only") == "True", ast.unparse(call)
    for call in _calls(tree, "np.load"):
        assert "allow_pickle=True" not in ast.unparse(call)
    imports = _calls(tree, "import_module") + _calls(tree, "spec_from_file_location")
    if source.name != "targets.py":
        assert imports == [], f"{source.name} imports by name"
    else:  # in import_object only, with the config's "package.module:name"
        functions = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                     and any(c in ast.walk(f) for c in imports)]
        assert [f.name for f in functions] == ["import_object"]


# -- checkpoints ---------------------------------------------------------------------------
class _Touch:
    """Unpickling this creates ``path`` (the standard library's open, no shell)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _plant(checkpoint: Path, write) -> None:
    """Replace ``checkpoint``'s payload with ``write(path)`` and make its manifest match,
    so that only the safe loader stands between the payload and its execution."""
    write(checkpoint)
    manifest_path = checkpoint.with_suffix(".json")
    manifest = json.loads(manifest_path.read_text())
    manifest.update(bytes=checkpoint.stat().st_size, sha256=file_sha256(checkpoint))
    manifest_path.write_text(json.dumps(manifest))


FORMATS = {  # how a payload is written -> how an unsafe loader would run it
    "torch.save": (lambda path, obj: torch.save(obj, path),
                   lambda path: torch.load(path, weights_only=False)),
    "torch.save legacy": (lambda path, obj: torch.save(
        obj, path, _use_new_zipfile_serialization=False),
                          lambda path: torch.load(path, weights_only=False)),
    "plain pickle": (lambda path, obj: path.write_bytes(pickle.dumps(obj)),
                     lambda path: pickle.loads(path.read_bytes())),
}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_malicious_checkpoint_is_refused_and_its_code_never_runs(fmt, folder):
    done, _ = _cli("train", "tiny.yaml", *RUN)
    assert done.exit_code == 0, done.stderr
    marker = folder / "pwned"
    checkpoint = folder / "ck" / "ckpt-00000004.pt"
    write, unsafe_load = FORMATS[fmt]
    _plant(checkpoint, lambda p: write(p, {"step": 4, "model": _Touch(marker)}))
    unsafe_load(checkpoint)  # the payload is live: an unsafe load runs it
    assert marker.exists()
    marker.unlink()
    done, result = _cli("train", "tiny.yaml", *RUN, "train.steps=8", "--resume")
    assert done.exit_code == 1 and result["status"] == "failed"
    assert "cannot be loaded safely" in result["error"] and "Traceback" not in done.stderr
    assert not marker.exists()


def test_a_checkpoint_cannot_make_csrun_import_a_module(folder, monkeypatch):
    """A payload naming a class makes an unsafe unpickler import its module (and run the
    module's code); csrun's loader imports nothing, and the manifest's identity is
    compared, never imported."""
    monkeypatch.syspath_prepend(str(folder))
    (folder / "planted_module.py").write_text(
        f"open({str(folder / 'imported')!r}, 'w').close()\nclass Net:\n    pass\n")
    done, _ = _cli("train", "tiny.yaml", *RUN)
    assert done.exit_code == 0
    fake = types.ModuleType("planted_module")  # to pickle a reference to the class
    fake.Net = type("Net", (), {"__module__": "planted_module"})
    monkeypatch.setitem(sys.modules, "planted_module", fake)
    checkpoint = folder / "ck" / "ckpt-00000004.pt"
    _plant(checkpoint, lambda p: torch.save({"step": 4, "model": fake.Net}, p))
    manifest = json.loads(checkpoint.with_suffix(".json").read_text())
    manifest["identity"]["model.target"] = "planted_module:Net"
    checkpoint.with_suffix(".json").write_text(json.dumps(manifest))
    monkeypatch.delitem(sys.modules, "planted_module")

    done, result = _cli("train", "tiny.yaml", *RUN, "train.steps=8", "--resume")
    assert done.exit_code == 1 and "different run" in result["error"]
    assert "model.target: checkpoint \"planted_module:Net\", now (absent)" in result["error"]
    del manifest["identity"]["model.target"]  # the identity matches: the loader decides
    checkpoint.with_suffix(".json").write_text(json.dumps(manifest))
    done, result = _cli("train", "tiny.yaml", *RUN, "train.steps=8", "--resume")
    assert done.exit_code == 1 and "cannot be loaded safely" in result["error"]
    assert "planted_module" not in sys.modules and not (folder / "imported").exists()


def test_model_and_map_imports_come_only_from_the_config(folder, monkeypatch):
    """Every module csrun imports by name, in a fresh run and in a resumed one, is one
    the config names (``model.target``, a ``map`` step's ``fn``)."""
    monkeypatch.syspath_prepend(str(folder))
    (folder / "planted_model.py").write_text(
        "import torch\nclass Net(torch.nn.Sequential):\n"
        "    def __init__(self):\n        super().__init__(torch.nn.Linear(6, 3))\n")
    (folder / "planted_map.py").write_text("def double(x, y):\n    return 2 * x, y\n")
    imported = []
    real = targets.importlib.import_module

    def recording(name, *args, **kwargs):
        imported.append(name)
        return real(name, *args, **kwargs)
    monkeypatch.setattr(targets.importlib, "import_module", recording)
    overrides = ["model={kind: import, target: 'planted_model:Net'}",
                 "dataset.steps.2={op: map, fn: 'planted_map:double'}", *RUN]
    for resume in ([], ["--resume"]):
        done, _ = _cli("train", "tiny.yaml", *overrides, "train.steps=8", *resume)
        assert done.exit_code == 0, done.stderr
    assert set(imported) == {"planted_model", "planted_map"}
