"""Property-based: every broken config or override exits 2, names where, never a traceback.

Each property generates configs (hypothesis) and runs ``csrun validate ... --json -`` on
them in-process; the ``validate`` fixture checks the common rules of every rejection
(exit 0 or 2, a JSON list of problems, a short human message, no traceback). The
properties add what each kind of damage must produce; the alias and nesting limits are
what bound the time (benchmarks/bad_configs.py measures it).
"""

from __future__ import annotations

import yaml
from hypothesis import assume, given
from hypothesis import strategies as st

from csrun.core.config.safe_yaml import MAX_ALIASES, MAX_DEPTH
from tests.helpers.broken_configs import FUZZ, SIMPLE_KEY, VALID, block_yaml, breaks, related


def _expect_refusal(outcome, broken, text: str | None = None, override: str | None = None):
    """Exit 2 with a problem about the broken path (at its line, or naming the override),
    unless the break may leave the config valid."""
    if broken.may_pass and outcome.exit_code == 0:
        return
    assert outcome.exit_code == 2, f"{broken.kind} at {broken.dotted!r} was accepted"
    about = [p for p in outcome.problems if related(p["path"], broken.dotted)]
    assert about, (broken.kind, broken.dotted, outcome.problems)
    if override is not None:
        assert any(p["origin"] == f"override {override!r}" for p in about), about
    elif text is not None and broken.kind != "delete":  # a missing key has no line
        _expect_line(about, broken, text.splitlines())


def _expect_line(about: list[dict], broken, lines: list[str]) -> None:
    """A problem at the broken key points at the line that holds it."""
    exact = [p for p in about if p["path"] == broken.dotted and p["line"]]
    last = broken.path[-1] if broken.path else None
    if not exact or not isinstance(last, str) or not SIMPLE_KEY.match(last):
        return
    for problem in exact:
        assert 1 <= problem["line"] <= len(lines)
        assert last in lines[problem["line"] - 1], (problem, lines)


@FUZZ
@given(broken=breaks(VALID))
def test_a_broken_config_file_is_refused_where_it_is_broken(broken, validate, work):
    text = block_yaml(broken.data)
    assume(text is not None)
    path = work / "broken.yaml"
    path.write_text(text, encoding="utf-8")
    _expect_refusal(validate(path), broken, text=text)


@FUZZ
@given(broken=breaks(VALID))
def test_a_broken_override_is_refused_naming_the_override(broken, validate, work, valid_file):
    override = broken.override()
    assume(override is not None)
    _expect_refusal(validate(valid_file, override), broken, override=override)


@FUZZ
@given(data=st.binary(max_size=4096))
def test_binary_garbage_is_refused(data, validate, work):
    path = work / "garbage.yaml"
    path.write_bytes(data)
    assert validate(path).exit_code == 2


@FUZZ
@given(text=st.text(max_size=2000))
def test_random_unicode_text_is_refused(text, validate, work):
    path = work / "text.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    assert validate(path).exit_code == 2


@st.composite
def damaged_yaml(draw) -> tuple[str, str]:
    """The valid config with YAML-level damage: a tab, a stray syntax character, a cut."""
    lines = block_yaml(VALID).splitlines(keepends=True)
    how = draw(st.sampled_from(["tab", "character", "cut"]))
    if how == "tab":  # a tab in the indentation of an indented line: always an error
        i = draw(st.sampled_from([i for i, line in enumerate(lines) if line[:1] == " "]))
        j = draw(st.integers(0, len(lines[i]) - len(lines[i].lstrip(" "))))
        lines[i] = lines[i][:j] + "\t" + lines[i][j:]
        return how, "".join(lines)
    text = "".join(lines)
    at = draw(st.integers(0, len(text)))
    if how == "cut":
        return how, text[:at]
    return how, text[:at] + draw(st.sampled_from(list(":{}[]\"'&*!|>%@`#-,?\\\t"))) + text[at:]


@FUZZ
@given(damage=damaged_yaml())
def test_yaml_syntax_damage_and_tabs_are_refused_at_their_line(damage, validate, work):
    how, text = damage
    path = work / "damaged.yaml"
    path.write_text(text, encoding="utf-8")
    outcome = validate(path)
    if how == "tab":
        assert outcome.exit_code == 2
        assert any("tab" in (p["hint"] or "") and p["line"] for p in outcome.problems)


@FUZZ
@given(width=st.integers(2, 12), depth=st.integers(1, 14))
def test_alias_bombs_are_refused_in_bounded_time(width, depth, validate, work):
    lines = ['a0: &a0 ["lol"]']
    for level in range(1, depth + 1):
        refs = ", ".join([f"*a{level - 1}"] * width)
        lines.append(f"a{level}: &a{level} [{refs}]")
    path = work / "bomb.yaml"
    path.write_text(yaml.safe_dump(VALID) + "\n".join(lines) + "\n")
    outcome = validate(path)
    assert outcome.exit_code == 2
    if width * depth > MAX_ALIASES or width ** depth > 100_000:
        assert any("alias" in p["message"] or "expands" in p["message"]
                   for p in outcome.problems)


@FUZZ
@given(depth=st.integers(1, 20_000), style=st.sampled_from(["[", "{a: ", "- ", "{"]))
def test_deep_nesting_is_refused_in_bounded_time(depth, style, validate, work):
    closing = {"[": "]", "{a: ": "}", "{": "}", "- ": ""}[style]
    body = style * depth + "1" + closing * depth
    if style == "- ":  # block sequences in sequences: "- - - 1" on the next line
        body = "\n    " + body
    path = work / "deep.yaml"
    path.write_text(yaml.safe_dump(VALID).replace("steps: 4", f"steps: {body}"))
    outcome = validate(path)
    assert outcome.exit_code == 2
    if depth > MAX_DEPTH:
        assert any("nests deeper" in p["message"] for p in outcome.problems)


@FUZZ
@given(overrides=st.lists(st.text(max_size=60), min_size=1, max_size=4))
def test_random_override_strings_are_refused_or_valid(overrides, validate, valid_file):
    outcome = validate(valid_file, *overrides)
    bad_syntax = [o for o in overrides if "=" not in o or not o.partition("=")[0].strip()]
    if bad_syntax:
        assert outcome.exit_code == 2
        assert any("is not key=value" in p["message"] for p in outcome.problems)


@FUZZ
@given(name=st.text(min_size=1, max_size=40).filter(
    lambda n: "/" not in n and "\0" not in n and n not in (".", "..")))
def test_a_missing_config_file_is_refused_with_its_name(name, validate, work):
    try:
        path = work / "missing" / f"{name}.yaml"
        path.exists()
    except (OSError, ValueError):  # a name this filesystem cannot spell at all
        assume(False)
    outcome = validate(path)
    assert outcome.exit_code == 2 and "not found" in outcome.problems[0]["message"]
