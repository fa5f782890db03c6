"""A run's checkpoints: what goes into one, when it is written, how a run resumes.

A checkpoint's contents are listed once, as the run's *parts*: objects with
``state_dict()`` (entries of the payload) and ``load_state_dict(payload)`` (take them
back), in the order they are restored. :class:`Entry` puts an object's own state (a
model, an optimizer) under one key. The files themselves (atomic, checksummed, verified)
are :mod:`csrun.core.runner.checkpoint`'s.

Example::

    checkpoints = Checkpointer(config, replicas=2, is_chief=True, emit=print)
    parts = [Entry("model", model), Entry("optimizer", optimizer), state]
    checkpoints.save(state.step, parts)
    payload = checkpoints.restore(parts)       # None: nothing to resume from
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence

from ..config.schema import RunConfig
from .checkpoint import CheckpointError, CheckpointManager
from .digests import file_sha256
from .events import CheckpointSaved, Notice

__all__ = ["Stateful", "Entry", "Checkpointer", "run_identity"]


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, payload: dict) -> None: ...


class Entry:
    """``obj``'s ``state_dict()`` under ``key`` (None when there is no ``obj``, e.g. no
    schedule); ``required=False``: a checkpoint without the key loads as None."""

    def __init__(self, key: str, obj: Any, required: bool = True):
        self.key, self.obj, self.required = key, obj, required

    def state_dict(self) -> dict:
        return {self.key: self.obj.state_dict() if self.obj is not None else None}

    def load_state_dict(self, payload: dict) -> None:
        if self.obj is not None:
            self.obj.load_state_dict(payload[self.key] if self.required
                                     else payload.get(self.key))


def run_identity(config: RunConfig, replicas: int) -> dict[str, Any]:
    """What must match to resume bit-for-bit, flattened to dotted keys."""
    dump = config.model_dump(mode="json")
    dataset = {k: v for k, v in dump["dataset"].items() if k not in ("workers", "pin_memory")}
    flat: dict[str, Any] = {"train.seed": dump["train"]["seed"], "strategy.replicas": replicas}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, item in value.items():
                walk(f"{prefix}.{key}", item)
        elif isinstance(value, list) and value:
            for i, item in enumerate(value):
                walk(f"{prefix}.{i}", item)
        else:
            flat[prefix] = value

    for name, section in (("model", dump["model"]), ("optimizer", dump["optimizer"]),
                          ("dataset", dataset)):
        walk(name, section)
    # a data file is identified by its contents, not its path: a file changed in place
    # must not resume silently, a moved one may
    path = flat.pop("dataset.source.path", None)
    if path is not None:
        flat["dataset.source.path.sha256"] = file_sha256(path)
    return flat


class Checkpointer:
    """Writes and restores a run's checkpoints (the chief's; another worker keeps none:
    ``manager`` is None) and knows which were written and resumed from."""

    def __init__(self, config: RunConfig, replicas: int, is_chief: bool,
                 emit: Callable[[Any], None]):
        self.emit = emit
        self.directory = config.checkpoint.dir
        self.is_chief = is_chief
        self.saved_step: int | None = None
        self.saved_path: str | None = None
        self.resumed_from: int | None = None
        # how steps are computed; a resume with others goes on, and says so
        self.settings = {"train.accumulate_steps": config.train.accumulate_steps,
                         "train.grad_clip_norm": config.train.grad_clip_norm}
        self._moved_noted = False
        self.manager = self._manager(config, replicas) if self.directory and is_chief \
            else None

    def _manager(self, config: RunConfig, replicas: int) -> CheckpointManager:
        """The manager, rid of what a crash mid-save left (complete ones are untouched)."""
        manager = CheckpointManager(self.directory, config.checkpoint.keep,
                                    run_identity(config, replicas))
        manager.claim()  # one run per directory (exit 2 if another holds it)
        removed = manager.remove_incomplete()
        if removed:
            self.emit(Notice(f"removed {len(removed)} incomplete checkpoint file(s) left by "
                             f"an interrupted save: {', '.join(removed)}"))
        return manager

    def keep_best(self, step: int | None) -> None:
        """The checkpoint of ``step`` survives the rotation (``checkpoint.keep_best``)."""
        if self.manager is not None:
            self.manager.best_step = step

    def best_path(self, step: int) -> str | None:
        return str(self.manager.path_of(step)) if self.manager is not None else None

    def _note_moved(self) -> None:
        if self.manager.moved and not self._moved_noted:
            self._moved_noted = True
            self.emit(Notice(f"checkpoint.dir {self.directory!r} now leads elsewhere; this "
                             f"run keeps saving in {str(self.manager.directory)!r}, the "
                             "folder it started in (and holds the lock of)"))

    def _note_settings(self, saved: dict | None) -> None:
        changed = [f"{key} {value} (the checkpoint's run had {saved[key]})"
                   for key, value in self.settings.items()
                   if saved is not None and key in saved and saved[key] != value]
        if changed:
            self.emit(Notice(f"resumed with {', '.join(changed)}: from here the steps "
                             "differ from those of an uninterrupted run"))

    def save(self, step: int, parts: Sequence[Stateful], again: bool = False) -> None:
        """Write the checkpoint of ``step`` (once per step, unless ``again``: the job's
        state moved on without this process's step, as a ps job's does while its chief
        waits for the other workers; none before the first). A part that writes files of
        its own beside the payload (``write_files(directory, stem)``, a ps job's shards)
        does so first."""
        if self.manager is None or (self.saved_step == step and not again) or step == 0:
            return
        self._note_moved()
        # a run that starts over replaces the checkpoints of earlier runs, so that
        # --resume never picks an older run's newer step: once its own is durable
        fresh = self.saved_step is None and self.resumed_from is None
        earlier = len(self.manager.manifests()) if fresh else 0
        stem, files = self.manager.stem(step), []
        for part in parts:
            if hasattr(part, "write_files"):
                self.manager.directory.mkdir(parents=True, exist_ok=True)
                files += part.write_files(self.manager.directory, stem)
        payload: dict = {"settings": self.settings}
        for part in parts:
            payload.update(part.state_dict())
        path = self.manager.save(step, payload, replace=fresh, stem=stem, files=files)
        if earlier:
            self.emit(Notice(f"started over (no --resume): replaced {earlier} "
                             f"checkpoint(s) of an earlier run in "
                             f"{str(self.manager.directory)!r}"))
        self.saved_step, self.saved_path = step, str(path)
        self._tell_saved(parts)
        self.emit(CheckpointSaved(step, str(path)))

    def _tell_saved(self, parts: Sequence[Stateful]) -> None:
        """The last intact checkpoint, to the parts that pass it on (``saved(step,
        path)``: a ps job's chief tells the other tasks)."""
        for part in parts:
            if hasattr(part, "saved"):
                part.saved(self.saved_step, self.saved_path)

    def restore(self, parts: Sequence[Stateful]) -> dict | None:
        """Load the newest checkpoint into ``parts``; its payload, or None when there is
        none (a worker that is not the chief starts where the chief does)."""
        if self.manager is None:
            return None
        loaded = self.manager.load_latest()
        if loaded is None:
            self.emit(Notice(f"--resume: no checkpoint in {self.directory!r} yet; "
                             "starting at step 0"))
            return None
        payload, manifest = loaded
        path = str(self.manager.directory / manifest["file"])
        payload["files"] = {"directory": str(self.manager.directory),
                            "listed": manifest.get("files", []), "payload": path}
        try:
            for part in parts:
                part.load_state_dict(payload)
        except (RuntimeError, KeyError, ValueError, TypeError, AttributeError) as exc:
            # verified and from this config, yet not what this csrun writes: say so
            raise CheckpointError(f"checkpoint {path!r} does not fit this model and "
                                  f"optimizer: {type(exc).__name__}: {exc}") from None
        self.resumed_from = self.saved_step = payload["step"]
        self.saved_path = path
        self._tell_saved(parts)
        self._note_settings(payload.get("settings"))  # (older checkpoints have none)
        return payload

    def note(self) -> str:
        """What a failure leaves behind: the last checkpoint, intact, or none."""
        if self.saved_path:
            return f"the last checkpoint (step {self.saved_step}, {self.saved_path}) is intact"
        return "no checkpoint was written" if self.is_chief else "checkpoints are the chief's"

    def close(self) -> None:
        if self.manager is not None:
            self.manager.release()
