"""The ps tasks' state as whole variables, whatever their sharding, and back.

A checkpoint holds each variable whole (its shards joined along dim 0) with its
optimizer slots joined the same way (Adagrad's ``sum``, Adam's moments: any slot shaped
like the variable); per-variable scalars (a step count) are the same in every shard and
kept once. So a job resumes with another shard count or ps count, and checkpoints of
one model are alike however it was partitioned.

    whole = whole_state(per_ps_states, layout)       # the chief, saving
    per_ps = split_state(whole, layout, per_ps_now)  # the chief, restoring
"""

from __future__ import annotations

import torch

from .plan import ShardingPlan

__all__ = ["whole_state", "split_state", "FORMAT"]

FORMAT = "whole-variables"


def whole_state(states: list[dict], layout: ShardingPlan) -> dict:
    """Join every ps's ``state_dict`` (values by shard, optimizer state by its own
    parameter index, ``order``: the shard of each index) into whole variables."""
    values: dict[int, list] = {}
    slots: dict[int, list] = {}
    groups: dict[int, dict] = {}
    shard_of = {s.id: s for s in layout.shards}
    for state in states:
        for shard_id, value in state["values"].items():
            values.setdefault(shard_of[int(shard_id)].var, []).append(
                (shard_of[int(shard_id)].start, value))
        optimizer = state.get("optimizer")
        if not optimizer:
            continue
        for index, slot in optimizer["state"].items():
            shard = shard_of[state["order"][int(index)]]
            slots.setdefault(shard.var, []).append((shard, slot))
        for group, job_index in zip(optimizer["param_groups"], state.get("groups", [])):
            groups.setdefault(job_index, {k: v for k, v in group.items() if k != "params"})
    variables = {var: _join([v for _, v in sorted(pieces, key=lambda p: p[0])])
                 for var, pieces in values.items()}
    return {"format": FORMAT, "variables": variables,
            "slots": {var: _join_slots(pieces, layout.shards_of(var), variables[var])
                      for var, pieces in slots.items()},
            "groups": groups, "version": max(int(s.get("version", 0)) for s in states)}


def _join(pieces: list[torch.Tensor]) -> torch.Tensor:
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _join_slots(pieces: list, shards: list, whole: torch.Tensor) -> dict:
    """A variable's optimizer slots, whole: row slots joined in shard order (a shard that
    never stepped contributes zeros), the others taken from the first shard."""
    by_start = {shard.start: slot for shard, slot in pieces}
    first = pieces[0][1]
    joined = {}
    for name, value in first.items():
        if isinstance(value, torch.Tensor) and value.dim() and \
                value.shape[1:] == whole.shape[1:] and len(shards) > 1:
            joined[name] = torch.cat([
                by_start[s.start][name] if s.start in by_start
                else torch.zeros((s.rows, *whole.shape[1:]), dtype=value.dtype)
                for s in shards])
        else:
            joined[name] = value
    return joined


def split_state(whole: dict, layout: ShardingPlan, current: list[dict]) -> list[dict]:
    """Each ps's ``state_dict`` to load, from :func:`whole_state`'s ``whole``;
    ``current``: each ps's state now (its optimizer's parameter order and groups)."""
    out = []
    shard_of = {s.id: s for s in layout.shards}
    for now in current:
        values = {i: _rows(whole["variables"][shard_of[int(i)].var], shard_of[int(i)])
                  for i in now["values"]}
        optimizer = now.get("optimizer")
        if optimizer is not None:
            state = {}
            for index, shard_id in enumerate(now["order"]):
                shard = shard_of[shard_id]
                slots = whole["slots"].get(shard.var)
                if slots:
                    shape = whole["variables"][shard.var].shape
                    state[index] = {k: _rows(v, shard) if _is_rows(v, shape) else v
                                    for k, v in slots.items()}
            saved = whole.get("groups", {})
            groups = [{**g, **saved.get(job, {}), "params": g["params"]}
                      for g, job in zip(optimizer["param_groups"], now.get("groups", []))]
            optimizer = {"state": state, "param_groups": groups}
        out.append({"values": values, "optimizer": optimizer,
                    "version": whole.get("version", 0)})
    return out


def _is_rows(value, shape: torch.Size) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == shape


def _rows(value: torch.Tensor, shard) -> torch.Tensor:
    return value[shard.start:shard.stop].clone() if value.dim() else value.clone()
