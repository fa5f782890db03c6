"""The index of a checkpoint by shard: which file holds which rows of which variable,
with its optimizer slots, and each worker's applied steps. The chief keeps it in its own
checkpoint payload (``payload["ps"]``); each ps task reads only the files, and the rows
in them, that its shards of the job's plan (:mod:`.plan`) need, however many ps tasks
and shards wrote them.

The index is checked before any ps reads a byte, as strictly as the manifest: every
variable's entries must cover its rows exactly once, with the shape and dtype the model
has; every count must be a whole number in range. A problem names the checkpoint file
and the field (``ps.files.1.shards.0.rows``).
"""

from __future__ import annotations

from .plan import ShardingPlan

__all__ = ["FORMAT", "build_index", "check_index", "CheckpointIndexError", "sources_for"]

FORMAT = "shards-1"


class CheckpointIndexError(ValueError):
    """A checkpoint's index that cannot be what csrun wrote for this model."""


def build_index(records: list[dict], plan: ShardingPlan, dtypes: list[str],
                steps: dict[str, int]) -> dict:
    """The index of one save: the ps tasks' ``records`` (:meth:`.shards.HeldShards.save`),
    the plan's variables, and every worker's applied steps."""
    return {"format": FORMAT,
            "variables": [{"shape": list(shape), "dtype": dtype}
                          for shape, dtype in zip(plan.shapes, dtypes)],
            "files": [{k: r[k] for k in ("file", "sha256", "ps", "shards")} for r in records],
            "steps": dict(steps), "version": max((r["version"] for r in records), default=0)}


def _count(value, field: str, path: str) -> int:
    if type(value) is not int or value < 0:
        raise CheckpointIndexError(f"checkpoint {path!r}: ps.{field} is {value!r:.60}, not a whole "
                          "number of at least 0")
    return value


def check_index(index, plan: ShardingPlan, dtypes: list[str], workers: list[str],
                listed: list[dict], path: str) -> None:
    """Refuse an index that does not fit the model (``plan``, ``dtypes``) and the job
    (``workers``), or names files its manifest does not list (``listed``)."""
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointIndexError(f"checkpoint {path!r}: ps.format is not {FORMAT!r}")
    variables, files = index.get("variables"), index.get("files")
    if not isinstance(variables, list) or not isinstance(files, list):
        raise CheckpointIndexError(f"checkpoint {path!r}: ps.variables and ps.files must be lists")
    _check_variables(variables, plan, dtypes, path)
    sha = {f.get("file"): f.get("sha256") for f in listed}
    covered: list[list[tuple[int, int, str]]] = [[] for _ in variables]
    for i, entry in enumerate(files):
        where = f"files.{i}"
        if not isinstance(entry, dict) or sha.get(entry.get("file")) != entry.get("sha256") \
                or not isinstance(entry.get("shards"), list):
            raise CheckpointIndexError(f"checkpoint {path!r}: ps.{where} names a file its manifest "
                              "does not list (or with another SHA-256)")
        for j, shard in enumerate(entry["shards"]):
            _check_shard(shard, f"{where}.shards.{j}", variables, path, covered)
    for var, pieces in enumerate(covered):
        _check_covered(var, sorted(pieces), variables[var]["shape"], path)
    steps = index.get("steps")
    if not isinstance(steps, dict):
        raise CheckpointIndexError(f"checkpoint {path!r}: ps.steps is not a mapping of workers")
    for task, value in steps.items():
        if task not in workers and not (isinstance(task, str) and task.count(":") == 1):
            raise CheckpointIndexError(f"checkpoint {path!r}: ps.steps names {task!r:.40}, "
                                       "not a task")
        _count(value, f"steps.{task}", path)
    _count(index.get("version"), "version", path)


def _check_variables(variables: list, plan: ShardingPlan, dtypes: list[str],
                     path: str) -> None:
    if len(variables) != len(plan.shapes):
        raise CheckpointIndexError(f"checkpoint {path!r}: ps.variables holds {len(variables)} "
                          f"variables, the model has {len(plan.shapes)}")
    for var, (saved, shape, dtype) in enumerate(zip(variables, plan.shapes, dtypes)):
        if not isinstance(saved, dict) or saved.get("shape") != list(shape) \
                or saved.get("dtype") != dtype:
            raise CheckpointIndexError(f"checkpoint {path!r}: ps.variables.{var} is "
                              f"{_shown(saved)}, the model's is {dtype} {list(shape)}")


def _shown(saved) -> str:
    if isinstance(saved, dict):
        return f"{saved.get('dtype')} {saved.get('shape')}"
    return repr(saved)[:60]


def _check_shard(shard, where: str, variables: list, path: str, covered: list) -> None:
    if not isinstance(shard, dict) or not isinstance(shard.get("key"), str) or \
            not isinstance(shard.get("slots"), dict):
        raise CheckpointIndexError(f"checkpoint {path!r}: ps.{where} is malformed")
    var = _count(shard.get("var"), f"{where}.var", path)
    if var >= len(variables):
        raise CheckpointIndexError(f"checkpoint {path!r}: ps.{where}.var is {var}; the model has "
                          f"{len(variables)} variables")
    start = _count(shard.get("start"), f"{where}.start", path)
    rows = _count(shard.get("rows"), f"{where}.rows", path)
    shape = variables[var]["shape"]
    expected = [rows, *shape[1:]] if shape else []
    if shard.get("shape") != expected or shard.get("dtype") != variables[var]["dtype"]:
        raise CheckpointIndexError(f"checkpoint {path!r}: ps.{where} is {shard.get('dtype')} "
                          f"{shard.get('shape')}, not {rows} rows of variable {var}")
    covered[var].append((start, start + rows, where))


def _check_covered(var: int, pieces: list, shape: list, path: str) -> None:
    """The saved shards of a variable hold each of its rows exactly once."""
    rows, at = (shape[0] if shape else 1), 0
    for start, stop, where in pieces:
        if start != at:
            raise CheckpointIndexError(
                f"checkpoint {path!r}: ps.{where}.start is {start}; variable {var}'s rows "
                f"{at}..{start - 1} are in no shard" if start > at else
                f"checkpoint {path!r}: ps.{where} holds rows {start}..{stop - 1} of "
                f"variable {var} again")
        at = stop
    if at != rows:
        raise CheckpointIndexError(f"checkpoint {path!r}: ps.files hold {at} of variable {var}'s "
                          f"{rows} rows")


def sources_for(index: dict, plan: ShardingPlan, num_ps: int) -> list[list[dict]]:
    """For each ps of ``plan``, the saved files (with only their entries) that hold rows
    of its shards: all it reads."""
    wanted = [{(s.var) for s in held} for held in plan.by_ps(num_ps)]
    out: list[list[dict]] = [[] for _ in range(num_ps)]
    for k in range(num_ps):
        for entry in index["files"]:
            shards = [s for s in entry["shards"] if s["var"] in wanted[k]]
            if shards:
                out[k].append({"file": entry["file"], "sha256": entry["sha256"],
                               "shards": shards})
    return out
