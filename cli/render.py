"""All terminal output of the CLI: rich tables, progress, summaries; errors on stderr.

Human output goes to stdout, or to stderr when ``--json -`` claims stdout. On a terminal
the run shows a progress bar with ETA and every line fits the terminal, broken between
words (:mod:`csrun.cli.lines`); elsewhere (CI logs, pipes) it prints plain lines, one per
message and without padding.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
import sys
import traceback
from typing import Any, Sequence

from rich import box
from rich.console import Console
from rich.measure import Measurement
from rich.cells import cell_len
from rich.markup import escape as escape_markup
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table
from rich.text import Text

from csrun.core.runner.cluster_role import ClusterJoined, ServeResult, StoppedWaiting
from csrun.core.runner.events import (CheckpointSaved, Evaluated, Notice, RunResult, RunStarted,
                               StepDone, StepLog)
from csrun.core.runner.launch import (LaunchPlan, LaunchResult, TaskExited, TaskOutput, TaskStarted,
                               describe_exit)
from csrun.core.config.problems import ConfigError, printable
from csrun.core.runner.metrics import OutputError
from csrun.core.runner.preflight.devices import ENVIRONMENT_ORIGIN

from .columns import MAX_COLUMNS, MIN_COLUMNS
from .lines import fits, keep, say, wrap

__all__ = ["View", "sparkline", "write_json"]

_BLOCKS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 48) -> str:
    """A one-line chart of ``values`` (averaged into ``width`` buckets)."""
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return ""
    buckets = min(width, len(values))
    means = []
    for b in range(buckets):
        chunk = values[b * len(values) // buckets:(b + 1) * len(values) // buckets]
        means.append(sum(chunk) / len(chunk))
    low, high = min(means), max(means)
    span = (high - low) or 1.0
    return "".join(_BLOCKS[min(7, int((m - low) / span * 8))] for m in means)


def write_json(path: str, data: dict[str, Any]) -> None:
    """Write ``data`` to ``path``, or to stdout for ``-``."""
    text = json.dumps(data, indent=2, default=_jsonable, allow_nan=False)
    if path == "-":
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
        return
    target = pathlib.Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text + "\n", encoding="utf-8")
    except OSError as exc:
        raise OutputError.of("--json", path, exc) from None


def escape(text: str) -> str:
    """``text`` (something the user wrote, or named) as it is shown: characters a
    terminal would act on escaped as values are (:func:`csrun.core.config.problems.
    printable`; line breaks kept), and rich's markup taken literally."""
    return escape_markup(printable(text, "\n\t"))


def _jsonable(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    return str(value)


def clean_floats(value: Any) -> Any:
    """NaN and inf become None: JSON has no spelling for them."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [clean_floats(v) for v in value]
    return value


def _cluster_rows(cluster: dict | None) -> list[tuple[str, str]]:
    """Summary rows of a parameter-server worker: its task, the variables' homes, the
    global step and, from the chief, the updates per worker and the lost workers."""
    if not cluster:
        return []
    homes: dict[str, int] = {}
    for devices in cluster["variables"].values():
        for device in devices.split(","):  # a partitioned variable: one per shard
            ps = device.split("/task:")[1].split("/")[0] if "/task:" in device else device
            homes[f"ps:{ps}"] = homes.get(f"ps:{ps}", 0) + 1
    when = cluster.get("global_step_when", "")
    note = f" when {when}" if when else ""
    note += " (the chief reports the job's last)" if when == "this worker finished" else ""
    rows = [("cluster", f"{cluster['task']} ({cluster['role']}); global step "
                        f"{cluster['global_step']}{note}; variables: " +
             ", ".join(f"{n} on {ps}" for ps, n in sorted(homes.items())))]
    moved = cluster.get("transfers")
    if moved and moved.get("steps"):
        rows.append(("moved", f"{_size(moved['pushed_bytes_per_step'])} pushed, "
                              f"{_size(moved['pulled_bytes_per_step'])} pulled per step "
                              f"(this worker, {moved['steps']} steps)"))
    held = {ps: v["held_bytes"] for ps, v in (cluster.get("ps") or {}).items()
            if v.get("held_bytes") is not None}
    if held:
        rows.append(("ps hold", ", ".join(f"{ps}: {_size(b)}" for ps, b in held.items())))
    if "updates" in cluster:
        rows.append(("updates", ", ".join(f"{w}: {n}" for w, n in
                                          sorted(cluster["updates"].items())) or "-"))
        lost = cluster.get("lost_workers") or []
        rows.append(("lost workers", ", ".join(lost) if lost else "none"))
        if cluster.get("rejoined_workers"):
            rows.append(("rejoined", ", ".join(cluster["rejoined_workers"]) +
                         " (restarted during the job)"))
    return rows


def _size(count: float) -> str:
    """Bytes as people read them: ``512 B``, ``140.6 KiB``, ``1.25 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} GiB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def _phases(seconds: dict[str, float]) -> str:
    """``distribute 0.30 ms -> run 1.36 ms``, each phase's time kept on its line."""
    return " -> ".join(keep(f"{name} {_ms(s)}") for name, s in seconds.items())


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _loss(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f}"


class _Plain:
    """Where a console writes when it is no terminal (CI logs, pipes, files): its lines
    lose the trailing spaces that rich pads table cells with. The stream is looked up at
    each write, as rich does (tests swap ``sys.stdout``). ``fitted``: lines are fitted
    to the console's width all the same (a task of ``csrun launch`` on a terminal)."""

    def __init__(self, stderr: bool, fitted: bool = False):
        self._stderr = stderr
        self.fitted = fitted

    def _stream(self):
        return sys.stderr if self._stderr else sys.stdout

    def write(self, text: str) -> int:
        self._stream().write(_TRAILING.sub("\n", text))
        return len(text)

    def flush(self) -> None:
        self._stream().flush()

    def isatty(self) -> bool:
        return False


_TRAILING = re.compile(r"[ \t]+\n")
TASK_COLUMNS = "CSRUN_COLUMNS"  # set by csrun launch on a terminal: see task_environ


def _console(stderr: bool) -> Console:
    console = Console(stderr=stderr, highlight=False)
    columns = _columns(os.environ.get("COLUMNS"))
    if console.is_terminal:
        if not MIN_COLUMNS <= console.width <= MAX_COLUMNS:  # rich took COLUMNS as given
            console.width = columns or _terminal_width(console)
        return console
    # a task of `csrun launch`, whose lines the launcher shows on a terminal behind a
    # prefix, fits them to the room left (CSRUN_COLUMNS, from the launcher)
    fitted = _columns(os.environ.get(TASK_COLUMNS))
    console = Console(file=_Plain(stderr, fitted is not None),  # type: ignore[arg-type]
                      highlight=False)
    # CI logs have no terminal width; 80 would wrap the tables
    console.width = fitted or columns or 120
    return console


def _columns(text: str | None) -> int | None:
    """The width a ``COLUMNS``-like variable gives: None when it is unset, no number or
    below :data:`MIN_COLUMNS` (unknown), at most :data:`MAX_COLUMNS`."""
    text = (text or "").strip()
    if not (text.isascii() and text.isdigit()):
        return None
    width = int(text) if len(text.lstrip("0")) <= 6 else MAX_COLUMNS
    return min(width, MAX_COLUMNS) if width >= MIN_COLUMNS else None


def _terminal_width(console: Console) -> int:
    """The terminal's own width (80 when it does not say), within the sane range."""
    try:
        width = os.get_terminal_size(console.file.fileno()).columns
    except (OSError, ValueError, AttributeError):  # no descriptor (a test's stream)
        width = 80
    return min(max(width, MIN_COLUMNS), MAX_COLUMNS) if width else 80


class View:
    """The CLI's output for one command.

    Args:
      json_to_stdout: ``--json -`` writes JSON to stdout, so human output moves to stderr.
    """

    def __init__(self, json_to_stdout: bool = False):
        self.out = _console(stderr=json_to_stdout)
        self.err = _console(stderr=True)
        self._progress: Progress | None = None
        self._task = None
        self._cluster: ClusterJoined | None = None
        self._task_width = 8  # the longest task name of a launch

    # -- errors ----------------------------------------------------------------------------
    def problems(self, error: ConfigError) -> None:
        """Every problem: where, what, and the hint; the summary says whether they are
        the config's or the command line's (an option such as ``--plot``)."""
        say(self.err, f"[bold red]error:[/] {_problem_count(error.problems)} (nothing ran)")
        for problem in error.problems:
            shown = problem.shown()
            where = f"{escape(shown['where'])}: " if shown["where"] else ""
            path = f"[bold]{escape(shown['path'])}[/]: " if shown["path"] else ""
            say(self.err, f"{where}{path}{escape(shown['message'])}", indent=2)
            if shown["hint"]:
                say(self.err, f"[cyan]hint:[/] {escape(shown['hint'])}", indent=6, hang=6)

    def failure(self, message: str, cause: BaseException | None = None) -> None:
        """A runtime failure with a clear message (exit 1); for one in the user's code
        (``cause``) its traceback on request."""
        self.close()
        say(self.err, f"[bold red]error:[/] {escape(message)}")
        if cause is not None:
            self._traceback(cause)

    def crash(self, exc: BaseException) -> None:
        """An unexpected exception: its message and notes; the traceback on request."""
        self.close()
        notes = "".join(f" {n}" for n in getattr(exc, "__notes__", []))
        say(self.err, f"[bold red]error:[/] {escape(type(exc).__name__)}: "
                      f"{escape(str(exc))}{escape(notes)}")
        self._traceback(exc)

    def _traceback(self, exc: BaseException) -> None:
        if os.environ.get("CSRUN_TRACEBACK"):  # Python's own lines, as they are
            self.err.print(escape("".join(traceback.format_exception(exc))), soft_wrap=True)
        else:
            say(self.err, "(set CSRUN_TRACEBACK=1 to see the traceback)", indent=2,
                style="dim")

    def interrupted(self, saved: str | None, chief: bool = True,
                    saved_nothing: str = "none configured, or no step finished") -> None:
        """A clean stop; ``chief=False``: a worker of a cluster, whose chief saves."""
        self.close()
        where = "; the chief saves the checkpoint" if not chief else \
            f"; checkpoint {escape(saved)} {keep('(continue with --resume)')}" if saved \
            else f"; no checkpoint saved ({saved_nothing})"
        say(self.err, f"[yellow]interrupted[/]{where}")

    def warning(self, message: str, where: str) -> None:
        """A Python warning raised during the command (Python would print it unwrapped,
        with a line of source)."""
        say(self.err, f"[yellow]warning:[/] {escape(message)} ({escape(where)})")

    def aborted(self, signal: str = "SIGINT") -> None:
        self.close()
        second = "Ctrl-C" if signal == "SIGINT" else escape(signal)
        say(self.err, f"[yellow]aborted[/] (second {second}): nothing saved from this step")

    # -- a training run ----------------------------------------------------------------------
    def on_event(self, event: Any) -> None:
        """Render one event of :mod:`csrun.core.runner.events` (the runner's ``on_event``)."""
        handler = {RunStarted: self._started, StepDone: self._step_done,
                   StepLog: self._step_log, CheckpointSaved: self._checkpoint,
                   Notice: self._notice, Evaluated: self._evaluated,
                   ClusterJoined: self._joined}.get(type(event))
        if handler is not None:
            handler(event)

    def _joined(self, e: ClusterJoined) -> None:
        self._cluster = e
        if e.role == "ps":
            say(self.out, f"[bold]ParameterServerStrategy[/]: {e.task} serves its share of "
                          f"the variables to {', '.join(e.workers)} until the chief ends "
                          "the job")

    def _started(self, e: RunStarted) -> None:
        replicas = len(e.compute_devices)
        epochs = f" ({e.steps_per_epoch} per epoch)" if e.steps_per_epoch else ""
        c = self._cluster
        if c is None:
            per_replica = e.global_batch_size / replicas
            say(self.out, f"[bold]CentralStorageStrategy[/]: {_count(replicas, 'replica')} "
                          f"on {', '.join(e.compute_devices)}; parameters on "
                          f"{e.parameter_device}")
        else:
            per_replica = e.global_batch_size / c.replicas_in_sync
            say(self.out, f"[bold]ParameterServerStrategy[/]: {c.task} ({c.role}) of "
                          f"{', '.join(c.workers)}; {_count(replicas, 'replica')} here on "
                          f"{', '.join(e.compute_devices)}, {c.replicas_in_sync} in sync; "
                          f"variables on {e.parameter_device} ({c.variable_placement})")
        count = e.train_examples or "a stream"  # an IterableDataset has no length
        split = f"split into ~{per_replica:g} per replica" if e.distribute == "global" else \
            f"~{per_replica:g} per replica from each replica's own pipeline"
        say(self.out, f"data: {escape(e.dataset)}: {count} to train, {e.holdout_examples} "
                      f"held out; global batch {e.global_batch_size}, {split}")
        say(self.out, f"model: {escape(e.model)}, {e.parameters:,} parameters; steps: "
                      f"{e.total_steps}{epochs}; seed {e.seed}")
        say(self.out, "each step: distribute -> run (replicas, grads summed " +
            ("locally) -> update (push to the ps, pull values)" if c else
             "centrally) -> update") + " -> reduce", style="dim")
        if self.out.is_terminal and self._progress is None:
            self._progress = Progress(
                TextColumn("train"), BarColumn(bar_width=None), MofNCompleteColumn(),
                TextColumn("{task.fields[loss]}"), TimeElapsedColumn(), TextColumn("ETA"),
                TimeRemainingColumn(), console=self.out, transient=True)
            self._progress.start()
            self._task = self._progress.add_task("train", total=e.total_steps,
                                                 completed=e.start_step, loss="")

    def _step_done(self, e: StepDone) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=e.step, loss=f"loss {_loss(e.loss)}")

    def _step_log(self, e: StepLog) -> None:
        accuracy = f" · accuracy {_pct(e.accuracy)}" if e.accuracy is not None else ""
        # epochs counted from 1, as "15.00 epochs" is: the last step is in epoch 15
        say(self.out, f"[bold]step {e.step}/{e.total_steps}[/] · epoch {e.epoch + 1} · loss "
                      f"{_loss(e.loss)}{accuracy} · lr {e.learning_rate:.3g}")
        # no side borders: narrow enough beside a `[worker:0] ` prefix
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        for column in ("replica", "device", "examples", "loss", "step time"):
            table.add_column(column, justify="right" if column != "device" else "left")
        for r in e.replicas:
            table.add_row(str(r.replica), r.device, str(r.examples), _loss(r.loss),
                          _ms(r.step_time_s))
        self.out.print(table)
        say(self.out, f"per step: {_phases(e.phases_s)}", indent=2, style="dim")

    def _checkpoint(self, e: CheckpointSaved) -> None:
        say(self.out, f"checkpoint: step {e.step} -> {escape(e.path)}", indent=2,
            style="dim")

    def _notice(self, e: Notice) -> None:
        say(self.out, f"[yellow]note:[/] {escape(e.message)}")

    def _evaluated(self, e: Evaluated) -> None:
        accuracy = f"accuracy [bold]{_pct(e.accuracy)}[/], " if e.accuracy is not None else ""
        when = f" at step {e.step}" if e.step is not None else ""
        say(self.out, f"held out{when}: {accuracy}loss {_loss(e.loss)} ({e.examples} "
                      "examples)")

    def close(self) -> None:
        """Stop the progress bar (before a summary or an error)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def summary(self, result: RunResult | ServeResult | StoppedWaiting,
                files: dict[str, str | None] | None = None) -> None:
        """The end of a run: loss curve, metrics, throughput, replica balance, digest and
        the files written (``files``: name -> path, e.g. ``{"plot": "loss.png"}``)."""
        self.close()
        if isinstance(result, StoppedWaiting):
            say(self.out, f"csrun train: {result.task} stopped by {result.signal} after "
                          f"{result.wall_s:.1f} s waiting for {result.waited_for}")
            return
        if isinstance(result, ServeResult):
            ended = "the chief ended the job" if result.status == "completed" else \
                "stopped by a signal before the chief ended the job"
            say(self.out, f"csrun train: {result.task} served {result.wall_s:.1f} s; {ended}")
            return
        say(self.out, f"[bold]csrun train: {result.status}[/]")
        self._rows(self._result_rows(result) + [
            (name, escape(path)) for name, path in (files or {}).items() if path])

    def _result_rows(self, result: RunResult) -> list[tuple[str, str]]:
        m, t = result.metrics, result.throughput
        epochs = f" ({result.epochs:.2f} epochs)" if result.epochs is not None else ""
        losses = f"{_loss(result.first_loss)} -> {_loss(result.final_loss)}"
        spark = sparkline(result.losses, min(48, max(8, self._room(_LABELS) - len(losses) - 2)))
        train_acc = f", accuracy {_pct(m['train_accuracy'])}" \
            if m.get("train_accuracy") is not None else ""
        rows = [("steps", f"{result.steps}/{result.total_steps}{epochs}"),
                ("loss", f"{losses}  {spark}"),
                ("train", f"loss {_loss(m.get('train_loss'))}{train_acc} (last log window, "
                          "reduced over replicas)")]
        if "eval_loss" in m:
            eval_acc = f"accuracy {_pct(m['eval_accuracy'])}, " \
                if m.get("eval_accuracy") is not None else ""
            rows.append(("held out", f"{eval_acc}loss {_loss(m['eval_loss'])} "
                                     f"({m['eval_examples']} examples)"))
        rows += [("speed", f"{t['examples_per_s']:,.0f} examples/s, {t['steps_per_s']:.1f} "
                           f"steps/s, {t['wall_s']:.1f} s training"),
                 ("per step", _phases(result.phases_s)),
                 ("replicas", self._balance(result)),
                 ("params_sha256", _shortened(result.params_sha256, self._room(2))
                  if result.params_sha256 else "- (the chief reports the job's)")]
        rows += _cluster_rows(getattr(result, "cluster", None))
        if result.early_stopped:
            stop = result.early_stopped
            rows.append(("early stop", f"at step {stop['step']}: {stop['metric']} best "
                                       f"{stop['best']:.4g} at step {stop['best_step']}"))
        checkpoint = result.checkpoint
        if checkpoint.get("last"):
            rows.append(("checkpoint", escape(checkpoint["last"])))
        if checkpoint.get("best"):
            rows.append(("best", f"{escape(checkpoint['best'])} "
                                 f"({escape(str(checkpoint['best_metric']))})"))
        if checkpoint.get("export"):
            rows.append(("exported", escape(checkpoint["export"])))
        return rows

    def _room(self, indent: int) -> int:
        """Cells left after ``indent`` on a line of the output (any, off a terminal)."""
        return self.out.width - indent if fits(self.out) else 1 << 30

    def _rows(self, rows: list[tuple[str, str]]) -> None:
        """``label  value`` rows, values aligned after the labels and wrapped there; a
        value whose word would not fit there starts on the next line instead."""
        for label, value in rows:
            text = Text.from_markup(value)
            longest = max(map(cell_len, text.plain.split(" ")))  # keep()'s units whole
            if fits(self.out) and longest > self._room(_LABELS):
                say(self.out, f"[bold]{label}[/]")
                say(self.out, text, indent=2, hang=0)
            elif fits(self.out):
                lines = wrap(text, self.out.width - _LABELS, hang=0)
                for n, line in enumerate(lines):
                    head = Text(f"{label:<{_LABELS}}" if n == 0 else " " * _LABELS,
                                style="bold" if n == 0 else "")
                    self.out.print(head + line, soft_wrap=True)
            else:
                say(self.out, Text.assemble((f"{label:<{_LABELS}}", "bold"), text))

    @staticmethod
    def _balance(result: RunResult) -> str:
        parts = [f"{r['replica']}@{r['device']}: {100 * r['examples_share']:.0f}% of "
                 f"examples, {keep(_ms(r['step_time_s']))}/step" for r in result.per_replica]
        ratio = result.replica_balance.get("step_time_max_over_min")
        balance = f"; slowest/fastest {ratio:.2f}x" if ratio else ""
        return "; ".join(parts) + balance

    # -- launch ----------------------------------------------------------------------------
    def launch_started(self, plan: LaunchPlan) -> None:
        counts = ", ".join(_count(len(plan.cluster[job]), job) for job in ("ps", "chief",
                                                                           "worker")
                           if plan.cluster.get(job))
        say(self.out, f"[bold]csrun launch[/]: {counts} on loopback, each a `csrun train` "
                      f"with its own TF_CONFIG; {plan.chief} is the chief")
        kept = " (removed at the end if the job goes well; --logs DIR keeps them)" \
            if plan.logs_temporary else ""
        say(self.out, f"logs: {escape(str(plan.logs))}{kept}", indent=2)
        self._task_width = max(len(t) for t in plan.tasks)

    def task_environ(self) -> dict[str, str]:
        """How a task lays out its output for the room its lines have here, behind their
        ``[worker:0] `` prefix: tables that fit (``COLUMNS``) and, when this is a
        terminal, lines fitted too (``CSRUN_COLUMNS``)."""
        columns = str(max(MIN_COLUMNS, self.out.width - self._task_width - 3))
        return {"COLUMNS": columns, **({TASK_COLUMNS: columns} if fits(self.out) else {})}

    def on_launch_event(self, event: Any) -> None:
        """Render one event of :mod:`csrun.core.runner.launch`: a task's start, line or exit."""
        if isinstance(event, TaskStarted):
            role = " (chief)" if event.chief else ""
            say(self.out, f"started {event.task}{role} at {event.address}, pid {event.pid}",
                indent=2)
        elif isinstance(event, TaskOutput):
            self._task_line(event)
        elif isinstance(event, TaskExited):
            style = "dim" if event.exit_code == 0 else "yellow"
            say(self.out, f"{event.task} ended: {describe_exit(event.exit_code)} after "
                          f"{event.seconds:.1f} s", indent=2, style=style)

    def _task_line(self, event: TaskOutput) -> None:
        """A task's line behind its ``[task]`` prefix; on a terminal, wrapped for the room
        the prefix leaves (the task laid its tables out for that width), each piece
        prefixed, continuing 2 columns in from the line's own indent."""
        console = self.err if event.stream == "stderr" else self.out
        prefix = Text.assemble((f"[{event.task}]", "dim"),
                               " " * (self._task_width - len(event.task) + 1))
        body = event.line.rstrip()
        if not fits(console):
            console.print(prefix + Text(body), soft_wrap=True)
            return
        indent = len(body) - len(body.lstrip(" "))
        for piece in wrap(Text(body.lstrip(" ")), console.width - prefix.cell_len, indent):
            console.print(prefix + piece, soft_wrap=True)

    def launch_summary(self, result: LaunchResult) -> None:
        """How the job ended: each task's exit, lost workers, why it failed, and where the
        logs are (a temporary folder is gone when the job went well)."""
        codes = ", ".join(f"{t['task']} {describe_exit(t['exit_code'])}"
                          for t in result.tasks)
        color = {"completed": "green", "failed": "red"}.get(result.status, "yellow")
        say(self.out, f"[bold {color}]csrun launch: {result.status}[/] in "
                      f"{result.wall_s:.1f} s ({codes})")
        if result.lost_workers:
            say(self.out, f"lost workers: {', '.join(result.lost_workers)}; the job went on "
                          "without them (the chief reports them)", indent=2, style="yellow")
        if result.error:
            say(self.err, f"[bold red]error:[/] {escape(result.error)}")
            for task, lines in result.tails.items():
                say(self.err, f"last stderr lines of {task}:", indent=2, style="dim")
                for line in lines[-5:]:
                    say(self.err, escape(line), indent=4)
        if result.logs is None:
            say(self.out, "logs: removed with their temporary folder (--logs DIR keeps "
                          "them)", indent=2, style="dim")
        else:
            say(self.out, f"logs: {escape(result.logs)}", indent=2, style="dim")

    # -- validate, inspect-devices ---------------------------------------------------------
    def valid(self, path: str, config: Any) -> None:
        s, d, o, t = config.strategy, config.dataset, config.optimizer, config.train
        length = _count(t.steps, "step") if t.steps else _count(t.epochs, "epoch")
        batch = next(step.size for step in d.steps if step.op == "batch")
        say(self.out, f"[green]ok:[/] {escape(path)} is valid")
        where = f"parameters on {s.parameter_device or '(TF default)'}" \
            if s.kind == "central_storage" else "parameter servers (cluster: " + \
            ("strategy.cluster" if s.cluster else "TF_CONFIG") + ")"
        for line in (f"strategy: {s.kind}; {', '.join(s.compute_devices or ['(default)'])}; "
                     f"{where}",
                     f"dataset: {d.source.kind}, global batch {batch}, {d.distribute}",
                     f"model: {config.model.kind}; optimizer: {o.name} lr={o.lr:g}",
                     f"train: {length}, seed {t.seed}"):
            say(self.out, escape(line), indent=2)

    def devices(self, report: dict[str, Any]) -> None:
        """The devices as a table when it fits, else two lines each; columns no device
        has a value for (a GPU's model on a CPU-only machine) are left out."""
        rows = [{"device": d["short_name"], "TF name": d["name"], "torch": d["torch"],
                 "kind": "logical CPU" if d.get("logical") else d["kind"],
                 "memory": f"{d['memory_bytes'] / 2**30:.1f} GiB"
                 if d.get("memory_bytes") else "-",
                 "model": d.get("model", "-"), "capability": d.get("capability", "-")}
                for d in report["devices"]]
        columns = [c for c in rows[0] if any(r[c] != "-" for r in rows)] if rows else []
        table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
        for column in columns:
            table.add_column(column, no_wrap=True)
        for r in rows:
            table.add_row(*(escape(r[c]) for c in columns))
        say(self.out, "[bold]local devices[/]")
        unbounded = self.out.options.update_width(1 << 20)
        if Measurement.get(self.out, unbounded, table).maximum <= self.out.width:
            self.out.print(table)
        else:
            for r in rows:
                say(self.out, Text.assemble((r["device"], "bold"), f"  {r['TF name']}"),
                    indent=2, hang=len(r["device"]) + 2)
                rest = ", ".join(f"{c} {r[c]}" for c in columns
                                 if c not in ("device", "TF name"))
                say(self.out, escape(rest), indent=4 + len(r["device"]))
        placement = report["default_placement"]
        say(self.out, f"default placement: replicas on "
                      f"{', '.join(placement['compute_devices'])}; parameters on "
                      f"{placement['parameter_device']}")
        say(self.out, f"({placement['rule']})", indent=2, style="dim")


_LABELS = 15  # the summary's label column: "params_sha256" and two spaces


def _count(n: int | float, noun: str) -> str:
    """``1 replica``, ``2 replicas``, ``1 ps``, ``2 ps``, ``1.5 epochs``."""
    plural = noun if noun == "ps" or n == 1 else noun + "s"
    return f"{n:g} {plural}" if isinstance(n, float) else f"{n} {plural}"


def _problem_count(problems: Sequence[Any]) -> str:
    """``2 problems in the config``, ``1 problem with the command line`` (an option's,
    such as ``--plot``), or both counted; ``... in the environment`` when every one is an
    environment variable's alone (``CSRUN_LOGICAL_CPUS``)."""
    if all(not p.path and (p.origin or "").startswith(f"{ENVIRONMENT_ORIGIN} ")
           for p in problems):
        return f"{_count(len(problems), 'problem')} in the environment"
    options = sum(p.path.startswith("--") for p in problems)
    config = len(problems) - options
    if not options:
        return f"{_count(config, 'problem')} in the config"
    if not config:
        return f"{_count(options, 'problem')} with the command line"
    return (f"{len(problems)} problems: {config} in the config, {options} with the "
            "command line")


def _shortened(word: str, room: int) -> str:
    """``word`` whole when it fits ``room`` cells, else its start and ``…``: a digest on a
    narrow terminal (the JSON result has it whole)."""
    return word if len(word) <= room else word[:max(8, room - 1)] + "…"
