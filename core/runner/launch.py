"""A whole parameter-server job on this machine, for trying it out and for tests.

``csrun launch CONFIG --workers 2 --ps 1`` starts one ``csrun train CONFIG`` process per
task -- the ps tasks, the chief (``--chief``, else ``worker:0`` is the chief) and the
workers -- on loopback ports picked free, each with its own ``TF_CONFIG``. Each task
writes its output to ``<logs>/<job>-<index>.stdout.log`` and ``.stderr.log`` (so a task
outlives a launcher that dies); the launcher follows the files and reports every line,
waits, and judges the job: a task that fails with an error of its own, the chief or a ps
fails it; a worker lost to a signal does not (TF's rule; the chief reports it). Without
``--logs`` the logs go to a temporary folder, removed when the job went well (kept when
it failed or lost a worker).

Signals: the first Ctrl-C or SIGTERM goes to every task (workers stop after their step,
the chief saves a checkpoint and ends the job, the ps tasks serve until then); a second
one kills them all. Tasks run in their own sessions, so a terminal's Ctrl-C reaches them
only through the launcher, once.

Example::

    plan = plan_launch("configs/ps_local.yaml", [], workers=2, ps=1)   # validates
    result = launch(plan, on_event=print)
    result.exit_code, result.tasks
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Sequence

from ..config import strict_json
from ..config.schema import RunConfig
from .preflight import load_config
from .preflight import check_writable
from ..config.problems import ConfigError, Problem
from ..cluster.coordinator import echoes

__all__ = ["LaunchPlan", "LaunchResult", "thread_settings", "TaskStarted", "TaskOutput", "TaskExited",
           "plan_launch", "launch", "tf_config", "describe_exit", "MAX_TASKS"]

MAX_TASKS = max(8, 4 * (os.cpu_count() or 1))  # each task is a Python process with torch
_POLL = 0.1
_AFTER_CHIEF_S = 30.0  # how long the others may take to end once the chief has
_KILL_AFTER_S = 10.0   # from SIGTERM to SIGKILL


@dataclasses.dataclass
class TaskStarted:
    task: str       # "worker:1"
    address: str    # "127.0.0.1:41234"
    pid: int
    chief: bool
    stdout: str     # log files
    stderr: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class TaskOutput:
    """One line a task wrote (``stream``: ``stdout`` or ``stderr``)."""

    task: str
    stream: str
    line: str


@dataclasses.dataclass
class TaskExited:
    task: str
    exit_code: int  # negative: killed by that signal
    seconds: float


@dataclasses.dataclass
class LaunchPlan:
    """A validated job: the config, its cluster on loopback, and each task's command."""

    config: str
    overrides: list[str]
    cluster: dict[str, list[str]]
    chief: str                      # "chief:0" or "worker:0"
    resume: bool
    logs: pathlib.Path
    run_config: RunConfig | None
    logs_temporary: bool = False    # csrun made the folder: removed if the job goes well

    @property
    def tasks(self) -> list[str]:
        """ps tasks first (they host the store), then the chief and the workers."""
        return [f"{job}:{i}" for job in ("ps", "chief", "worker")
                for i in range(len(self.cluster.get(job, [])))]

    def tf_config(self, task: str) -> str:
        return tf_config(self.cluster, task)

    def command(self, task: str) -> list[str]:
        command = [sys.executable, "-m", "csrun.cli", "train", self.config,
                   *self.overrides]
        if self.resume and not task.startswith("ps"):
            command.append("--resume")
        if task == self.chief:
            command += ["--json", str(self.result_path)]
        return command

    @property
    def result_path(self) -> pathlib.Path:
        return self.logs / f"{self.chief.replace(':', '-')}.result.json"

    def log_path(self, task: str, stream: str) -> pathlib.Path:
        return self.logs / f"{task.replace(':', '-')}.{stream}.log"


@dataclasses.dataclass
class LaunchResult:
    """How the job ended. ``status``: ``completed`` (the chief and every ps exited 0, and
    no task failed on its own),
    ``failed`` (``failed_task`` failed first; ``error`` says how), ``interrupted``
    (a signal; ``signal`` names it) or ``aborted`` (a second signal killed the tasks)."""

    status: str
    exit_code: int
    chief: str
    tasks: list[dict[str, Any]]         # task, pid, exit_code, stdout, stderr
    result: dict[str, Any] | None       # the chief's `csrun train --json` result
    lost_workers: list[str]
    failed_task: str | None
    error: str | None
    tails: dict[str, list[str]]         # the last stderr lines of each failed task
    logs: str | None                    # None: the temporary folder was removed
    cluster: dict[str, list[str]]
    wall_s: float
    signal: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- planning ---------------------------------------------------------------------------
def plan_launch(config: str, overrides: Sequence[str] = (), *, workers: int, ps: int,
                chief: bool = False, resume: bool = False, logs: str | None = None
                ) -> LaunchPlan:
    """Check the arguments and the config (with the cluster it will get), before any
    process starts.

    Raises:
      ConfigError: every problem: the counts, the logs directory, the config (as
        ``csrun validate`` reports them, seen from the chief's ``TF_CONFIG``).
    """
    problems = _check_counts(workers, ps, chief) + check_writable(logs, "--logs",
                                                                 directory=True)
    if problems:
        raise ConfigError(problems)
    addresses = [f"127.0.0.1:{port}" for port in free_ports(ps + workers + chief)]
    cluster = {"ps": addresses[:ps], "worker": addresses[ps:ps + workers]}
    if chief:
        cluster["chief"] = addresses[-1:]
    chief_task = "chief:0" if chief else "worker:0"
    run_config = load_config(config, overrides, environ={
        **os.environ, "TF_CONFIG": tf_config(cluster, chief_task)})
    if run_config.strategy.kind != "parameter_server":
        raise ConfigError([Problem(
            "strategy.kind", f"is {run_config.strategy.kind!r}; csrun launch starts a "
            "parameter-server job", "add the override strategy.kind=parameter_server, or "
            "train it on one machine with csrun train")])
    if run_config.strategy.task is not None:
        # launch gives every task its own TF_CONFIG; a fixed task would pass for the chief
        # here and then fail in every other task (a fixed cluster already fails above)
        raise ConfigError([Problem(
            "strategy.task", "is set in the config; csrun launch gives each task its own",
            "remove strategy.task (keep it for a task you start yourself with csrun train)")])
    folder = pathlib.Path(logs) if logs else pathlib.Path(
        tempfile.mkdtemp(prefix="csrun-launch-"))
    return LaunchPlan(config, list(overrides), cluster, chief_task, resume, folder,
                      run_config, logs_temporary=not logs)


def tf_config(cluster: dict[str, list[str]], task: str) -> str:
    """The ``TF_CONFIG`` of ``task`` (``"worker:1"``) in ``cluster``."""
    job, index = task.split(":")
    return json.dumps({"cluster": cluster, "task": {"type": job, "index": int(index)}})


def _check_counts(workers: int, ps: int, chief: bool) -> list[Problem]:
    problems = []
    if workers < 0 or (workers == 0 and not chief):
        problems.append(Problem("--workers", f"{workers} workers: the job needs at least "
                                "one task that trains", "e.g. --workers 2 (or --chief)"))
    if ps < 1:
        problems.append(Problem("--ps", f"{ps} parameter servers: the job needs at least "
                                "one", "e.g. --ps 1"))
    if workers + ps + chief > MAX_TASKS:
        problems.append(Problem("--workers", f"{workers + ps + chief} tasks on "
                                f"{os.cpu_count()} CPU cores", f"launch at most "
                                f"{MAX_TASKS} tasks on this machine"))
    return problems


def free_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on loopback (free when asked: another process may
    still take one before its task binds it)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:  # all bound at once: distinct ports
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


# -- running ----------------------------------------------------------------------------
class _Task:
    """One running task: its process, its log files and how far they have been read."""

    def __init__(self, plan: LaunchPlan, name: str, env: dict[str, str]):
        self.name = name
        self.paths = {s: plan.log_path(name, s) for s in ("stdout", "stderr")}
        files = {s: open(p, "wb") for s, p in self.paths.items()}
        try:
            self.process = subprocess.Popen(
                plan.command(name), env=env, stdin=subprocess.DEVNULL,
                stdout=files["stdout"], stderr=files["stderr"], start_new_session=True)
        finally:
            for f in files.values():
                f.close()
        self.offsets = dict.fromkeys(self.paths, 0)
        self.partial = dict.fromkeys(self.paths, b"")
        self.tail: collections.deque = collections.deque(maxlen=12)
        self.exit_code: int | None = None
        self.started_at, self.ended_at = time.monotonic(), None
        self.signalled = False

    def read(self) -> list[tuple[str, str]]:
        """New complete lines of both logs, as ``(stream, line)``."""
        lines = []
        for stream, path in self.paths.items():
            with open(path, "rb") as f:
                f.seek(self.offsets[stream])
                data = self.partial[stream] + f.read()
            self.offsets[stream] += len(data) - len(self.partial[stream])
            *complete, self.partial[stream] = data.split(b"\n")
            for raw in complete:
                line = raw.decode("utf-8", "replace").rstrip("\r")
                lines.append((stream, line))
                if stream == "stderr" and line.strip():
                    self.tail.append(line)
        return lines

    def signal(self, signum: int) -> None:
        """Send ``signum`` (the launcher stops the task: its exit is no loss)."""
        if self.exit_code is None:
            self.signalled = True
            try:
                self.process.send_signal(signum)
            except ProcessLookupError:
                pass


def _environment(plan: LaunchPlan, task: str, environ: dict[str, str] | None = None
                 ) -> dict[str, str]:
    env = dict(os.environ, **(environ or {}), TF_CONFIG=plan.tf_config(task),
               PYTHONUNBUFFERED="1",
               CSRUN_LAUNCHER_PID=str(os.getpid()))  # the task ends with its launcher
    trainers = len(plan.cluster.get("worker", [])) + len(plan.cluster.get("chief", []))
    env.update(thread_settings(task, trainers))
    return env


def thread_settings(task: str, trainers: int, environ: dict[str, str] | None = None
                    ) -> dict[str, str]:
    """The OpenMP settings ``csrun launch`` gives ``task`` (``ps:0``, ``worker:1``) of a
    job with ``trainers`` workers (the chief included), all on this machine's cores;
    a variable set in ``environ`` (default: this process's) is the user's and kept.

    ``OMP_NUM_THREADS``: each trainer ``cpu_count // trainers`` threads, each ps one, as
    torchrun shares the cores. ``OMP_WAIT_POLICY=PASSIVE``: a task's idle OpenMP threads
    sleep instead of spinning; the tasks take turns (a worker waits for its ps, the ps for
    the next request), and a spinning team held the cores the other task needed (issue
    37's model at 1 worker x 1 ps: a worker's 2 threads made its batch 2.5x slower).
    """
    environ = os.environ if environ is None else environ
    out = {}
    if "OMP_NUM_THREADS" not in environ:
        out["OMP_NUM_THREADS"] = str(1 if task.startswith("ps") else
                                     max(1, (os.cpu_count() or 1) // max(1, trainers)))
    if "OMP_WAIT_POLICY" not in environ:
        out["OMP_WAIT_POLICY"] = "PASSIVE"
    return out


def launch(plan: LaunchPlan, on_event: Callable[[Any], None] | None = None,
           stop: threading.Event | None = None, received: Sequence[str] = (),
           environ: dict[str, str] | None = None) -> LaunchResult:
    """Start every task of ``plan``, follow their logs, wait, and judge the job.

    Args:
      on_event: hears :class:`TaskStarted`, :class:`TaskOutput` and :class:`TaskExited`.
      stop: set it to stop the job cleanly: the signal named first in ``received``
        (default SIGTERM) goes to every task. A KeyboardInterrupt while waiting (a
        second Ctrl-C, with :func:`csrun.core.runner.signals.stop_on_signals`) kills them.
      environ: more environment variables for every task (the caller's: how a task
        lays its output out for the room the caller shows it in).
    """
    emit = on_event or (lambda event: None)
    stop = stop or threading.Event()
    plan.logs.mkdir(parents=True, exist_ok=True)
    plan.result_path.unlink(missing_ok=True)  # an earlier job's result is not this one's
    begin = time.monotonic()
    tasks: dict[str, _Task] = {}
    try:
        for name in plan.tasks:
            tasks[name] = _Task(plan, name, _environment(plan, name, environ))
            job, index = name.split(":")
            emit(TaskStarted(name, plan.cluster[job][int(index)], tasks[name].process.pid,
                             name == plan.chief, *map(str, tasks[name].paths.values())))
        forwarded = _wait(plan, tasks, emit, stop, received)
    except KeyboardInterrupt:
        _kill_all(tasks, emit)
        return _judge(plan, tasks, begin, received[-1] if received else "SIGINT",
                      aborted=True)
    except BaseException:
        # the tasks run in their own sessions: nothing else would ever stop them (a
        # closed stdout under `| head`, a failed start, an unreadable log)
        _kill_all(tasks, lambda event: None)
        raise
    return _tidy(plan, _judge(plan, tasks, begin, forwarded))


def _tidy(plan: LaunchPlan, result: LaunchResult) -> LaunchResult:
    """Remove the temporary logs of a job that went well (completed, or stopped by a
    signal, and lost no worker); a failure's stay for reading."""
    if plan.logs_temporary and result.status in ("completed", "interrupted") and \
            not result.lost_workers:
        shutil.rmtree(plan.logs, ignore_errors=True)
        result.logs = None
        for task in result.tasks:
            task["stdout"] = task["stderr"] = None
    return result


def _kill_all(tasks: dict[str, "_Task"], emit) -> None:
    for task in tasks.values():
        task.signal(signal.SIGKILL)
    _reap(tasks, emit, deadline=time.monotonic() + _KILL_AFTER_S)


def _wait(plan: LaunchPlan, tasks: dict[str, _Task], emit, stop: threading.Event,
          received: Sequence[str]) -> str | None:
    """Follow the tasks until all have exited; returns the signal forwarded, if any."""
    forwarded, deadline, terminated = None, None, False
    while any(t.exit_code is None for t in tasks.values()):
        time.sleep(_POLL)
        _reap(tasks, emit)
        now = time.monotonic()
        if stop.is_set() and forwarded is None:
            forwarded = received[0] if received else "SIGTERM"
            for task in tasks.values():
                task.signal(signal.Signals[forwarded])
            deadline = now + plan.run_config.strategy.timeout_s + _AFTER_CHIEF_S
        chief = tasks[plan.chief]
        if chief.exit_code is not None and deadline is None:
            # a chief that exited (0, or 1 having ended the job) lets the others end on
            # their own; one killed by a signal told nobody: they are stopped soon
            deadline = now + (_AFTER_CHIEF_S if chief.exit_code >= 0 else 2.0)
        if deadline is not None and now > deadline and not terminated:
            terminated, deadline = True, now + _KILL_AFTER_S
            for task in tasks.values():
                task.signal(signal.SIGTERM)
        elif terminated and now > deadline:
            for task in tasks.values():
                task.signal(signal.SIGKILL)
    _reap(tasks, emit)
    return forwarded


def _reap(tasks: dict[str, _Task], emit, deadline: float | None = None) -> None:
    """Report new log lines and exits (waiting until ``deadline`` for every exit)."""
    while True:
        for task in tasks.values():
            for stream, line in task.read():
                emit(TaskOutput(task.name, stream, line))
            if task.exit_code is None and task.process.poll() is not None:
                task.exit_code, task.ended_at = task.process.returncode, time.monotonic()
                for stream, line in task.read():
                    emit(TaskOutput(task.name, stream, line))
                emit(TaskExited(task.name, task.exit_code, task.ended_at - task.started_at))
        if deadline is None or time.monotonic() > deadline or \
                all(t.exit_code is not None for t in tasks.values()):
            return
        time.sleep(_POLL)


def describe_exit(code: int | None) -> str:
    """``0``, ``1``, ``-9`` -> "exit 0", "exit 1", "killed by SIGKILL"."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit {code}"


def _judge(plan: LaunchPlan, tasks: dict[str, _Task], begin: float, forwarded: str | None,
           aborted: bool = False) -> LaunchResult:
    result = _read_result(plan.result_path)
    codes = {name: t.exit_code for name, t in tasks.items()}
    # a task that exits with an error of its own (a positive code) fails the job; a
    # worker killed by a signal the launcher did not send is lost (TF's rule: the job
    # goes on without it, and the chief reports it)
    ok = codes[plan.chief] == 0 and all(codes[n] == 0 for n in tasks if n.startswith("ps")) \
        and not any((codes[n] or 0) > 0 and not t.signalled for n, t in tasks.items())
    lost = sorted(n for n, t in tasks.items() if not n.startswith("ps") and n != plan.chief
                  and codes[n] != 0 and not t.signalled) if ok else []
    cluster = result.get("cluster") if result else None
    if isinstance(cluster, dict):  # the chief knows who rejoined (restarted by hand)
        rejoined = set(cluster.get("rejoined_workers") or []) - \
            set(cluster.get("lost_workers") or [])
        lost = sorted((set(lost) - rejoined) | set(cluster.get("lost_workers") or []))
    if aborted:  # by a second signal: forwarded names it
        status, code, signal_name = "aborted", 128 + signal.Signals[forwarded], forwarded
    elif forwarded and not ok:
        status, code, signal_name = "interrupted", 128 + signal.Signals[forwarded], forwarded
    elif ok:
        status, code, signal_name = "completed", 0, forwarded
    else:
        status, code, signal_name = "failed", 1, None
    first = _first_failure(tasks, codes, plan.chief) if status == "failed" else None
    error = _error(first, plan.chief, codes, tasks) if first else None
    tails = {n: list(tasks[n].tail) for n in tasks if codes[n] not in (0, None)}
    return LaunchResult(
        status, code, plan.chief,
        [{"task": n, "pid": t.process.pid, "exit_code": codes[n],
          "stdout": str(t.paths["stdout"]), "stderr": str(t.paths["stderr"])}
         for n, t in tasks.items()],
        result, lost, first, error, tails, str(plan.logs), plan.cluster,
        time.monotonic() - begin, signal_name)


def _first_failure(tasks: dict[str, _Task], codes: dict, chief: str) -> str | None:
    """Of the chief, the ps tasks and the workers that failed on their own (the job
    fails with them), the one that failed first: the cause; the others often fail
    because of it."""
    failed = [n for n in tasks if codes[n] not in (0, None) and (
        n == chief or n.startswith("ps") or codes[n] > 0 and not tasks[n].signalled)]
    # a task ending with "the chief ended the job: ..." or "ps:1 failed on a request of
    # ..." echoes that failure and may exit before the task that failed (it heard the
    # reason first): that task is the cause
    own = [n for n in failed if not echoes(n, _reason(tasks[n]))]
    return min(own or failed, key=lambda n: tasks[n].ended_at or 0) if failed else None


def _error(first: str, chief: str, codes: dict, tasks: dict[str, _Task]) -> str:
    text = f"{first} failed first ({describe_exit(codes[first])})"
    last = _reason(tasks[first])
    if last:
        text += f": {last}"
    if first != chief and codes[chief] != 0:
        chief_last = _reason(tasks[chief])
        text += f"; the chief {chief} then {describe_exit(codes[chief])}" + \
            (f": {chief_last}" if chief_last else "")
    return text


def _reason(task: "_Task") -> str:
    """A failed task's reason: its last ``error:`` line (not a hint printed after it,
    such as how to see the traceback), else its last line."""
    lines = [line.strip() for line in task.tail if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    reason = errors[-1] if errors else lines[-1] if lines else ""
    return reason.removeprefix("error:").strip()


def _read_result(path: pathlib.Path) -> dict | None:
    try:
        return strict_json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
