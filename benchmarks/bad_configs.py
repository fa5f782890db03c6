"""How long ``csrun validate`` takes to refuse the worst configs: the timing half of the
reliability tests' bad-input cases.

tests/reliability checks that every bad or tricky config is refused cleanly (exit 2,
every problem named, no traceback) and that the alias and nesting limits are reached; how
long each refusal takes is measured here, in-process as the tests run it: the corpus of
tricky configs (tests/reliability/corpus), alias bombs of every size the fuzz test draws
(``width**depth`` aliases, width 2-12, depth 1-14) and nesting of 1 to 20,000 levels.
Target: every case under BAD_CONFIG_LIMIT_S (docs/reliability.md: "under 10 s").

    python benchmarks/bad_configs.py
    python benchmarks/bad_configs.py --quick --json /tmp/bad.json   # a few cases of each
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from typer.testing import CliRunner

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # targets
from targets import BAD_CONFIG_LIMIT_S  # noqa: E402

from csrun.cli.main import app  # noqa: E402

CORPUS = Path(__file__).resolve().parents[1] / "tests" / "reliability" / "corpus"
VALID = """\
strategy: {compute_devices: [CPU:0, CPU:1], parameter_device: CPU:0}
dataset:
  source: {kind: synthetic, examples: 64, features: 4, classes: 3}
  steps: [{op: batch, size: 16}]
model: {kind: mlp, hidden: [8]}
train: {steps: 4}
"""
NESTING = {"[": "]", "{a: ": "}", "{": "}", "- ": ""}


def alias_bomb(width: int, depth: int) -> str:
    lines = ['a0: &a0 ["lol"]']
    for level in range(1, depth + 1):
        lines.append(f"a{level}: &a{level} [" + ", ".join([f"*a{level - 1}"] * width) + "]")
    return VALID + "\n".join(lines) + "\n"


def nested(style: str, depth: int) -> str:
    body = style * depth + "1" + NESTING[style] * depth
    if style == "- ":  # block sequences in sequences: "- - - 1" on the next line
        body = "\n    " + body
    return VALID.replace("steps: 4", f"steps: {body}")


def cases(quick: bool) -> dict[str, Path | str]:
    """Name -> the corpus file, or the generated text."""
    found: dict[str, Path | str] = {f"corpus/{p.name}": p for p in sorted(CORPUS.iterdir())
                                    if p.name != "expected.yaml"}
    widths, depths = ((2, 12), (1, 5, 14)) if quick else (range(2, 13), range(1, 15))
    found.update({f"alias bomb {w}**{d}": alias_bomb(w, d) for w in widths for d in depths})
    for style in NESTING:
        for depth in (1, 64, 65, 20_000) if not quick else (65, 20_000):
            found[f"nesting {style.strip()!r} x{depth}"] = nested(style, depth)
    return found


def measure(quick: bool) -> list[dict]:
    """Each case's seconds and exit code (the first validation, which imports torch's
    optimizers and the meta device, is not counted: the tests do the same)."""
    runner, rows = CliRunner(), []
    with tempfile.TemporaryDirectory() as folder:
        valid = Path(folder, "valid.yaml")
        valid.write_text(VALID, encoding="utf-8")
        runner.invoke(app, ["validate", str(valid)])
        for name, case in cases(quick).items():
            path = case if isinstance(case, Path) else Path(folder, "case.yaml")
            if not isinstance(case, Path):
                path.write_text(case, encoding="utf-8")
            begin = time.perf_counter()
            done = runner.invoke(app, ["validate", str(path), "--json", "-"])
            rows.append({"case": name, "seconds": time.perf_counter() - begin,
                         "exit_code": done.exit_code})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few cases of each kind")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    rows = measure(args.quick)
    slowest = max(rows, key=lambda row: row["seconds"])
    verdict = "met" if slowest["seconds"] < BAD_CONFIG_LIMIT_S else "missed"
    for row in sorted(rows, key=lambda row: -row["seconds"])[:5]:
        print(f"{row['seconds'] * 1e3:8.0f} ms  exit {row['exit_code']}  {row['case']}")
    print(f"{len(rows)} bad or tricky configs, slowest {slowest['seconds'] * 1e3:.0f} ms "
          f"({slowest['case']}); target < {BAD_CONFIG_LIMIT_S:g} s each: {verdict}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"cases": rows, "slowest": slowest, "target_s": BAD_CONFIG_LIMIT_S,
                       "verdict": verdict}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
