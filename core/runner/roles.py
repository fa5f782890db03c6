"""This process's part in a job, the one seam where a central-storage run and a
parameter-server worker differ.

A :class:`~csrun.core.runner.session.Session` holds a :class:`Role` (torchtitan's habit: a
part the session holds, not a subclass) and asks it at those points only:
:class:`LocalRole` is the whole job in this process; ``ClusterRole``
(:mod:`csrun.core.runner.cluster_role`) is one worker of a parameter-server job.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from ..config.schema import RunConfig
from ..distribute import CentralStorageStrategy, StrategyOptions
from .events import RunResult

__all__ = ["Role", "LocalRole"]


class Role(Protocol):
    """This process's part in the job, asked by its session where the parts differ."""

    strategy: Any          # the strategy the session trains with
    is_chief: bool         # writes and restores the checkpoints, evaluates the holdout
    sliced: bool           # one worker of several: it reads only its share of the input
    parameter_device: str  # where the parameters live, as RunStarted names it

    def state_dict(self) -> dict:
        """Entries to add to a checkpoint being written."""

    def load_state_dict(self, payload: dict) -> None:
        """Take them from a checkpoint being restored (ValueError: it has none)."""

    def begin(self, where: dict, optimizer: torch.optim.Optimizer) -> dict:
        """Before the first step: where training starts, from this process's ``where``
        (``step``, ``epoch``, ``position``)."""

    def logged(self) -> None:
        """After each :class:`StepLog`."""

    def settle(self) -> None:
        """After the last step, before the last checkpoint."""

    def checkpointed(self, model: torch.nn.Module) -> Any:
        """What goes into a checkpoint as the model (its ``state_dict``)."""

    def unsaved(self) -> bool:
        """After :meth:`settle`: whether the job's state changed since this process's
        last checkpoint beyond what its own step shows (another worker's updates): then
        the last checkpoint is written again."""

    def end(self, result: RunResult, model: torch.nn.Module) -> RunResult:
        """The result to report; this process's part of the job is over."""


class LocalRole:
    """The whole job in this process: the config's CentralStorageStrategy, its own chief;
    nothing to agree on with anyone (see :class:`Role`)."""

    is_chief, sliced = True, False

    def __init__(self, config: RunConfig):
        s = config.strategy
        self.strategy = CentralStorageStrategy(
            s.compute_devices, s.parameter_device,
            options=StrategyOptions(copy_parameters=s.copy_parameters, execution=s.execution,
                                    batch_split=s.batch_split,
                                    bytes_per_pack=s.bytes_per_pack))
        self.parameter_device = self.strategy.extended.parameter_device.short_name

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, payload: dict) -> None:
        pass

    def begin(self, where: dict, optimizer: torch.optim.Optimizer) -> dict:
        return where

    def logged(self) -> None:
        pass

    def settle(self) -> None:
        pass

    def unsaved(self) -> bool:
        return False

    def checkpointed(self, model: torch.nn.Module):
        return model

    def end(self, result: RunResult, model: torch.nn.Module) -> RunResult:
        return result
