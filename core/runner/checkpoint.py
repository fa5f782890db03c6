"""Checkpoints: atomic, checksummed, safe to load, kept to the newest ``keep``.

Each checkpoint is two files in ``checkpoint.dir``:

* ``ckpt-00000050.pt`` -- the payload (``torch.save`` of tensors and plain data only);
* ``ckpt-00000050.json`` -- the manifest: step, the payload's size and SHA-256, and the
  run's *identity* (the config sections that must match to resume);

and, in a parameter-server job, the ps tasks' shards (``ckpt-00000050.ps-0.safetensors``,
...), each listed in the manifest's ``files`` with its size and SHA-256. A step saved
again (a ps job's chief, after the other workers finished) takes a new generation
(``ckpt-00000050.g1.pt``, ...): the manifest's replacement is the one moment it switches,
and the previous generation's files go only after it.

Both are written to a temporary file in the same directory, flushed with ``fsync`` and
renamed into place (``os.replace`` is atomic), payload first: a manifest exists only for a
complete payload, so a crash mid-write leaves the previous checkpoint as the newest.
Loading verifies size and checksum, then ``torch.load(weights_only=True)`` (no pickled
code runs), then compares identities and names what differs.
"""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import re
import secrets
import stat
from typing import Any, BinaryIO

import torch

from ..config import strict_json
from .digests import file_sha256
from .dir_lock import DirectoryLock

__all__ = ["CheckpointError", "CheckpointManager", "FORMAT", "write_atomic", "json_object",
           "open_regular"]

FORMAT = 1
# a manifest is a few kilobytes (its identity holds the config, itself at most 1 MiB)
MANIFEST_MAX_BYTES = 4 << 20
_NAME = re.compile(r"^ckpt-(\d{8,})\.json$")
# what a checkpoint's files are named: its stem (``ckpt-00000050``, a later generation
# ``ckpt-00000050.g1``), then ``.pt`` (the payload) or ``.ps-K.safetensors`` (a ps's shards)
_FILE = re.compile(r"^(ckpt-\d{8,})(\.g\d{1,6})?(\.pt|\.ps-\d{1,5}\.safetensors)$")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written, is damaged, or belongs to another run."""


_TEMP = re.compile(r"^\.ckpt-\d{8,}\..*\.tmp$")


def write_atomic(path: pathlib.Path, write) -> None:
    """Call ``write(file)`` on a temp file beside ``path``, fsync it, rename it over."""
    fd, tmp = _temp_file(path)
    try:
        with os.fdopen(fd, "wb") as raw:
            f = _Recording(raw)
            try:
                write(f)
            except Exception:
                # torch.save reports a failed write (a full disk) as a RuntimeError
                # ("unexpected pos"); the OSError underneath is what to tell the user
                if f.error is not None:
                    raise f.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with _suppress():
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _temp_file(path: pathlib.Path) -> tuple[int, str]:
    """A new file ``.<name>.<random>.tmp`` beside ``path``, opened for writing, with the
    mode every other output of csrun gets (0666 less the umask, applied by the kernel);
    ``tempfile.mkstemp`` would make it 0600 whatever the umask says."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | \
        getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):  # as mkstemp: another name when one is taken
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {str(path)!r}")


class _Recording:
    """A file that remembers the first OSError of a write, so that a library wrapping
    it in another exception cannot hide it."""

    def __init__(self, file):
        self._file, self.error = file, None

    def write(self, data) -> int:
        try:
            return self._file.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def __getattr__(self, name: str):
        return getattr(self._file, name)


def _fsync_dir(directory: pathlib.Path) -> None:
    # the rename itself is durable only once the directory entry is flushed (POSIX)
    with _suppress():
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def open_regular(path: pathlib.Path, what: str, advice: str = "") -> BinaryIO:
    """``path`` opened for reading, only if it is a regular file: a FIFO would block the
    open or the read until a writer comes, a device never end it. Looked at before the
    open, so that such a file is never opened, and again on the open descriptor, which is
    opened non-blocking: a name swapped for a FIFO in between cannot block either.

    Raises:
      CheckpointError: it is missing, not a regular file, or cannot be opened.
    """
    def refused() -> CheckpointError:
        return CheckpointError(f"{what} {str(path)!r} is not a regular file{advice}")
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise refused()
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CheckpointError(f"{what} {str(path)!r} is unreadable: "
                              f"{exc.strerror or exc}{advice}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise refused()
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def json_object(path: pathlib.Path, what: str, limit: int, advice: str = "") -> dict:
    """The JSON object in the regular file ``path`` (:func:`open_regular`), read only if
    it holds at most ``limit`` bytes, strictly (:mod:`csrun.core.config.strict_json`: a
    key given twice is refused, not silently the last).

    Raises:
      CheckpointError: it is not a regular file, too big, unreadable, or not an object.
    """
    with open_regular(path, what, advice) as f:
        size = os.fstat(f.fileno()).st_size
        if size > limit:
            raise CheckpointError(f"{what} {str(path)!r} holds {size} bytes, more than a "
                                  f"{what} can ({limit}){advice}")
        try:
            data = strict_json.loads(f.read(limit + 1))
        except (OSError, ValueError) as exc:  # json.JSONDecodeError is a ValueError
            raise CheckpointError(f"{what} {str(path)!r} is unreadable: {exc}{advice}") \
                from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} {str(path)!r} is not a JSON object{advice}")
    return data


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, OSError)


class CheckpointManager:
    """Saves, lists, prunes and verifies the checkpoints of one run.

    Args:
      directory: ``checkpoint.dir``.
      keep: how many of the newest checkpoints to keep.
      identity: what must match to resume (flat ``{"dotted.key": value}`` of plain data).

    Example::

        manager = CheckpointManager("runs/ckpt", keep=3, identity={"model.kind": "mlp"})
        manager.save(100, {"model": model.state_dict()})
        payload, manifest = manager.load_latest()
    """

    def __init__(self, directory: str | os.PathLike, keep: int, identity: dict[str, Any]):
        self.given = pathlib.Path(directory)
        self.keep = keep
        self.identity = identity
        self._lock: DirectoryLock | None = None
        self._claimed: pathlib.Path | None = None  # the folder the lock is in
        self.best_step: int | None = None  # survives the rotation (checkpoint.keep_best)

    @property
    def directory(self) -> pathlib.Path:
        """Where the checkpoints are: ``checkpoint.dir``, or, if it is a symlink that was
        pointed elsewhere since the run claimed it, the folder it claimed (where its lock
        is): the run's saves and pruning never move into another run's folder."""
        if self._claimed is not None and self.moved:
            return self._claimed
        return self.given

    @property
    def moved(self) -> bool:
        """``checkpoint.dir`` no longer leads to the folder this run claimed."""
        return self._claimed is not None and \
            pathlib.Path(os.path.realpath(self.given)) != self._claimed

    def claim(self) -> None:
        """Own the directory for this run (:class:`DirectoryLock`); before anything in
        it is removed, since the files may be another live run's.

        Raises:
          ConfigError: another run holds it (exit code 2).
        """
        if self._lock is None:
            real = pathlib.Path(os.path.realpath(self.given))
            self._lock = DirectoryLock(real, shown=self.given)
            self._claimed = real

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def save(self, step: int, payload: dict, *, replace: bool = False, stem: str | None = None,
             files: list[dict] = ()) -> pathlib.Path:
        """Write the checkpoint of ``step`` atomically; prune old ones (``replace``: every
        other one, an earlier run's, once this one is durable). ``stem``: the names of
        this save (:meth:`stem`); ``files``: what was written beside it under that stem
        (``{"file", "bytes", "sha256"}`` each: a ps's shards), listed in the manifest.
        Returns the payload's path.

        Raises:
          CheckpointError: it could not be written (a full disk, no permission); the
            directory is left as it was, earlier checkpoints intact.
        """
        stem = stem or self.stem(step)
        path = self.directory / f"{stem}.pt"
        manifest_path = self.directory / f"ckpt-{step:08d}.json"
        before = _referenced(manifest_path) if manifest_path.exists() else []
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            write_atomic(path, lambda f: torch.save(payload, f))
            manifest = {"format": FORMAT, "step": step, "file": path.name,
                        "bytes": path.stat().st_size, "sha256": file_sha256(path),
                        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                        "torch": torch.__version__, "identity": self.identity}
            if files:
                manifest["files"] = list(files)
            text = json.dumps(manifest, indent=1, sort_keys=True).encode()
            write_atomic(manifest_path, lambda f: f.write(text))
        except OSError as exc:
            if _referenced(manifest_path) != [path.name] + [f["file"] for f in files]:
                for name in [path.name] + [f["file"] for f in files]:  # never listed
                    with _suppress():
                        (self.directory / name).unlink()
            raise CheckpointError(f"cannot write a checkpoint to {str(self.directory)!r} "
                                  f"(step {step}): {exc.strerror or exc}; "
                                  f"{self._newest()}") from None
        for name in before:  # the previous generation of this step, now replaced
            if name not in (path.name, *(f["file"] for f in files)):
                with _suppress():
                    (self.directory / name).unlink()
        if replace:
            self.clear(keep=step)
        self._prune()
        return path

    def stem(self, step: int) -> str:
        """The names of a new save of ``step``: ``ckpt-00000050``, or, if that step has a
        checkpoint already, its next generation (``ckpt-00000050.g1``)."""
        base = f"ckpt-{step:08d}"
        names = _referenced(self.directory / f"{base}.json")
        if not names:
            return base
        match = _FILE.match(names[0])
        generation = int(match.group(2)[2:]) if match and match.group(2) else 0
        return f"{base}.g{generation + 1}"

    def _newest(self) -> str:
        manifests = self.manifests()
        if not manifests:
            return "no earlier checkpoint exists"
        return f"the newest complete one, {self._payload(manifests[-1])}, is intact"

    def _payload(self, manifest: pathlib.Path) -> str:
        names = _referenced(manifest)
        return names[0] if names else manifest.with_suffix(".pt").name

    def remove_incomplete(self) -> list[str]:
        """Delete what a crash mid-save leaves: temp files, and payloads and shards that
        no manifest lists (they cannot be verified, so they are never loaded). Returns
        the names removed."""
        if not self.directory.is_dir():
            return []
        complete = {name for m in self.manifests() for name in _referenced(m)}
        removed = []
        for path in self.directory.iterdir():
            if _TEMP.match(path.name) or _FILE.match(path.name) and path.name not in complete:
                with _suppress():
                    path.unlink()
                    removed.append(path.name)
        return sorted(removed)

    def manifests(self) -> list[pathlib.Path]:
        """Manifest paths, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.directory.iterdir()
                 if (m := _NAME.match(p.name))]
        return [p for _, p in sorted(found)]

    def path_of(self, step: int) -> pathlib.Path:
        """The payload path of ``step``'s checkpoint (its newest generation)."""
        names = _referenced(self.directory / f"ckpt-{step:08d}.json")
        return self.directory / (names[0] if names else f"ckpt-{step:08d}.pt")

    def clear(self, keep: int | None = None) -> int:
        """Remove every checkpoint in the directory but the one of step ``keep`` (a run
        starting over); returns how many."""
        manifests = [m for m in self.manifests() if m.name != f"ckpt-{keep:08d}.json"] \
            if keep is not None else self.manifests()
        for manifest in manifests:
            _remove(manifest)
        return len(manifests)

    def _prune(self) -> None:
        best = f"ckpt-{self.best_step:08d}.json" if self.best_step is not None else None
        for manifest in self.manifests()[:-self.keep]:
            if manifest.name == best:
                continue
            _remove(manifest)

    def load_latest(self) -> tuple[dict, dict] | None:
        """The newest checkpoint's payload and manifest, verified; None if there is none.

        Raises:
          CheckpointError: it is damaged, truncated, unreadable or from another run --
            the message names the file and what is wrong.
        """
        manifests = self.manifests()
        if not manifests:
            return None
        return self.load(manifests[-1], older=len(manifests) - 1)

    def load(self, manifest_path: pathlib.Path, older: int = 0) -> tuple[dict, dict]:
        """Verify and load the checkpoint of ``manifest_path``."""
        advice = (f"; {older} older checkpoint(s) remain in {str(self.directory)!r}: delete "
                  "this one to resume from the previous, or run without --resume"
                  if older else "; run without --resume to start over")
        manifest = self._read_manifest(manifest_path, advice)
        payload_path = manifest_path.with_name(str(manifest.get("file", "")))
        if not payload_path.exists():
            raise CheckpointError(f"checkpoint payload {str(payload_path)!r} is missing"
                                  f"{advice}")
        for entry in manifest.get("files", []):  # a ps's shards: whole, as listed (the ps
            _check_file(manifest_path.with_name(entry["file"]), entry, advice)  # hashes)
        # verified and loaded from one descriptor: the bytes loaded are the bytes hashed
        with open_regular(payload_path, "checkpoint payload", advice) as f:
            self._verify(f, payload_path, manifest, advice)
            self._check_identity(manifest, payload_path)
            f.seek(0)
            try:
                payload = torch.load(f, map_location="cpu", weights_only=True)
            except Exception as exc:  # noqa: BLE001 - any unpickling failure: "damaged"
                raise CheckpointError(f"checkpoint {str(payload_path)!r} cannot be loaded "
                                      f"safely: {type(exc).__name__}: {exc}{advice}") \
                    from None
        if not isinstance(payload, dict) or payload.get("step") != manifest["step"]:
            raise CheckpointError(f"checkpoint {str(payload_path)!r} does not hold step "
                                  f"{manifest['step']} as its manifest says{advice}")
        return payload, manifest

    def _read_manifest(self, path: pathlib.Path, advice: str) -> dict:
        manifest = json_object(path, "checkpoint manifest", MANIFEST_MAX_BYTES, advice)
        missing = {"format", "step", "file", "bytes", "sha256", "identity"} - set(manifest)
        if missing:
            raise CheckpointError(f"checkpoint manifest {str(path)!r} lacks "
                                  f"{', '.join(sorted(missing))}{advice}")
        if manifest["format"] != FORMAT:
            raise CheckpointError(f"checkpoint {str(path)!r} has format "
                                  f"{manifest['format']!r:.40}; this csrun reads format "
                                  f"{FORMAT}")
        wrong = [key for key, ok in _MANIFEST_FIELDS.items() if not ok(manifest[key], path)]
        if "files" in manifest and not _files_ok(manifest["files"], path):
            wrong.append("files")
        if wrong:
            raise CheckpointError(f"checkpoint manifest {str(path)!r} is malformed (bad "
                                  f"{', '.join(wrong)}){advice}")
        return manifest

    def _verify(self, f: BinaryIO, path: pathlib.Path, manifest: dict, advice: str) -> None:
        size = os.fstat(f.fileno()).st_size
        if size != manifest["bytes"]:
            raise CheckpointError(f"checkpoint {str(path)!r} is truncated or damaged: "
                                  f"{size} bytes, its manifest says {manifest['bytes']}"
                                  f"{advice}")
        if file_sha256(f) != manifest["sha256"]:
            raise CheckpointError(f"checkpoint {str(path)!r} is corrupted: its SHA-256 "
                                  f"does not match its manifest{advice}")

    def _check_identity(self, manifest: dict, path: pathlib.Path) -> None:
        saved, current = manifest["identity"], self.identity
        keys = sorted(set(saved) | set(current))
        differ = [f"{k}: checkpoint {_show(saved.get(k))}, now {_show(current.get(k))}"
                  for k in keys if saved.get(k) != current.get(k)]
        if differ:
            shown = "; ".join(differ[:6]) + (f"; and {len(differ) - 6} more"
                                             if len(differ) > 6 else "")
            raise CheckpointError(f"checkpoint {str(path)!r} is from a different run "
                                  f"({shown}); resume with the config it was made with, or "
                                  "use another checkpoint.dir")


def _referenced(manifest: pathlib.Path) -> list[str]:
    """The files ``manifest`` lists (its payload first), as far as it can be read; none
    for an unreadable one (its payload keeps the default name)."""
    try:
        data = json_object(manifest, "checkpoint manifest", MANIFEST_MAX_BYTES)
    except CheckpointError:
        return [manifest.with_suffix(".pt").name] if manifest.exists() else []
    names = [data.get("file")] + [f.get("file") for f in data.get("files", [])
                                  if isinstance(f, dict)] \
        if isinstance(data.get("files", []), list) else [data.get("file")]
    return [n for n in names if isinstance(n, str) and _owned(n, manifest)]


def _owned(name: str, manifest: pathlib.Path) -> bool:
    """Whether ``name`` is one of ``manifest``'s own files (same step; nothing that
    points elsewhere, such as ``../../x``)."""
    match = _FILE.match(name)
    return bool(match) and match.group(1) == manifest.stem


def _remove(manifest: pathlib.Path) -> None:
    names = _referenced(manifest)
    with _suppress():  # the manifest first: a payload alone is never loaded
        manifest.unlink()
    for name in names:
        with _suppress():
            (manifest.parent / name).unlink()


def _check_file(path: pathlib.Path, entry: dict, advice: str) -> None:
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {str(path)!r} is missing{advice}")
    if path.stat().st_size != entry["bytes"]:
        raise CheckpointError(f"checkpoint file {str(path)!r} is truncated or damaged: "
                              f"{path.stat().st_size} bytes, its manifest says "
                              f"{entry['bytes']}{advice}")


def _files_ok(value, path: pathlib.Path) -> bool:
    return isinstance(value, list) and all(
        isinstance(f, dict) and isinstance(f.get("file"), str) and _owned(f["file"], path)
        and f["file"].endswith(".safetensors") and type(f.get("bytes")) is int
        and f["bytes"] >= 0 and isinstance(f.get("sha256"), str)
        and re.fullmatch(r"[0-9a-f]{64}", f["sha256"]) for f in value)


# What each manifest field must be. ``file`` (and each of ``files``) must name the
# manifest's own files: a manifest cannot point elsewhere (``../../x``).
_MANIFEST_FIELDS = {
    "step": lambda v, path: type(v) is int and v >= 0,
    "file": lambda v, path: isinstance(v, str) and _owned(v, path) and v.endswith(".pt"),
    "bytes": lambda v, path: type(v) is int and v >= 0,
    "sha256": lambda v, path: isinstance(v, str) and re.fullmatch(r"[0-9a-f]{64}", v),
    "identity": lambda v, path: isinstance(v, dict),
}


def _show(value: Any) -> str:
    return "(absent)" if value is None else json.dumps(value)
