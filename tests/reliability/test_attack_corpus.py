"""Our own attack corpus (issue 15, round 2): new attacks, beyond those listed in
docs/reliability.md, in the five classes a demanding user fears -- data loss, a hang, an
orphan process, a traceback, an unclear message. Each attack is a small function that
attacks csrun as a hostile user or a flaky environment would and asserts what that user
expects; ``ATTACKS`` records each one's class, and ``test_attack`` runs them all.

Attacks that need a real process (hangs, orphans, signals) run ``csrun`` as a subprocess
with a timeout; the others run the CLI in-process (a traceback would propagate: the CLI is
invoked with ``catch_exceptions=False``). Every run is tiny (``train.steps`` of 2-3).

An attack that found a defect not yet fixed is ``xfail(strict=True)`` naming it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psutil
import pytest
from typer.testing import CliRunner

from csrun.cli.main import app
from tests.helpers.cli import child_env, csrun_command
from tests.helpers.tiny_config import TINY, ps_config

SMALL = TINY.replace("train: {steps: 40, log_every: 10}",
                     "train: {steps: 2, log_every: 1}\n"
                     "checkpoint: {dir: ck, every_steps: 1, keep: 3}")
HANG_S = 60  # no command of a tiny run may take longer (they take ~8 s on 2 cores)
ORPHAN_S = 15  # a task or worker must be gone this long after its parent is


# -- the attacker's tools --------------------------------------------------------------------
@dataclass
class Done:
    code: int
    out: str
    err: str


class Attacker:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.config = tmp / "c.yaml"
        self.config.write_text(SMALL)

    # in-process: a traceback propagates and fails the attack
    def cli(self, *args) -> Done:
        done = CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)
        return Done(done.exit_code, done.stdout, done.stderr)

    # a real process, bounded
    def proc(self, *args, timeout=HANG_S, **popen) -> Done:
        popen.setdefault("stdout", subprocess.PIPE)
        popen.setdefault("stderr", subprocess.PIPE)
        done = subprocess.run(csrun_command() + [str(a) for a in args], cwd=self.tmp,
                              env=child_env(), timeout=timeout, **popen)
        decode = (lambda b: b.decode(errors="replace") if isinstance(b, bytes) else b or "")
        return Done(done.returncode, decode(done.stdout), decode(done.stderr))

    def spawn(self, *args) -> subprocess.Popen:
        return subprocess.Popen(csrun_command() + [str(a) for a in args], cwd=self.tmp,
                                env=child_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)

    def write(self, name: str, text: str) -> Path:
        path = self.tmp / name
        path.write_text(text)
        return path

    def trained(self) -> Path:
        """A checkpoint directory ``ck`` holding steps 1 and 2."""
        done = self.cli("train", self.config)
        assert done.code == 0, done.err
        return self.tmp / "ck"


def clean(done: Done, codes=(1, 2)) -> None:
    """A refusal or failure a user can read: the expected code, a message, no traceback."""
    assert done.code in codes, f"exit {done.code}\n{done.err}\n{done.out}"
    assert "Traceback (most recent call last)" not in done.err + done.out
    assert "CSRUN_TRACEBACK" not in done.err, done.err  # csrun's "unexpected error"
    assert done.err.strip(), "no message"


def digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.iterdir()) if p.is_file()}


def wait_gone(pids, seconds=ORPHAN_S) -> list[int]:
    """The pids still alive (not zombies) after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        alive = [p for p in pids if psutil.pid_exists(p)
                 and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def kill_left(pids) -> None:
    for pid in pids:  # only processes this attack started
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# == data loss ==============================================================================
def _resume_refused_and_older_intact(a: Attacker, damage: Callable[[Path], None]) -> None:
    ck = a.trained()
    older = {n: d for n, d in digests(ck).items() if "00000001" in n}
    config = a.config.read_bytes()
    damage(ck)
    done = a.cli("train", a.config, "--resume", "train.steps=3")
    clean(done)
    assert "ckpt-00000002" in done.err, done.err  # names the damaged one
    assert {n: d for n, d in digests(ck).items() if n in older} == older
    assert a.config.read_bytes() == config


def dl_newest_payload_replaced_by_a_directory(a):
    def damage(ck):
        (ck / "ckpt-00000002.pt").unlink()
        (ck / "ckpt-00000002.pt").mkdir()
    _resume_refused_and_older_intact(a, damage)


def dl_newest_manifest_replaced_by_a_directory(a):
    def damage(ck):
        (ck / "ckpt-00000002.json").unlink()
        (ck / "ckpt-00000002.json").mkdir()
    _resume_refused_and_older_intact(a, damage)


def dl_newest_payload_a_symlink_to_the_config(a):
    def damage(ck):
        (ck / "ckpt-00000002.pt").unlink()
        (ck / "ckpt-00000002.pt").symlink_to(a.config)
    _resume_refused_and_older_intact(a, damage)


def dl_json_onto_a_checkpoint(a):
    ck = a.trained()
    before = digests(ck)
    done = a.cli("train", a.config, "--resume", "train.steps=3", "--json",
                 "ck/ckpt-00000002.pt")
    # whatever happens, the checkpoint csrun wrote is not replaced by a JSON result
    assert (ck / "ckpt-00000002.pt").read_bytes()[:1] != b"{", done.err
    assert digests(ck)["ckpt-00000002.pt"] == before["ckpt-00000002.pt"]


def dl_metrics_onto_a_manifest(a):
    ck = a.trained()
    before = digests(ck)
    done = a.cli("train", a.config, "--resume", "train.steps=3", "--metrics",
                 "ck/ckpt-00000002.json")
    assert digests(ck)["ckpt-00000002.json"] == before["ckpt-00000002.json"], done.err


def dl_metrics_a_hard_link_to_the_config(a):
    os.link(a.config, a.tmp / "m.jsonl")
    before = a.config.read_bytes()
    done = a.cli("train", a.config, "--metrics", "m.jsonl")
    clean(done, (2,))
    assert a.config.read_bytes() == before


def dl_checkpoint_dir_holding_the_config_and_notes(a):
    """checkpoint.dir=. with keep 1: the config and the user's files there survive."""
    notes = a.write("ckpt-notes.txt", "mine")
    a.write("ckpt-00000099.pt.bak", "a user's backup")
    done = a.cli("train", a.config, "checkpoint.dir=.", "checkpoint.keep=1",
                 "train.steps=3")
    assert done.code == 0, done.err
    assert a.config.read_text() == SMALL and notes.read_text() == "mine"
    assert (a.tmp / "ckpt-00000099.pt.bak").read_text() == "a user's backup"


def dl_config_edited_between_runs_holdout(a):
    """The held-out split decides which examples train: another split is another run."""
    ck = a.trained()
    before = digests(ck)
    a.config.write_text(SMALL.replace("holdout: 0.25", "holdout: 0.5"))
    done = a.cli("train", a.config, "--resume", "train.steps=3")
    clean(done, (1,))
    assert "dataset.holdout" in done.err, done.err
    assert digests(ck) == before


def dl_newest_manifest_with_a_key_given_twice(a):
    """Round 4: JSON keeps the last of two equal keys without a word; a manifest with
    one given twice was read as if whole."""
    def damage(ck):
        manifest = ck / "ckpt-00000002.json"
        manifest.write_text(manifest.read_text().replace('"step": 2', '"step": 2, "step": 2'))
    _resume_refused_and_older_intact(a, damage)


# == hang ====================================================================================
def hang_train_with_stdin_closed(a):
    done = a.proc("train", a.config, stdin=subprocess.DEVNULL)
    assert done.code == 0, done.err


def hang_stdout_is_dev_full(a):
    with open("/dev/full", "w") as full:
        done = a.proc("validate", a.config, stdout=full)
    clean(done, (1,))
    assert "standard output: No space left" in done.err, done.err


def hang_sigterm_during_validate(a):
    process = a.spawn("validate", a.config)
    time.sleep(1.5)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=HANG_S)
    assert process.returncode == 143, err
    assert b"Traceback" not in err


def hang_dataset_file_is_a_fifo(a):
    os.mkfifo(a.tmp / "data.npz")
    config = a.write("fifo.yaml", SMALL.replace(
        "{kind: synthetic, examples: 96, features: 6, classes: 3}",
        "{kind: file, path: data.npz}"))
    done = a.proc("validate", config)
    clean(done, (2,))
    assert "dataset.source.path" in done.err, done.err


def hang_take_and_skip_of_10_18(a):
    config = a.write("huge.yaml", SMALL.replace(
        "- {op: batch, size: 16}",
        "- {op: skip, count: 1000000000000000000}\n"
        "    - {op: take, count: 1000000000000000000}\n    - {op: batch, size: 16}"))
    done = a.proc("validate", config)
    clean(done, (2,))  # skipping everything leaves no batch to train on


def hang_shuffle_buffer_of_10_18(a):
    done = a.proc("train", a.config, "dataset.steps.0.buffer=1000000000000000000")
    assert done.code in (0, 2), done.err
    assert "Traceback" not in done.err


def hang_steps_of_10_18_then_sigterm(a):
    process = a.spawn("train", a.config, "train.steps=1000000000000000000",
                      "checkpoint.every_steps=1000")
    deadline = time.monotonic() + HANG_S
    while not (a.tmp / "ck").exists():  # the run has started
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=HANG_S)
    assert process.returncode == 143, err
    assert list((a.tmp / "ck").glob("ckpt-*.pt")), "no checkpoint at the stop"


def hang_stdout_a_closed_pipe(a):
    read, write = os.pipe()
    os.close(read)
    try:
        done = a.proc("train", a.config, stdout=write)
    finally:
        os.close(write)
    assert done.code in (0, 1), done.err
    assert "Traceback" not in done.err, done.err


def hang_prefetch_of_2_63_with_loader_workers(a):
    """Round 4: torch's DataLoader loops prefetch x workers times before the first batch."""
    done = a.proc("train", a.config, "dataset.workers=1",
                  "dataset.steps=[{op: batch, size: 16}, {op: prefetch, buffer: "
                  "9223372036854775807}]")
    clean(done, (2,))
    assert "dataset.steps.1.buffer" in done.err, done.err


# == orphan ==================================================================================
PS = ps_config("~strategy.timeout_s", "dataset.source.examples=128",
               "dataset.source.features=6", "dataset.holdout=0", "dataset.steps.0.buffer=128",
               "dataset.steps.1.size=16", "model.hidden=[8]",
               "train={steps: 100000000, log_every: 100}",
               "checkpoint={dir: ck, every_steps: 1000, keep: 1}")


def _launched(a):
    a.write("ps.yaml", PS)
    process = a.spawn("launch", "ps.yaml", "--workers", "1", "--ps", "1", "--logs", "logs")
    deadline = time.monotonic() + HANG_S
    while True:  # every task is up and the chief is training
        tasks = psutil.Process(process.pid).children(recursive=True)
        log = a.tmp / "logs" / "worker-0.stdout.log"
        if len(tasks) >= 2 and log.exists() and "step" in log.read_text(errors="replace"):
            return process, [t.pid for t in tasks]
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.2)


def _launch_stopped_by(a, *signals):
    process, tasks = _launched(a)
    try:
        for signum in signals:
            process.send_signal(signum)
            time.sleep(0.3)
        process.communicate(timeout=HANG_S)
        assert not wait_gone(tasks, seconds=1), "a task outlived its launcher"
    finally:
        kill_left(tasks + [process.pid])
    return process.returncode


def orphan_launch_sigterm(a):
    assert _launch_stopped_by(a, signal.SIGTERM) == 143


def orphan_launch_two_ctrl_c(a):
    assert _launch_stopped_by(a, signal.SIGINT, signal.SIGINT) == 130


def orphan_launcher_sigkilled(a):
    process, tasks = _launched(a)
    try:
        process.kill()
        process.communicate()
        left = wait_gone(tasks)
        assert not left, f"{len(left)} task(s) still running {ORPHAN_S} s after the launcher"
    finally:
        kill_left(tasks)


WORKERS = SMALL.replace("  holdout: 0.25", "  holdout: 0.25\n  workers: 2")


def _loader_workers(a, *args):
    config = a.write("w.yaml", WORKERS)
    process = a.spawn("train", config, *args)
    deadline = time.monotonic() + HANG_S
    while True:
        children = psutil.Process(process.pid).children(recursive=True)
        if children or process.poll() is not None:
            return process, [c.pid for c in children]
        assert time.monotonic() < deadline, "no data loader worker"
        time.sleep(0.05)


def orphan_train_sigkilled_with_loader_workers(a):
    process, children = _loader_workers(a, "train.steps=1000000000")
    try:
        time.sleep(1)
        children = [c.pid for c in psutil.Process(process.pid).children(recursive=True)]
        process.kill()
        process.communicate()
        assert not wait_gone(children), "a data loader worker outlived its run"
    finally:
        kill_left(children)


def orphan_train_sigterm_with_loader_workers(a):
    process, children = _loader_workers(a, "train.steps=1000000000")
    try:
        time.sleep(1)
        children = [c.pid for c in psutil.Process(process.pid).children(recursive=True)]
        process.send_signal(signal.SIGTERM)
        process.communicate(timeout=HANG_S)
        assert process.returncode == 143
        assert not wait_gone(children, seconds=2), "a data loader worker outlived its run"
    finally:
        kill_left(children + [process.pid])


def orphan_map_fn_raising_in_a_loader_worker(a):
    a.write("bad_map.py", "def fn(x, y):\n    raise ValueError('a bad example')\n")
    config = a.write("m.yaml", WORKERS.replace(
        "- {op: batch, size: 16}", "- {op: map, fn: 'bad_map:fn'}\n    - {op: batch, size: 16}"))
    env = {**child_env()}
    env["PYTHONPATH"] = os.pathsep.join([str(a.tmp), env["PYTHONPATH"]])
    process = subprocess.Popen(csrun_command() + ["train", str(config)], cwd=a.tmp, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    seen: set[int] = set()
    deadline = time.monotonic() + HANG_S
    try:
        while process.poll() is None:
            try:
                seen |= {c.pid for c in psutil.Process(process.pid).children(recursive=True)}
            except psutil.NoSuchProcess:
                pass
            assert time.monotonic() < deadline, "the run did not end"
            time.sleep(0.05)
        out, err = process.communicate()
        clean(Done(process.returncode, out.decode(), err.decode()), (1,))
        assert b"a bad example" in err and b"dataset.steps.1.fn" in err, err
        assert b"Original Traceback" not in err, err
        assert not wait_gone(seen, seconds=2), "a data loader worker outlived its run"
    finally:
        kill_left(list(seen))


# == traceback ===============================================================================
def _refused(a, *overrides, config=None, codes=(2,)) -> Done:
    done = a.cli("validate", config or a.config, "--", *overrides)
    clean(done, codes)
    return done


def tb_emoji_key(a):
    _refused(a, config=a.write("e.yaml", SMALL + "🚀: {fast: true}\n"))


def tb_merge_key_of_itself(a):
    _refused(a, config=a.write("m.yaml", SMALL + "extra: &x {<<: *x}\n"))


def tb_nan_steps_override(a):
    _refused(a, "train.steps=.nan")


def tb_inf_holdout_override(a):
    _refused(a, "dataset.holdout=.inf")


def tb_empty_override_value(a):
    _refused(a, "optimizer.lr=")


def tb_holdout_of_one(a):
    """Everything held out: nothing left to train on."""
    _refused(a, "dataset.holdout=1.0")


def tb_model_target_raises_at_import(a, monkeypatch):
    a.write("boom_model.py", "raise ValueError('boom at import')\n")
    monkeypatch.syspath_prepend(str(a.tmp))
    done = _refused(a, "model.kind=import", "model.target=boom_model:Model",
                    "model.hidden=null")
    assert "boom at import" in done.err, done.err


def tb_model_target_returns_a_string(a, monkeypatch):
    a.write("str_model.py", "def Model():\n    return 'not a module'\n")
    monkeypatch.syspath_prepend(str(a.tmp))
    _refused(a, "model.kind=import", "model.target=str_model:Model", "model.hidden=null")


def tb_map_fn_of_the_wrong_arity(a, monkeypatch):
    a.write("arity.py", "def fn(x):\n    return x\n")
    monkeypatch.syspath_prepend(str(a.tmp))
    config = a.write("m.yaml", SMALL.replace(
        "- {op: batch, size: 16}", "- {op: map, fn: 'arity:fn'}\n    - {op: batch, size: 16}"))
    done = a.cli("validate", config)  # found before training: a config problem at its key
    clean(done, (2,))
    assert "dataset.steps.1.fn" in done.err and "fn(x, y)" in done.err, done.err


def tb_json_to_an_empty_path(a):
    clean(a.cli("validate", a.config, "--json", ""), (2,))


def tb_no_compute_devices(a):
    _refused(a, "strategy.compute_devices=[]")


def tb_log_every_of_2_63(a):
    """Round 4: train failed with "OverflowError: Python int too large to convert to C
    ssize_t" (a window of 3 x log_every losses)."""
    done = a.cli("train", a.config, "train.log_every=9223372036854775807")
    clean(done, (2,))
    assert "train.log_every" in done.err, done.err


PS_CLUSTER = ("strategy={kind: parameter_server, cluster: {worker: ['localhost:2222'], "
              "ps: ['localhost:2223']}, task: {type: worker, index: 0}}")


def tb_timeout_s_of_1e308(a):
    """Round 4: validate passed it, train failed with "OverflowError: Python int too
    large to convert to C int"."""
    done = _refused(a, PS_CLUSTER, "strategy.timeout_s=1e308")
    assert "strategy.timeout_s" in done.err and "1,000,000 s" in done.err, done.err


# == unclear message =========================================================================
def _names(a, overrides, field, hint_words):
    done = _refused(a, *overrides)
    assert field in done.err, done.err
    assert any(w in done.err for w in hint_words), done.err


def msg_misspelt_optimizer(a):
    _names(a, ["optimizer.name=Adamm"], "optimizer.name", ["Adam"])


def msg_misspelt_model_kind(a):
    _names(a, ["model.kind=mpl"], "model.kind", ["mlp"])


def msg_misspelt_op(a):
    _names(a, ["dataset.steps.0.op=shufle"], "dataset.steps.0", ["shuffle"])


def msg_misspelt_train_key(a):
    _names(a, ["train.stepz=2"], "train.stepz", ["steps"])


def msg_negative_keep(a):
    _names(a, ["checkpoint.keep=-1"], "checkpoint.keep", ["greater than 0", ">= 1", "at least"])


def msg_holdout_past_one(a):
    _names(a, ["dataset.holdout=1.5"], "dataset.holdout", ["less than 1", "at most", "between"])


def msg_hidden_a_scalar(a):
    _names(a, ["model.hidden=16"], "model.hidden", ["list", "[16]"])


def msg_missing_gpu(a):
    _names(a, ["strategy.compute_devices=[GPU:7]"], "strategy.compute_devices",
           ["GPU", "CUDA", "available"])


def msg_tf_config_with_task_given_twice(a, monkeypatch):
    """Round 4: "task" given twice passed validate (exit 0): the later one silently won."""
    monkeypatch.setenv("TF_CONFIG", '{"cluster": {"worker": ["localhost:2222"], "ps": '
                       '["localhost:2223"]}, "task": {"type": "ps", "index": 0}, '
                       '"task": {"type": "worker", "index": 0}}')
    done = _refused(a, "strategy={kind: parameter_server}")
    assert "TF_CONFIG" in done.err and 'the key "task" is given twice' in done.err, done.err


# -- the table ---------------------------------------------------------------------------
def _xfail(reason):
    return pytest.mark.xfail(strict=True, reason=reason)


PROCESS = pytest.mark.process  # the hangs and orphans are csrun processes


ATTACKS: list = [
    # (class, attack, marks)
    ("data loss", dl_newest_payload_replaced_by_a_directory, ()),
    ("data loss", dl_newest_manifest_replaced_by_a_directory, ()),
    ("data loss", dl_newest_payload_a_symlink_to_the_config, ()),
    ("data loss", dl_json_onto_a_checkpoint, ()),
    ("data loss", dl_metrics_onto_a_manifest, ()),
    ("data loss", dl_metrics_a_hard_link_to_the_config, ()),
    ("data loss", dl_checkpoint_dir_holding_the_config_and_notes, ()),
    ("data loss", dl_config_edited_between_runs_holdout, ()),
    ("data loss", dl_newest_manifest_with_a_key_given_twice, ()),
    ("hang", hang_train_with_stdin_closed, (PROCESS,)),
    ("hang", hang_stdout_is_dev_full, (PROCESS,)),
    ("hang", hang_sigterm_during_validate, (PROCESS,)),
    ("hang", hang_dataset_file_is_a_fifo, (PROCESS,)),
    ("hang", hang_take_and_skip_of_10_18, (PROCESS,)),
    ("hang", hang_shuffle_buffer_of_10_18, (PROCESS,)),
    ("hang", hang_steps_of_10_18_then_sigterm, (PROCESS,)),
    ("hang", hang_stdout_a_closed_pipe, (PROCESS,)),
    ("hang", hang_prefetch_of_2_63_with_loader_workers, (PROCESS,)),
    ("orphan", orphan_launch_sigterm, (PROCESS,)),
    ("orphan", orphan_launch_two_ctrl_c, (PROCESS,)),
    ("orphan", orphan_launcher_sigkilled, (PROCESS,)),
    ("orphan", orphan_train_sigkilled_with_loader_workers, (PROCESS,)),
    ("orphan", orphan_train_sigterm_with_loader_workers, (PROCESS,)),
    ("orphan", orphan_map_fn_raising_in_a_loader_worker, (PROCESS,)),
    ("traceback", tb_emoji_key, ()),
    ("traceback", tb_merge_key_of_itself, ()),
    ("traceback", tb_nan_steps_override, ()),
    ("traceback", tb_inf_holdout_override, ()),
    ("traceback", tb_empty_override_value, ()),
    ("traceback", tb_holdout_of_one, ()),
    ("traceback", tb_model_target_raises_at_import, ()),
    ("traceback", tb_model_target_returns_a_string, ()),
    ("traceback", tb_map_fn_of_the_wrong_arity, ()),
    ("traceback", tb_json_to_an_empty_path, ()),
    ("traceback", tb_no_compute_devices, ()),
    ("traceback", tb_log_every_of_2_63, ()),
    ("traceback", tb_timeout_s_of_1e308, ()),
    ("unclear message", msg_misspelt_optimizer, ()),
    ("unclear message", msg_misspelt_model_kind, ()),
    ("unclear message", msg_misspelt_op, ()),
    ("unclear message", msg_misspelt_train_key, ()),
    ("unclear message", msg_negative_keep, ()),
    ("unclear message", msg_holdout_past_one, ()),
    ("unclear message", msg_hidden_a_scalar, ()),
    ("unclear message", msg_missing_gpu, ()),
    ("unclear message", msg_tf_config_with_task_given_twice, ()),
]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("klass, attack", [
    pytest.param(k, f, marks=m, id=f"{k.replace(' ', '_')}-{f.__name__}")
    for k, f, m in ATTACKS])
def test_attack(klass, attack, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = Attacker(tmp_path)
    if "monkeypatch" in attack.__code__.co_varnames[:attack.__code__.co_argcount]:
        attack(a, monkeypatch)
    else:
        attack(a)


def test_every_class_has_at_least_six_attacks():
    classes = [k for k, _, _ in ATTACKS]
    for klass in ("data loss", "hang", "orphan", "traceback", "unclear message"):
        assert classes.count(klass) >= 6, klass
    assert len(ATTACKS) >= 30
