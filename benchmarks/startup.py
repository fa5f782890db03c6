"""How long ``csrun`` takes to answer ``--help`` and ``--version``, against ``import torch``.

CI scripts call the CLI many times; issue 27 asks that ``csrun --help``, ``--version`` and
each command's ``--help`` take under 0.3x the time of ``python -c "import torch"``. Each
round runs every command once in a fresh process, interleaved with ``import torch`` (the
machine's speed drifts between rounds); a command's figure is the median over rounds of
the paired ratio command / import torch, with its 95% interval and verdict
(benchmarks/targets.py). ``validate`` (which needs torch) is measured alongside, for
reference, without a target.

    python benchmarks/startup.py                    # 11 rounds
    python benchmarks/startup.py --rounds 21 --json /tmp/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from targets import median_interval, verdict  # noqa: E402

STARTUP_TARGET = 0.3  # the most a command's time / import torch's the issue allows
_ROOT = pathlib.Path(__file__).resolve().parents[1]
_CSRUN = [sys.executable, "-m", "csrun.cli"]  # the console script's entry, any venv
COMMANDS = {
    "--help": ["--help"], "--version": ["--version"],
    "train --help": ["train", "--help"], "validate --help": ["validate", "--help"],
    "launch --help": ["launch", "--help"],
    "inspect-devices --help": ["inspect-devices", "--help"],
}
REFERENCE = {"validate quickstart": ["validate", str(_ROOT / "configs/quickstart.yaml")]}


def seconds(command: list[str]) -> float:
    """Wall time of one fresh process running ``command`` (it must exit 0)."""
    begin = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=_ROOT)
    return time.perf_counter() - begin


def measure(rounds: int) -> dict:
    torch_s: list[float] = []
    times: dict[str, list[float]] = {name: [] for name in {**COMMANDS, **REFERENCE}}
    for _ in range(rounds):
        torch_s.append(seconds([sys.executable, "-c", "import torch"]))
        for name, args in {**COMMANDS, **REFERENCE}.items():
            times[name].append(seconds(_CSRUN + args))
    figures = {}
    for name, values in times.items():
        ratios = [v / t for v, t in zip(values, torch_s)]
        interval = median_interval(ratios)
        figures[name] = {"median_s": statistics.median(values),
                         "ratio_to_import_torch": statistics.median(ratios),
                         "ratio_interval": interval,
                         "verdict": verdict(interval, STARTUP_TARGET, at_least=False)
                         if name in COMMANDS else "no target"}
    return {"python": sys.version.split()[0], "rounds": rounds, "target": STARTUP_TARGET,
            "import_torch_median_s": statistics.median(torch_s), "commands": figures}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args()
    result = measure(args.rounds)
    print(f"import torch: {result['import_torch_median_s']:.3f} s (median of "
          f"{args.rounds}); target: each command under {STARTUP_TARGET}x that")
    for name, f in result["commands"].items():
        low, high = f["ratio_interval"] or (float("nan"), float("nan"))
        print(f"  csrun {name:<24} {f['median_s']:.3f} s  {f['ratio_to_import_torch']:.3f}x "
              f"[{low:.3f}, {high:.3f}]  {f['verdict']}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
