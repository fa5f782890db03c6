"""Which torch releases csrun's fast test suite passes on, each in a throwaway venv.

For each torch version it makes (or reuses) a venv under the cache directory, installs
``torch==V`` and csrun with its test extra there (a constraints file stops pip from moving
torch; torch before 2.3 was built against NumPy 1, so it gets ``numpy<2``), runs the fast
suite -- what ``python -m pytest`` runs: ``tests/`` without the ``slow`` and ``process``
markers -- and prints one verdict line per version, then the table README's "Set up"
shows; a JSON summary goes next to the venvs.
Defaults: the lowest torch pyproject.toml allows, the first release whose compiled
replicas run compiled (a middle one) and the newest pip can install here.

    python benchmarks/torch_versions.py                    # lowest, middle, newest here
    python benchmarks/torch_versions.py 2.13.0 2.14.1      # chosen releases, one at a time
    python benchmarks/torch_versions.py --cache /tmp/tv --json /tmp/tv.json --fresh

A release below pyproject's bound is refused up front (pip would refuse csrun next to it):
lower the bound there to try one.

Not a test: pytest collects only tests/ and CI does not run it; run it by hand when the
torch bound in pyproject.toml moves, and put its table in README's "Set up". A venv is
kept for the next run and rebuilt when a run broke off while building it; pip's output
and pytest's go to ``install.log`` and ``pytest.log`` inside it. PyPI's torch wheels for
Linux are CUDA builds (a venv of 3-6 GB); the suite runs on the CPU all the same. Exit
status: 0 when every version passed, 1 when a suite failed or timed out, 2 when a
version could not be set up, 130 on Ctrl-C or SIGTERM (which stop the running child and
its own children first).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
SUITE = ["tests"]  # pyproject's testpaths: the default run's
# The middle release of the default three: the first whose compiled replicas compile
# (csrun.core.distribute.torch_internals.COMPILED_REPLICAS_SINCE); below it they run eagerly.
MIDDLE = "2.11.0"
SLOW_MARKERS = ("slow", "process")  # what the default `python -m pytest` leaves out
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "csrun" / "torch-versions"
NUMPY1_BEFORE = (2, 3)  # torch releases before this were built against NumPy 1.x
# what a child must not inherit: it would put another environment's packages first
LEAKY = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
CHECK = ("import os, numpy, torch, csrun.core; "
         "assert float(torch.from_numpy(numpy.ones(3)).sum()) == 3.0; "
         "print(torch.__version__, numpy.__version__, os.path.dirname(csrun.core.__file__))")


class Stopped(KeyboardInterrupt):
    """SIGTERM arrived: handled like Ctrl-C."""


def _on_sigterm(signum, frame):
    raise Stopped()


class SetupError(Exception):
    """A version's venv could not be made; the message says why."""


def release(version: str) -> tuple[int, ...]:
    """``"2.2.2+cu121"`` -> ``(2, 2, 2)``, trailing zeros dropped: ``"2.4"`` == ``"2.4.0"``."""
    match = re.match(r"(\d+(?:\.\d+)*)", version)
    if not match:
        raise SetupError(f"{version!r} is not a torch version (e.g. 2.4.0)")
    parts = [int(p) for p in match.group(1).split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def canonical(version: str) -> str:
    """``"2.4"`` -> ``"2.4.0"`` (one venv per release, however it is spelled); a
    version with a suffix (``2.5.0rc1``) is kept as given."""
    if not re.fullmatch(r"\d+(\.\d+)*", version):
        return version
    parts = version.split(".")
    return ".".join(parts + ["0"] * (3 - len(parts)))


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LEAKY}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _stop(proc: subprocess.Popen) -> None:
    """Stop proc's whole process group: SIGTERM, 10 s of grace, then SIGKILL."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    _kill_group(proc)


def _kill_group(proc: subprocess.Popen) -> None:
    # Safe after the leader is reaped: Linux reuses no pid that is still some group's id.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run(cmd: list, timeout: float, log: Path, cwd: Path = ROOT) -> int | None:
    """Run ``cmd`` in a process group of its own, its output appended to ``log``.

    Returns the exit status, or None when it ran past ``timeout`` seconds and was stopped.
    Ctrl-C / SIGTERM stop the group (pytest's children included) and propagate; leftover
    children of a finished command are killed too.
    """
    with open(log, "ab") as out:
        out.write(f"\n$ {' '.join(map(str, cmd))}\n".encode())
        out.flush()
        proc = subprocess.Popen([str(c) for c in cmd], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=cwd, env=child_env(),
                                start_new_session=True)
        try:
            status = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            _stop(proc)
            return None
        except BaseException:
            _stop(proc)
            raise
        _kill_group(proc)
        return status


def pip_errors(log: Path) -> str:
    """pip's reason for a failed install: its ERROR lines and the constraints it blames."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    start = max(i for i, line in enumerate(lines) if line.startswith("$ "))
    keep = [line.strip() for line in lines[start:]
            if line.startswith("ERROR:") or "(constraint)" in line or "depends on" in line]
    text = " / ".join(keep) or (lines[-1] if lines else "no output")
    return text if len(text) <= 400 else text[:400] + " ..."


def pyproject_lowest() -> str:
    """The version in pyproject.toml's ``torch>=X``."""
    match = re.search(r'"torch\s*>=\s*([0-9][0-9.]*)', PYPROJECT.read_text())
    if not match:
        raise SetupError(f"{PYPROJECT} has no torch>=X requirement to read the lowest from")
    return match.group(1)


def fast_markers() -> str:
    """``-m`` for the fast suite: not any slow marker pyproject registers (pytest refuses
    an unregistered marker in ``-m``)."""
    block = re.search(r"markers\s*=\s*\[(.*?)\]", PYPROJECT.read_text(), re.S)
    registered = set(re.findall(r"[\"'](\w+)\s*:", block.group(1))) if block else set()
    return " and ".join(f"not {m}" for m in SLOW_MARKERS if m in registered)


def newest_installable(cache: Path, timeout: float) -> str:
    """The torch pip would pick here: the index's newest allowed by pip's constraints."""
    report, log = cache / "newest.json", cache / "newest.log"
    status = run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps",
                  "--ignore-installed", "--quiet", "--report", report, "torch"], timeout, log)
    if status != 0:
        raise SetupError(f"pip could not pick the newest torch: {pip_failure(status, log)} "
                         f"(log: {log})")
    return json.loads(report.read_text())["install"][0]["metadata"]["version"]


def wanted(version: str, numpy: str | None) -> dict:
    """What a ready venv was built for; any change reruns pip there."""
    digest = hashlib.sha256(PYPROJECT.read_bytes()).hexdigest()
    return {"torch": version, "numpy": numpy, "repo": str(ROOT), "pyproject": digest}


def prepare(venv: Path, version: str, numpy: str | None, args) -> dict:
    """Make ``venv`` hold torch==version and csrun[test]; returns what is installed there.

    A venv without its marker broke off mid-build and is made again; one whose marker
    differs from what is wanted (pyproject.toml edited, another checkout, another numpy)
    gets pip run again, which only changes what changed.
    """
    marker, python = venv / "csrun-ready.json", venv / "bin" / "python"
    want = wanted(version, numpy)
    ready = json.loads(marker.read_text()) if marker.exists() else None
    if ready and ready.get("want") == want and not args.fresh:
        return ready
    if ready is None or args.fresh:
        shutil.rmtree(venv, ignore_errors=True)
        venv.mkdir(parents=True)
        step(run([sys.executable, "-m", "venv", venv], 300, venv / "install.log"),
             "python -m venv", venv / "install.log", 300)
    marker.unlink(missing_ok=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(f"torch=={version}\n" + (f"numpy{numpy}\n" if numpy else ""))
    log = venv / "install.log"
    status = run([python, "-m", "pip", "install", "-c", constraints, f"torch=={version}",
                  "-e", f"{ROOT}[test]"], args.install_timeout, log)
    if status != 0:
        raise SetupError(f"torch=={version} cannot be installed here: "
                         f"{pip_failure(status, log)} (log: {log})")
    installed = check(python, version, venv / "install.log")
    ready = {"want": want, **installed}
    marker.write_text(json.dumps(ready, indent=1))
    return ready


def pip_failure(status: int | None, log: Path) -> str:
    """Why a pip run failed: it timed out, or the errors its log names."""
    return "timed out" if status is None else pip_errors(log)


def step(status: int | None, what: str, log: Path, timeout: float) -> None:
    if status is None:
        raise SetupError(f"{what} ran past {timeout:.0f} s (log: {log})")
    if status != 0:
        raise SetupError(f"{what} failed with status {status} (log: {log})")


def check(python: Path, version: str, log: Path) -> dict:
    """torch, numpy and csrun import in the venv, torch is ``version``, csrun is this checkout."""
    out = log.with_name("check.out")
    out.unlink(missing_ok=True)
    status = run([python, "-c", CHECK], 300, out)
    last = (out.read_text(errors="replace").strip().splitlines() or ["no output"])[-1]
    if status != 0:
        hint = "; a NumPy mismatch? try --numpy '<2'" if "numpy" in last.lower() else ""
        raise SetupError(f"torch=={version} installed but csrun cannot use it: {last} "
                         f"(log: {out}{hint})")
    torch_v, numpy_v, csrun_dir = last.split()
    if release(torch_v) != release(version):
        raise SetupError(f"asked for torch {version}, pip installed {torch_v} (log: {log})")
    if Path(csrun_dir) != ROOT / "core":
        raise SetupError(f"the venv imports csrun from {csrun_dir}, not {ROOT}; rerun with --fresh")
    return {"installed": torch_v, "numpy": numpy_v}


def run_suite(venv: Path, args) -> dict:
    """The fast suite in ``venv``: counts from pytest's JUnit XML, failures from its log."""
    junit, log = venv / "junit.xml", venv / "pytest.log"
    junit.unlink(missing_ok=True)
    log.write_text("")
    cmd = [venv / "bin" / "python", "-m", "pytest", *args.paths, "-q", "-p", "no:cacheprovider",
           *(["-m", args.markers] if args.markers else []), f"--junitxml={junit}"]
    start = time.monotonic()
    status = run(cmd, args.test_timeout, log)
    result = {"wall_s": round(time.monotonic() - start, 1), "pytest_status": status,
              "log": str(log)}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
        result.update(passed=counts["tests"] - counts["failures"] - counts["errors"]
                      - counts["skipped"], failed=counts["failures"], errors=counts["errors"],
                      skipped=counts["skipped"])
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    result["failures"] = [line for line in lines if line.startswith(("FAILED ", "ERROR "))]
    if status is None:
        result["reason"] = f"stopped after {args.test_timeout:.0f} s (--test-timeout)"
    elif status not in (0, 1):  # not a test's failure: a usage or collection error
        result["reason"] = f"pytest exit {status}: {lines[-1] if lines else 'no output'}"
    result["verdict"] = ("timed out" if status is None else "passed" if status == 0
                         else "failed")
    return result


def one_version(version: str, args) -> dict:
    numpy = args.numpy or ("<2" if release(version) < NUMPY1_BEFORE else None)
    tag = f"torch-{version}-py{sys.version_info.major}.{sys.version_info.minor}"
    venv = args.cache / tag
    print(f"torch {version}: setting up {venv} ...", file=sys.stderr, flush=True)
    try:
        lowest = pyproject_lowest()
        if release(version) < release(lowest):  # pip would refuse csrun next to it
            raise SetupError(f"torch {version} is below pyproject.toml's torch>={lowest}; "
                             f"lower that bound to try it")
        ready = prepare(venv, version, numpy, args)
    except SetupError as error:
        return {"torch": version, "verdict": "not set up", "reason": str(error)}
    print(f"torch {ready['installed']}: running {' '.join(args.paths)} -m '{args.markers}' "
          f"(log: {venv / 'pytest.log'}) ...", file=sys.stderr, flush=True)
    return {"torch": version, "installed": ready["installed"], "numpy": ready["numpy"],
            **run_suite(venv, args)}


def verdict_line(r: dict) -> str:
    if r["verdict"] == "not set up":
        return f"torch {r['torch']:<13} NOT SET UP: {r['reason']}"
    counts = (f"passed {r['passed']}  failed {r['failed']}  errors {r['errors']}  "
              f"skipped {r['skipped']}" if "passed" in r else "no JUnit report")
    reason = f" ({r['reason']})" if "reason" in r else ""
    return (f"torch {r['installed']:<13} numpy {r['numpy']:<7} {counts}  "
            f"{r['wall_s']:.0f} s  {r['verdict'].upper()}{reason}")


def table(summary: dict) -> str:
    """The results as README's Markdown table: one row per release."""
    rows = ["| torch | numpy | passed | failed | errors | skipped | pytest time | verdict |",
            "|---|---|---|---|---|---|---|---|"]
    for r in summary["results"]:
        if "passed" not in r:
            rows.append(f"| {r['torch']} | | | | | | | {r['verdict']} |")
            continue
        rows.append(f"| {r['installed']} | {r['numpy']} | {r['passed']} | {r['failed']} | "
                    f"{r['errors']} | {r['skipped']} | {r['wall_s'] / 60:.0f} min | "
                    f"{r['verdict']} |")
    return "\n".join(rows)


def parse(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("versions", nargs="*", metavar="VERSION",
                        help="torch releases to test (default: pyproject's lowest, "
                             f"{MIDDLE} and the newest pip can install here)")
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"the venvs (default {CACHE})")
    parser.add_argument("--json", type=Path, help="the summary (default CACHE/summary.json)")
    parser.add_argument("--fresh", action="store_true", help="rebuild the venvs from scratch")
    parser.add_argument("--numpy", metavar="SPEC",
                        help="numpy constraint for every version, e.g. '<2' (default: <2 "
                             "for torch before 2.3, none after)")
    parser.add_argument("--paths", nargs="+", default=SUITE, help="what pytest runs")
    markers = fast_markers()
    parser.add_argument("--markers", default=markers,
                        help=f"pytest -m (default {markers!r}: leaves out whichever "
                             f"of {', '.join(SLOW_MARKERS)} pyproject registers)")
    parser.add_argument("--install-timeout", type=float, default=1800, metavar="S")
    parser.add_argument("--test-timeout", type=float, default=3600, metavar="S")
    args = parser.parse_args(argv)
    args.cache = args.cache.resolve()
    args.json = args.json or args.cache / "summary.json"
    return args


def main(argv=None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, _on_sigterm)
    args.cache.mkdir(parents=True, exist_ok=True)
    summary = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
               "platform": platform.platform(), "paths": args.paths, "markers": args.markers,
               "results": []}
    try:
        versions = args.versions or [pyproject_lowest(), MIDDLE,
                                     newest_installable(args.cache, args.install_timeout)]
        for version in versions:
            release(version)  # a typo fails before hours of installs, not after
        for version in dict.fromkeys(map(canonical, versions)):
            summary["results"].append(one_version(version, args))
            print(verdict_line(summary["results"][-1]), flush=True)
            for line in summary["results"][-1].get("failures", [])[:5]:
                print(f"    {line}")
        print("\n" + table(summary), flush=True)
    except SetupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("stopped: the version in progress is unfinished; its venv is rebuilt next time "
              "if it broke off while building", file=sys.stderr)
        return 130
    finally:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
        print(f"summary: {args.json}", file=sys.stderr)
    verdicts = {r["verdict"] for r in summary["results"]}
    return 2 if "not set up" in verdicts else 0 if verdicts == {"passed"} else 1


if __name__ == "__main__":
    sys.exit(main())
