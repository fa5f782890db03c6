"""How long each shipped CPU config takes from the command line, against the README's
"under a minute on 2 CPU cores": the timing half of tests/integration/test_shipped_configs.

The tests check that each config trains to a meaningful accuracy; how long a run takes is
measured here: ``csrun train`` for the central-storage configs and ``csrun launch
--workers 2 --ps 1`` for the parameter-server ones, each a fresh process (torch's import
included, as a user sees it), on a copy of the config in a temporary folder (its outputs go
there). Target: each under SHIPPED_CONFIG_LIMIT_S.

    python benchmarks/shipped_configs.py
    python benchmarks/shipped_configs.py --configs quickstart --json /tmp/shipped.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # targets
from targets import SHIPPED_CONFIG_LIMIT_S  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CSRUN = [sys.executable, "-m", "csrun.cli.main"]


def command(path: Path) -> list[str] | None:
    """How the config's header says to run it on CPUs; None for one that needs GPUs."""
    strategy = yaml.safe_load(path.read_text()).get("strategy") or {}
    if strategy.get("kind") == "parameter_server":
        return CSRUN + ["launch", path.name, "--workers", "2", "--ps", "1"]
    devices = strategy.get("compute_devices")
    if devices is None or any(str(d).upper().startswith(("GPU", "CUDA", "/GPU"))
                              for d in devices):
        return None
    return CSRUN + ["train", path.name]


def measure(names: list[str] | None) -> list[dict]:
    rows = []
    for path in sorted(CONFIGS.glob("*.yaml")):
        argv = command(path)
        if argv is None or (names and path.stem not in names):
            continue
        with tempfile.TemporaryDirectory() as folder:
            shutil.copy(path, folder)
            begin = time.perf_counter()
            done = subprocess.run(argv, cwd=folder, capture_output=True, text=True)
            seconds = time.perf_counter() - begin
        if done.returncode != 0:
            raise SystemExit(f"{path.name}: exit {done.returncode}\n{done.stderr[-2000:]}")
        rows.append({"config": path.stem, "command": " ".join(argv[3:]), "seconds": seconds,
                     "verdict": "met" if seconds < SHIPPED_CONFIG_LIMIT_S else "missed"})
        print(f"{path.stem}: {seconds:.1f} s; target < {SHIPPED_CONFIG_LIMIT_S:g} s: "
              f"{rows[-1]['verdict']}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", help="only these (file names without .yaml)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    rows = measure(args.configs)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"configs": rows, "target_s": SHIPPED_CONFIG_LIMIT_S}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
