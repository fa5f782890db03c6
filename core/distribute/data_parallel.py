"""DataParallel: torch's ``nn.DataParallel`` interface over central storage.

``model = DataParallel(model)`` and the user's loop stays the plain loop: the forward
splits the batch over the replicas (:mod:`.scatter_gather`), runs them as one ``run`` of a
:class:`CentralStorageStrategy` held inside, and gathers their outputs on the output
device; the loss is computed on the gathered output, and ``loss.backward()`` runs each
replica's backward as a second run of that strategy, whose end leaves the summed gradient
in the parameters' ``.grad``. Unlike torch's, nothing is copied to replicas on the
parameter device, the replicas run concurrently (not GIL-bound module copies), BatchNorm
normalizes with the whole batch's statistics and dropout draws from per-replica streams:
the strategy's engine does all of that, as for ``strategy.run``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .devices import (DeviceError, LogicalDevice, default_compute_devices,
                      default_parameter_device, parse_device, resolve_device, resolve_devices)
from .scatter_gather import gather, scatter, to_device, whole_batch_loss
from .strategy import CentralStorageStrategy, StrategyOptions

__all__ = ["DataParallel"]


class DataParallel(torch.nn.Module):
    """Split each batch over replicas, gather the outputs: ``torch.nn.DataParallel``'s
    interface, with one set of parameters on the parameter device.

    Args:
      module: the model (it stays ``self.module``; ``state_dict`` keys start with
        ``module.``, as ``nn.DataParallel``'s).
      device_ids: the replicas' devices: TF names (``"CPU:1"``, ``"GPU:0"``), torch
        devices, or ints (CUDA indices, torch's meaning). Default: every local GPU, else
        the CPU (one replica: the module is called as it is). Logical CPUs give several
        replicas on a CPU-only machine.
      output_device: where outputs are gathered. Default: the first replica's device.
      dim: the dimension inputs are split and outputs concatenated along.
      parameter_device: where parameters, buffers and optimizer state live, keyword-only.
        Default: the device the module is on (the CPU for a module without tensors and
        several replicas); a module elsewhere is moved there now (build the optimizer
        after wrapping).
      batch_split: how each batch is split, keyword-only: ``"even"`` (torch's equal
        parts), ``"balanced"`` (in proportion to each replica's measured speed), or
        ``"auto"`` (balanced for replicas on different kinds of device, e.g. a GPU and
        the CPU; else even). See :class:`~.strategy.StrategyOptions`.
      execution: when replicas run at once, keyword-only: ``"auto"`` (the default),
        ``"ordered"`` (one after another, TF's order) or ``"concurrent"``; results are
        the same either way. See :class:`~.strategy.StrategyOptions`.

    Raises:
      TypeError: ``module`` is not a ``torch.nn.Module``, or ``dim`` not an int >= 0.
      ValueError: an unknown ``batch_split`` or ``execution``.
      DeviceError: a device that cannot be parsed, does not exist or repeats, or a module
        whose tensors live on several devices when no ``parameter_device`` is given.

    Example::

        model = csrun.core.DataParallel(model, device_ids=["CPU:0", "CPU:1"])
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
    """

    def __init__(self, module: torch.nn.Module, device_ids: Any = None,
                 output_device: Any = None, dim: int = 0, *, parameter_device: Any = None,
                 batch_split: str = "auto", execution: str = "auto"):
        super().__init__()
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"DataParallel wraps a torch.nn.Module, got "
                            f"{type(module).__name__}")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
            raise TypeError(f"dim must be an int >= 0 (the batch dimension), got {dim!r}")
        compute = default_compute_devices() if device_ids is None else \
            resolve_devices(_spellings(device_ids))
        parameter = _parameter_device(module, parameter_device, compute)
        output = compute[0] if output_device is None else \
            resolve_device(_spelling(output_device))
        self.module = module
        self.dim = dim
        self.device_ids = [d.short_name for d in compute]
        self.output_device = output.torch_device
        self.parameter_device = parameter.torch_device
        self._parameter_name = parameter.short_name
        self._devices = [d.torch_device for d in compute]
        # one replica where the parameters and the output are: the module itself
        self._direct = len(compute) == 1 and \
            self._devices[0] == self.parameter_device == self.output_device
        self._options = StrategyOptions(batch_split=batch_split, execution=execution)
        self._strategy = CentralStorageStrategy(compute, parameter, options=self._options)

    @property
    def strategy(self) -> CentralStorageStrategy:
        """The strategy that runs the replicas (its ``extended`` tells how they ran)."""
        if self._strategy is None:  # a copy's: made at its first use (see __getstate__)
            self._strategy = CentralStorageStrategy(resolve_devices(self.device_ids),
                                                    resolve_device(self._parameter_name),
                                                    options=self._options)
        return self._strategy

    def __getstate__(self) -> dict:
        """What ``copy.deepcopy``, ``pickle`` and ``torch.save`` keep: all but the strategy
        (its threads, locks and weak tables cannot be copied). A copy (an ``AveragedModel``
        for EMA or SWA, a whole model saved) makes a strategy of its own on the same
        devices at its first use; its module is served from its first call in a replica,
        as a module built outside a strategy's scope is (its tensors come back in torch's
        plain dicts)."""
        state = dict(super().__getstate__())
        state["_strategy"] = None
        return state

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's output for the whole batch: the batch split along ``dim``, one
        part per replica, their outputs gathered on ``output_device``.

        Raises:
          ValueError: no tensor input to split, an empty batch, or a tensor without
            ``dim`` (see :func:`~.scatter_gather.scatter`).
        """
        if self._direct:  # as torch's with one device: the module, on the inputs moved
            device = self._devices[0]
            return self.module(*to_device(inputs, device), **to_device(kwargs, device))
        balancer = self.strategy.extended.batch_balancer
        args, replica_kwargs, counts = scatter(
            inputs, kwargs, self._devices, self.dim,
            balancer.sizes if balancer.balanced else None)
        if balancer.balanced:  # timed by the examples split along dim, not dim 0
            balancer.examples_of_next_run(counts)
        extended = self.strategy.extended
        outputs = extended.call_for_each_replica_split(self.module, args, replica_kwargs)
        return gather(outputs, counts, self.output_device, self.dim,
                      lambda pairs: self._backward(pairs, counts),
                      loss_sum=whole_batch_loss(kwargs))

    def _backward(self, pairs: list, counts: list) -> None:
        """Each replica's backward ``pairs[r] = (tensors, grads)``, as one run."""
        extended = self.strategy.extended
        if extended.batch_balancer.balanced:
            extended.batch_balancer.examples_of_next_run(counts)
        extended.call_for_each_replica_split(_replica_backward, pairs, backward=True)

    def extra_repr(self) -> str:
        return (f"device_ids={self.device_ids}, output_device={self.output_device}, "
                f"dim={self.dim}, parameter_device={self.parameter_device}")


def _replica_backward(tensors: list, grads: list) -> None:
    if tensors:
        torch.autograd.backward(tensors, grads)


def _spelling(device: Any) -> Any:
    """torch's int device ids are CUDA indices; other spellings go to the device table."""
    if isinstance(device, bool):
        raise TypeError(f"a device must be a name such as 'CPU:0', got {device!r}")
    return f"GPU:{device}" if isinstance(device, int) else device


def _spellings(device_ids: Any) -> Any:
    if isinstance(device_ids, (str, int, torch.device)):
        raise TypeError(f"device_ids must be a list of devices, got {device_ids!r}; "
                        f"did you mean [{device_ids!r}]?")
    if not isinstance(device_ids, Iterable):
        raise TypeError(f"device_ids must be a list of devices, got "
                        f"{type(device_ids).__name__}")
    return [_spelling(d) for d in device_ids]


def _parameter_device(module: torch.nn.Module, spec: Any,
                      compute: list[LogicalDevice]) -> LogicalDevice:
    """Where the parameters will live (the module is moved there if it is elsewhere)."""
    devices = {t.device for t in (*module.parameters(), *module.buffers())}
    if spec is not None:
        parameter = resolve_device(_spelling(spec))
        if devices and devices != {parameter.torch_device}:
            module.to(parameter.torch_device)
        return parameter
    if len(devices) > 1:
        raise DeviceError(f"the module's tensors live on several devices "
                          f"({sorted(str(d) for d in devices)}); move it to one, or pass "
                          "parameter_device=")
    if devices:
        return resolve_device(parse_device(devices.pop()))
    return default_parameter_device(compute)[0]
