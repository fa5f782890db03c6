"""All terminal output of the CLI: rich tables, progress, summaries; errors on stderr.

Human output goes to stdout, or to stderr when ``--json -`` claims stdout. On a terminal
the run shows a progress bar with ETA; elsewhere (CI logs, pipes) it prints plain lines.
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

from rich.console import Console
from rich.markup import escape
from rich.padding import Padding
from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                           TimeElapsedColumn, TimeRemainingColumn)
from rich.table import Table

from csrun.core.runner.cluster_role import ClusterJoined, ServeResult, StoppedWaiting
from csrun.core.runner.events import (CheckpointSaved, Evaluated, Notice, RunResult, RunStarted,
                               StepDone, StepLog)
from csrun.core.runner.launch import (LaunchPlan, LaunchResult, TaskExited, TaskOutput, TaskStarted,
                               describe_exit)
from csrun.core.config.problems import ConfigError
from csrun.core.runner.metrics import OutputError

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
    for device in cluster["variables"].values():
        ps = device.split("/task:")[1].split("/")[0] if "/task:" in device else device
        homes[f"ps:{ps}"] = homes.get(f"ps:{ps}", 0) + 1
    when = cluster.get("global_step_when", "")
    note = f" when {when}" if when else ""
    note += " (the chief reports the job's last)" if when == "this worker finished" else ""
    rows = [("cluster", f"{cluster['task']} ({cluster['role']}); global step "
                        f"{cluster['global_step']}{note}; variables: " +
             ", ".join(f"{n} on {ps}" for ps, n in sorted(homes.items())))]
    if "updates" in cluster:
        rows.append(("updates", ", ".join(f"{w}: {n}" for w, n in
                                          sorted(cluster["updates"].items())) or "-"))
        lost = cluster.get("lost_workers") or []
        rows.append(("lost workers", ", ".join(lost) if lost else "none"))
        if cluster.get("rejoined_workers"):
            rows.append(("rejoined", ", ".join(cluster["rejoined_workers"]) +
                         " (restarted during the job)"))
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.2f} ms"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _loss(value: float | None) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.4f}"


class _Plain:
    """Where a console writes when it is no terminal (CI logs, pipes, files): its lines
    lose the trailing spaces that rich pads table cells with. The stream is looked up at
    each write, as rich does (tests swap ``sys.stdout``)."""

    def __init__(self, stderr: bool):
        self._stderr = stderr

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


def _console(stderr: bool) -> Console:
    console = Console(stderr=stderr, highlight=False)
    if not console.is_terminal:
        console = Console(file=_Plain(stderr), highlight=False)  # type: ignore[arg-type]
        if "COLUMNS" not in os.environ:
            console.width = 120  # CI logs have no terminal width; 80 would wrap the tables
    return console


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

    def _error_line(self, text: str, indent: int = 0) -> None:
        """On a terminal, wrapped at word boundaries (the terminal's own wrapping breaks
        words) with continuation lines indented; elsewhere one line, for grep."""
        if self.err.is_terminal:
            self.err.print(Padding(text, (0, 0, 0, indent)))
        else:
            self.err.print(" " * indent + text, soft_wrap=True)

    # -- errors ----------------------------------------------------------------------------
    def problems(self, error: ConfigError) -> None:
        """Every config problem: where, what, and the hint."""
        count = len(error.problems)
        self._error_line(f"[bold red]error:[/] {count} problem{'s' if count != 1 else ''} "
                         "in the config (nothing ran)")
        for problem in error.problems:
            shown = problem.shown()
            where = f"{escape(shown['where'])}: " if shown["where"] else ""
            path = f"[bold]{escape(shown['path'])}[/]: " if shown["path"] else ""
            self._error_line(f"{where}{path}{escape(shown['message'])}", 2)
            if shown["hint"]:
                self._error_line(f"[cyan]hint:[/] {escape(shown['hint'])}", 6)

    def failure(self, message: str, cause: BaseException | None = None) -> None:
        """A runtime failure with a clear message (exit 1); for one in the user's code
        (``cause``) its traceback on request."""
        self.close()
        self._error_line(f"[bold red]error:[/] {escape(message)}")
        if cause is not None:
            self._traceback(cause)

    def crash(self, exc: BaseException) -> None:
        """An unexpected exception: its message and notes; the traceback on request."""
        self.close()
        notes = "".join(f" {n}" for n in getattr(exc, "__notes__", []))
        self._error_line(f"[bold red]error:[/] {escape(type(exc).__name__)}: "
                         f"{escape(str(exc))}{escape(notes)}")
        self._traceback(exc)

    def _traceback(self, exc: BaseException) -> None:
        if os.environ.get("CSRUN_TRACEBACK"):
            self.err.print(escape("".join(traceback.format_exception(exc))), soft_wrap=True)
        else:
            self.err.print("  (set CSRUN_TRACEBACK=1 to see the traceback)", style="dim")

    def interrupted(self, saved: str | None, chief: bool = True,
                    saved_nothing: str = "none configured, or no step finished") -> None:
        """A clean stop; ``chief=False``: a worker of a cluster, whose chief saves."""
        self.close()
        where = "; the chief saves the checkpoint" if not chief else \
            f"; checkpoint {escape(saved)} (continue with --resume)" if saved else \
            f"; no checkpoint saved ({saved_nothing})"
        self.err.print(f"[yellow]interrupted[/]{where}", soft_wrap=True)

    def aborted(self) -> None:
        self.close()
        self.err.print("[yellow]aborted[/] (second Ctrl-C): nothing saved from this step")

    # -- a training run ----------------------------------------------------------------------
    def on_event(self, event: Any) -> None:
        """Render one event of :mod:`csrun.core.runner.events` (the runner's ``on_event``)."""
        handler = {RunStarted: self._started, StepDone: self._step_done,
                   StepLog: self._step_log, CheckpointSaved: self._checkpoint,
                   Notice: self._notice, Evaluated: self._evaluated,
                   ClusterJoined: self._joined}.get(type(event))
        if handler is not None:
            handler(event)

    def _print(self, *things: Any, **kwargs: Any) -> None:
        console = self._progress.console if self._progress is not None else self.out
        console.print(*things, **kwargs)

    def _joined(self, e: ClusterJoined) -> None:
        self._cluster = e
        if e.role == "ps":
            self.out.print(f"[bold]ParameterServerStrategy[/]: {e.task} serves its share of "
                           f"the variables to {', '.join(e.workers)} until the chief ends the "
                           "job", soft_wrap=True)

    def _started(self, e: RunStarted) -> None:
        replicas = len(e.compute_devices)
        epochs = f" ({e.steps_per_epoch} per epoch)" if e.steps_per_epoch else ""
        c = self._cluster
        if c is None:
            per_replica = e.global_batch_size / replicas
            self.out.print(f"[bold]CentralStorageStrategy[/]: {replicas} replica(s) on "
                           f"{', '.join(e.compute_devices)}; parameters on "
                           f"{e.parameter_device}", soft_wrap=True)
        else:
            per_replica = e.global_batch_size / c.replicas_in_sync
            self.out.print(f"[bold]ParameterServerStrategy[/]: {c.task} ({c.role}) of "
                           f"{', '.join(c.workers)}; {replicas} replica(s) here on "
                           f"{', '.join(e.compute_devices)}, {c.replicas_in_sync} in sync; "
                           f"variables on {e.parameter_device} ({c.variable_placement})",
                           soft_wrap=True)
        count = e.train_examples or "a stream"  # an IterableDataset has no length
        self.out.print(f"data: {escape(e.dataset)}: {count} to train, "
                       f"{e.holdout_examples} held out; global batch {e.global_batch_size} "
                       f"(~{per_replica:g} per replica, {e.distribute})", soft_wrap=True)
        self.out.print(f"model: {escape(e.model)}, {e.parameters:,} parameters; steps: "
                       f"{e.total_steps}{epochs}; seed {e.seed}", soft_wrap=True)
        self.out.print("each step: distribute -> run (replicas, grads summed " +
                       ("locally) -> update (push to the ps, pull values)" if c else
                        "centrally) -> update") + " -> reduce", style="dim")
        if self.out.is_terminal and self._progress is None:
            self._progress = Progress(
                TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task."
                                                                                   "fields[loss]}"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                console=self.out, transient=True)
            self._progress.start()
            self._task = self._progress.add_task("train", total=e.total_steps,
                                                 completed=e.start_step, loss="")

    def _step_done(self, e: StepDone) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=e.step, loss=f"loss {_loss(e.loss)}")

    def _step_log(self, e: StepLog) -> None:
        accuracy = f" · accuracy {_pct(e.accuracy)}" if e.accuracy is not None else ""
        self._print(f"[bold]step {e.step}/{e.total_steps}[/] · epoch {e.epoch} · loss "
                    f"{_loss(e.loss)}{accuracy} · lr {e.learning_rate:.3g}", soft_wrap=True)
        table = Table()
        for column in ("replica", "device", "examples", "loss", "step time"):
            table.add_column(column, justify="right" if column != "device" else "left")
        for r in e.replicas:
            table.add_row(str(r.replica), r.device, str(r.examples), _loss(r.loss),
                          _ms(r.step_time_s))
        self._print(table)
        self._print("  per step: " + " -> ".join(f"{name} {_ms(s)}"
                                                  for name, s in e.phases_s.items()),
                    style="dim")

    def _checkpoint(self, e: CheckpointSaved) -> None:
        self._print(f"  checkpoint: step {e.step} -> {escape(e.path)}", style="dim",
                    soft_wrap=True)

    def _notice(self, e: Notice) -> None:
        self._print(f"[yellow]note:[/] {escape(e.message)}", soft_wrap=True)

    def _evaluated(self, e: Evaluated) -> None:
        accuracy = f"accuracy [bold]{_pct(e.accuracy)}[/], " if e.accuracy is not None else ""
        when = f" at step {e.step}" if e.step is not None else ""
        self._print(f"held out{when}: {accuracy}loss {_loss(e.loss)} ({e.examples} examples)")

    def close(self) -> None:
        """Stop the progress bar (before a summary or an error)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def summary(self, result: RunResult | ServeResult | StoppedWaiting) -> None:
        """The end of a run: loss curve, metrics, throughput, replica balance, digest."""
        self.close()
        if isinstance(result, StoppedWaiting):
            self.out.print(f"csrun train: {result.task} stopped by {result.signal} after "
                           f"{result.wall_s:.1f} s waiting for {result.waited_for}",
                           soft_wrap=True)
            return
        if isinstance(result, ServeResult):
            ended = "the chief ended the job" if result.status == "completed" else \
                "stopped by a signal before the chief ended the job"
            self.out.print(f"csrun train: {result.task} served {result.wall_s:.1f} s; {ended}",
                           soft_wrap=True)
            return
        m, t = result.metrics, result.throughput
        table = Table(title=f"csrun train: {result.status}", title_justify="left",
                      show_header=False, box=None, padding=(0, 2, 0, 0))
        table.add_column(style="bold", no_wrap=True)
        table.add_column(overflow="fold")
        epochs = f" ({result.epochs:.2f} epochs)" if result.epochs is not None else ""
        table.add_row("steps", f"{result.steps}/{result.total_steps}{epochs}")
        table.add_row("loss", f"{_loss(result.first_loss)} -> "
                              f"{_loss(result.final_loss)}  {sparkline(result.losses)}")
        train_acc = f", accuracy {_pct(m['train_accuracy'])}" \
            if m.get("train_accuracy") is not None else ""
        table.add_row("train", f"loss {_loss(m.get('train_loss'))}{train_acc} (last log "
                               "window, reduced over replicas)")
        if "eval_loss" in m:
            eval_acc = f"accuracy {_pct(m['eval_accuracy'])}, " \
                if m.get("eval_accuracy") is not None else ""
            table.add_row("held out", f"{eval_acc}loss {_loss(m['eval_loss'])} "
                                      f"({m['eval_examples']} examples)")
        table.add_row("speed", f"{t['examples_per_s']:,.0f} examples/s, "
                               f"{t['steps_per_s']:.1f} steps/s, {t['wall_s']:.1f} s "
                               "training")
        table.add_row("per step", " -> ".join(f"{k} {_ms(v)}"
                                              for k, v in result.phases_s.items()))
        table.add_row("replicas", self._balance(result))
        table.add_row("params_sha256", result.params_sha256)
        for name, text in _cluster_rows(getattr(result, "cluster", None)):
            table.add_row(name, text)
        if result.early_stopped:
            stop = result.early_stopped
            table.add_row("early stop", f"at step {stop['step']}: {stop['metric']} best "
                                        f"{stop['best']:.4g} at step {stop['best_step']}")
        if result.checkpoint.get("last"):
            table.add_row("checkpoint", escape(result.checkpoint["last"]))
        if result.checkpoint.get("best"):
            table.add_row("best", f"{escape(result.checkpoint['best'])} "
                                  f"({escape(str(result.checkpoint['best_metric']))})")
        if result.checkpoint.get("export"):
            table.add_row("exported", escape(result.checkpoint["export"]))
        self.out.print(table)

    @staticmethod
    def _balance(result: RunResult) -> str:
        parts = [f"{r['replica']}@{r['device']}: {100 * r['examples_share']:.0f}% of "
                 f"examples, {_ms(r['step_time_s'])}/step" for r in result.per_replica]
        ratio = result.replica_balance.get("step_time_max_over_min")
        balance = f"; slowest/fastest {ratio:.2f}x" if ratio else ""
        return "; ".join(parts) + balance

    # -- launch ----------------------------------------------------------------------------
    def launch_started(self, plan: LaunchPlan) -> None:
        counts = ", ".join(f"{len(plan.cluster[job])} {job}" for job in ("ps", "chief",
                                                                        "worker")
                           if plan.cluster.get(job))
        self.out.print(f"[bold]csrun launch[/]: {counts} on loopback, each a `csrun train` "
                       f"with its own TF_CONFIG; {plan.chief} is the chief", soft_wrap=True)
        self.out.print(f"  logs: {escape(str(plan.logs))}", soft_wrap=True)
        self._width = max(len(t) for t in plan.tasks)

    def on_launch_event(self, event: Any) -> None:
        """Render one event of :mod:`csrun.core.runner.launch`: a task's start, line or exit."""
        width = getattr(self, "_width", 8)
        if isinstance(event, TaskStarted):
            role = " (chief)" if event.chief else ""
            self.out.print(f"  started {event.task}{role} at {event.address}, pid {event.pid}",
                           soft_wrap=True)
        elif isinstance(event, TaskOutput):
            console = self.err if event.stream == "stderr" else self.out
            console.print(f"[dim]\\[{event.task}][/]{' ' * (width - len(event.task))} "
                          f"{escape(event.line)}", soft_wrap=True)
        elif isinstance(event, TaskExited):
            style = "dim" if event.exit_code == 0 else "yellow"
            self.out.print(f"  {event.task} ended: {describe_exit(event.exit_code)} after "
                           f"{event.seconds:.1f} s", style=style, soft_wrap=True)

    def launch_summary(self, result: LaunchResult) -> None:
        """How the job ended: each task's exit, lost workers, and why it failed."""
        codes = ", ".join(f"{t['task']} {describe_exit(t['exit_code'])}"
                          for t in result.tasks)
        color = {"completed": "green", "failed": "red"}.get(result.status, "yellow")
        self.out.print(f"[bold {color}]csrun launch: {result.status}[/] in "
                       f"{result.wall_s:.1f} s ({codes})", soft_wrap=True)
        if result.lost_workers:
            self.out.print(f"  lost workers: {', '.join(result.lost_workers)}; the job went "
                           "on without them (the chief reports them)", style="yellow",
                           soft_wrap=True)
        if result.error:
            self.err.print(f"[bold red]error:[/] {escape(result.error)}", soft_wrap=True)
            for task, lines in result.tails.items():
                self.err.print(f"  last stderr lines of {task}:", style="dim")
                for line in lines[-5:]:
                    self.err.print(f"    {escape(line)}", soft_wrap=True)
        self.out.print(f"  logs: {escape(result.logs)}", style="dim", soft_wrap=True)

    # -- validate, inspect-devices ---------------------------------------------------------
    def valid(self, path: str, config: Any) -> None:
        s, d, o, t = config.strategy, config.dataset, config.optimizer, config.train
        length = f"{t.steps} steps" if t.steps else f"{t.epochs} epochs"
        batch = next(step.size for step in d.steps if step.op == "batch")
        self.out.print(f"[green]ok:[/] {escape(path)} is valid", soft_wrap=True)
        where = f"parameters on {s.parameter_device or '(TF default)'}" \
            if s.kind == "central_storage" else "parameter servers (cluster: " + \
            ("strategy.cluster" if s.cluster else "TF_CONFIG") + ")"
        self.out.print(f"  strategy: {s.kind}; {', '.join(s.compute_devices or ['(default)'])};"
                       f" {where}\n"
                       f"  dataset: {d.source.kind}, global batch {batch}, {d.distribute}\n"
                       f"  model: {config.model.kind}; optimizer: {o.name} lr={o.lr:g}\n"
                       f"  train: {length}, seed {t.seed}", soft_wrap=True)

    def devices(self, report: dict[str, Any]) -> None:
        table = Table(title="local devices", title_justify="left")
        for column in ("device", "TF name", "torch", "kind", "memory", "model", "capability"):
            table.add_column(column)
        for d in report["devices"]:
            memory = d.get("memory_bytes")
            kind = "logical CPU" if d.get("logical") else d["kind"]
            table.add_row(d["short_name"], d["name"], d["torch"], kind,
                          f"{memory / 2**30:.1f} GiB" if memory else "-",
                          escape(d.get("model", "-")), d.get("capability", "-"))
        self.out.print(table)
        placement = report["default_placement"]
        self.out.print(f"default placement: replicas on "
                       f"{', '.join(placement['compute_devices'])}; parameters on "
                       f"{placement['parameter_device']}", soft_wrap=True)
        self.out.print(f"  ({placement['rule']})", style="dim", soft_wrap=True)
