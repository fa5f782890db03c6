"""What the docs show must work today: their config snippets validate, the JSON example of
docs/cli.md has the keys of a real result, their links resolve inside the repository, and
the ``csrun`` commands they show name real subcommands, options and configs.

In-process and fast: one tiny training run (2 logical CPU replicas, a few steps), no
subprocess.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from csrun.cli.main import app
from csrun.core.config.problems import ConfigError
from csrun.core.config.safe_yaml import load_yaml
from csrun.core.config.schema import RunConfig
from csrun.core.runner.preflight import load_config, load_config_text

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINKED = [*DOCS, ROOT / "CHANGELOG.md"]

# ```yaml blocks that are deliberately not csrun configs: a distinctive line of the block
# -> why. Each must match exactly one block, so the list cannot go stale silently.
NOT_CONFIGS = {
    "kind: PyTorchJob": "a Kubernetes manifest for Kubeflow's training operator",
    "kind: TFJob": "a Kubernetes manifest for Kubeflow's training operator",
}
# A fragment naming the text example's package is part of examples/text_classifier.yaml
# (the docs say so): it is merged onto that config, from examples/ as the docs run it.
TEXT_EXAMPLE = "toypkg.text:"
# Likewise a fragment naming the click example's package: examples/ps_jagged.yaml.
CLICKS_EXAMPLE = "toypkg.clicks:"
# Where a parameter-server fragment's cluster comes from (its snippet leaves it to
# TF_CONFIG, as a real job does): 2 workers and a ps; this process is worker:0.
PS_ENVIRON = {"TF_CONFIG": json.dumps({
    "cluster": {"worker": ["localhost:2223", "localhost:2224"], "ps": ["localhost:2222"]},
    "task": {"type": "worker", "index": 0}})}
# The sections a config cannot do without: those with no default, and train (its
# default gives neither steps nor epochs). A block with all of them is a whole config;
# one without is a fragment of one.
WHOLE = {name for name, field in RunConfig.model_fields.items() if field.is_required()} | \
    {"train"}


def _blocks(path: Path, language: str | None = None) -> list[tuple[int, str, str]]:
    """The fenced code blocks of ``path`` as (line, language, text)."""
    text = path.read_text(encoding="utf-8")
    found = []
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        if language is None or match.group(1) == language:
            found.append((text.count("\n", 0, match.start()) + 1, match.group(1),
                          match.group(2)))
    return found


def _prose(path: Path) -> str:
    """The text of ``path`` without its fenced code blocks."""
    return re.sub(r"^```\w*\n.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


# ---- config snippets -------------------------------------------------------------------

def _yaml_blocks():
    blocks = [(path, line, text) for path in DOCS for line, _, text in _blocks(path, "yaml")]
    return [pytest.param(path, line, text, id=_where(path, line)) for path, line, text in blocks
            if not any(marker in text for marker in NOT_CONFIGS)]


def test_the_skip_list_names_one_block_each():
    texts = [text for path in DOCS for _, _, text in _blocks(path, "yaml")]
    for marker, reason in NOT_CONFIGS.items():
        assert sum(marker in text for text in texts) == 1, (marker, reason)


@pytest.mark.parametrize("path, line, text", _yaml_blocks())
def test_a_config_snippet_validates(path, line, text, monkeypatch):
    try:  # csrun's own reader: it also refuses what PyYAML lets pass (a repeated key)
        sections = load_yaml(text, _where(path, line)).data
    except ConfigError as exc:
        pytest.fail(str(exc))
    assert isinstance(sections, dict) and set(sections) <= set(RunConfig.model_fields), \
        f"{_where(path, line)}: not a config's sections; if it is not meant to be a " \
        "config, add it to NOT_CONFIGS with the reason"
    base = ROOT / ("examples/text_classifier.yaml" if TEXT_EXAMPLE in text
                   else "examples/ps_jagged.yaml" if CLICKS_EXAMPLE in text
                   else "configs/quickstart.yaml")
    if WHOLE <= set(sections):
        merged = text  # a whole config: validated as it stands, not mixed with a base
    else:  # a fragment: its sections replace the base's (a problem names the block)
        merged = yaml.safe_dump({**yaml.safe_load(base.read_text(encoding="utf-8")),
                                 **sections}, sort_keys=False)
    monkeypatch.chdir(base.parent)  # its imports and relative paths, as the docs run it
    monkeypatch.syspath_prepend(str(base.parent))
    environ = PS_ENVIRON if "parameter_server" in merged else {}
    # The whole preflight: every snippet's files and imports exist in this repository, so
    # none needs the lighter read_config_text (schema only).
    try:
        load_config_text(merged, str(base), environ=environ)
    except ConfigError as exc:
        pytest.fail(f"{_where(path, line)} (on {base.name}): {exc}")


# ---- the JSON example ------------------------------------------------------------------

TINY = """\
strategy: {compute_devices: [CPU:0, CPU:1]}
dataset:
  source: {kind: synthetic, examples: 96, features: 4, classes: 3}
  holdout: 0.25
  steps: [{op: shuffle, buffer: 128}, {op: batch, size: 16}]
model: {kind: mlp, hidden: [8]}
optimizer: {name: SGD, lr: 0.1}
train: {steps: 4, log_every: 2}
checkpoint: {dir: ck, every_steps: 2}
"""


def _json_example() -> tuple[int, dict]:
    """docs/cli.md's JSON example, read as JSON: its ``//`` comments and ``, ...``
    elisions removed."""
    path = ROOT / "docs" / "cli.md"
    (line, _, text), = [b for b in _blocks(path) if b[1] == "json"]
    text = re.sub(r"\s*//[^\n]*", "", text)
    text = re.sub(r",\s*\.\.\.(?=\s*[\]}])", "", text)
    return line, json.loads(text)


def _key_differences(example, real, where: str = "") -> list[str]:
    """Where the keys of ``example`` and ``real`` differ, at every level both have."""
    if isinstance(example, list) and isinstance(real, list) and example and real:
        return _key_differences(example[0], real[0], where + "[0]")
    if not (isinstance(example, dict) and isinstance(real, dict)):
        return []
    found = [f"{where or 'top level'}: the example lacks {sorted(set(real) - set(example))}, "
             f"a real result lacks {sorted(set(example) - set(real))}"] \
        if set(example) != set(real) else []
    for key in set(example) & set(real):
        found += _key_differences(example[key], real[key], f"{where}.{key}".lstrip("."))
    return found


def test_the_json_example_has_the_keys_of_a_real_result(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("tiny.yaml").write_text(TINY)
    run = CliRunner().invoke(app, ["train", "tiny.yaml", "--json", "result.json"],
                             catch_exceptions=False)
    assert run.exit_code == 0, run.output
    real = json.loads(Path("result.json").read_text())
    line, example = _json_example()
    assert not _key_differences(example, real), (f"docs/cli.md:{line}", _key_differences(
        example, real))


def test_the_json_examples_digest_is_elided():
    # A digest is bit-exact: it depends on the CPU's floating point and the torch build,
    # so a full one would be true on one machine only. The example elides it.
    line, example = _json_example()
    assert example["params_sha256"] == "...", (
        f"docs/cli.md:{line}: write the digest as \"...\" (it differs between machines)")


# ---- links -----------------------------------------------------------------------------

def _anchors(path: Path) -> set[str]:
    """GitHub's anchors of the headings of ``path``."""
    headings = re.findall(r"^#+ (.+)$", _prose(path), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def _links():
    for path in LINKED:
        if not path.exists():
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(path)):
            if not re.match(r"[a-z]+:", target):  # https:, mailto:
                yield pytest.param(path, target, id=f"{path.name}->{target}")


@pytest.mark.parametrize("path, target", list(_links()))
def test_a_relative_link_resolves_inside_the_repository(path, target):
    file, _, anchor = target.partition("#")
    resolved = (path.parent / file).resolve() if file else path
    assert resolved == ROOT or ROOT in resolved.parents, f"{path.name}: {target} leaves the repo"
    assert resolved.exists(), f"{path.name}: {target} does not exist"
    if anchor:
        assert anchor in _anchors(resolved), f"{path.name}: {target}: no such heading"


def test_no_doc_points_outside_the_repository():
    for path in LINKED:
        if path.exists():
            text = path.read_text(encoding="utf-8")
            assert "../shared" not in text and "/work/" not in text, path.name


def test_the_changelog_exists():
    assert (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").startswith("# Changelog")


# ---- files and tests named ------------------------------------------------------------

def test_every_file_and_test_named_exists():
    """``core/.../x.py``, ``tests/.../test_x.py``, ``benchmarks/x.py`` and test functions
    the docs name as what checks a claim exist (test names: ``test_`` and a word)."""
    tests = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").rglob("*.py"))
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for name in re.findall(r"(?<![\w/.])((?:core|cli|tests|benchmarks|configs|examples)/"
                               r"[\w/-]*\.[a-z]+)\b", text):
            if "/runs/" not in name:  # what a run writes (a checkpoint) is not shipped
                assert (ROOT / name).exists(), f"{path.name}: {name} does not exist"
        for name in set(re.findall(r"\b(test_[a-z0-9]+(?:_[a-z0-9]+)+)\b", text)):
            found = f"def {name}(" in tests or any((ROOT / "tests").rglob(f"{name}.py"))
            assert found, f"{path.name}: no test {name}"


# ---- commands --------------------------------------------------------------------------

# `csrun SUB ...`, also as `python -m csrun.cli.main SUB ...` (torchrun's form); not
# csrun's own output (`csrun launch: completed ...`)
COMMAND = re.compile(r"(?:^|(?<=[\s(]))(?:csrun|-m csrun\.cli\.main)\s+(--?[\w-]+|[a-z][\w-]*)"
                     r"(?=\s|$)(.*)")
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def _shown() -> list[tuple[str, str, str]]:
    """Every command line the docs show, as (where, text, folder it runs in): from shell
    and plain code blocks (comments dropped, continued lines joined, a `cd` followed) and
    from inline code."""
    found = []
    for path in DOCS:
        for line, language, text in _blocks(path):
            if language not in ("", "bash", "sh"):
                continue
            folder = ""
            for offset, row in enumerate(text.replace("\\\n", " ").splitlines(), 1):
                for part in re.split(r"&&|\|\||;|\|", re.sub(r"(^|\s)#.*", "", row)):
                    moved = re.fullmatch(r"\s*cd\s+(\S+)\s*", part)
                    folder = moved.group(1) if moved else folder
                    found.append((_where(path, line + offset), part.strip(), folder))
        for span in re.findall(r"`([^`\n]+)`", _prose(path)):
            found.append((f"{path.relative_to(ROOT)} (inline)", span, ""))
    return found


def _commands() -> list[tuple[str, str, str]]:
    return [shown for shown in _shown() if COMMAND.search(shown[1])]


def test_the_docs_show_commands():
    assert len(_commands()) > 20  # the parser still finds them


def test_every_command_shown_names_real_subcommands_and_options():
    group = typer.main.get_command(app)
    root = {opt for p in group.params for opt in (*p.opts, *p.secondary_opts)} | {"--help"}
    options = {name: {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)} |
               {"--help"} for name, cmd in group.commands.items()}
    for where, command, _ in _commands():
        sub, rest = COMMAND.search(command).groups()
        if sub.startswith("-"):
            assert sub in root, f"{where}: `{command}`: csrun has no option {sub}"
            continue
        assert sub in options, f"{where}: `{command}`: no subcommand {sub!r} ({sorted(options)})"
        for option in OPTION.findall(rest):
            assert option in options[sub], f"{where}: `{command}`: {sub} has no {option}"


def _configs(command: str, folder: str) -> list[Path]:
    """The repository's config files ``command`` names (a made-up ``job.yaml`` is not)."""
    names = re.findall(r"(?<![\w/.{-])([\w./-]+\.yaml)\b", command)
    return [ROOT / folder / name for name in names
            if folder or name.startswith(("configs/", "examples/"))]


def test_every_config_a_command_names_exists():
    for where, command, folder in _commands():
        for path in _configs(command, folder):
            assert path.is_file(), f"{where}: `{command}`: {path.relative_to(ROOT)} does not exist"


def test_the_overrides_a_command_shows_apply_to_its_config(monkeypatch):
    checked = 0
    for where, command, folder in _commands():
        sub, rest = COMMAND.search(command).groups()
        overrides = [t for t in shlex.split(rest) if "=" in t and not t.startswith("-")]
        if sub in ("train", "validate") and overrides and _configs(command, folder):
            config, = _configs(command, folder)
            monkeypatch.chdir(config.parent)
            try:
                load_config(config, overrides)
            except ConfigError as exc:
                pytest.fail(f"{where}: `{command}`: {exc}")
            checked += 1
    assert checked  # README's override example is one
