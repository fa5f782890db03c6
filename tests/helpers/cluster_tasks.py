"""The tasks of one parameter-server job as `csrun train` processes, each with its own
TF_CONFIG, in one folder: each task's log and --json result by its name."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable


class ClusterTasks:
    def __init__(self, folder: Path, cluster: dict):
        self.folder, self.cluster = folder, cluster
        self.procs: list[subprocess.Popen] = []

    def spawn(self, job: str, index: int, name: str, overrides: tuple = (),
              place: Callable | None = None, env: dict | None = None) -> subprocess.Popen:
        """Start task ``job:index`` as ``name`` (``name.log``, ``name.json``); ``place``
        wraps its command (to run it on another host)."""
        environ = {k: v for k, v in os.environ.items() if k != "CSRUN_TRACEBACK"}
        environ.update(env or {}, TF_CONFIG=json.dumps(
            {"cluster": self.cluster, "task": {"type": job, "index": index}}))
        argv = [sys.executable, "-m", "csrun.cli", "train", "c.yaml", *overrides,
                "--json", f"{name}.json"]
        proc = subprocess.Popen(place(job, index, argv) if place else argv, cwd=self.folder,
                                env=environ, stdout=open(self.folder / f"{name}.log", "w"),
                                stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.folder / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_log(self, name: str, text: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log(name):
            assert time.monotonic() < deadline, f"no {text!r} in {name}: {self.log(name)}"
            time.sleep(0.05)

    def result(self, name: str) -> dict:
        return json.loads((self.folder / f"{name}.json").read_text())

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
