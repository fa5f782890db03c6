"""The ``strategy`` section's devices on this machine: each parses, exists here, and no
compute device repeats; how many replicas the section makes; the environment variable
that says how many logical CPUs there are."""

from __future__ import annotations

from ...config.problems import Problem
from ...distribute.devices import (DeviceError, LogicalDevice, default_compute_devices,
                                   logical_cpu_count, resolve_device)

__all__ = ["check_devices", "check_environment", "replica_count", "compute_devices", "gib",
           "ENVIRONMENT_ORIGIN"]

ENVIRONMENT_ORIGIN = "environment"  # a problem's origin: ``environment CSRUN_LOGICAL_CPUS``


def check_environment() -> list[Problem]:
    """``CSRUN_LOGICAL_CPUS``, which every device check reads: a problem naming it when it
    is not a count csrun accepts (then no device can be checked)."""
    try:
        logical_cpu_count()
    except DeviceError as exc:
        return [Problem("", exc.message, exc.hint,
                        origin=f"{ENVIRONMENT_ORIGIN} CSRUN_LOGICAL_CPUS")]
    return []


def replica_count(strategy) -> int:
    """How many replicas the ``strategy`` section makes (TF's default when omitted)."""
    if strategy.compute_devices is None:
        return len(default_compute_devices())
    return len(strategy.compute_devices)


def compute_devices(strategy) -> list[LogicalDevice] | None:
    """The section's compute devices (TF's default when omitted); None when one does not
    resolve (:func:`check_devices` reports it)."""
    try:
        return [resolve_device(d) for d in strategy.compute_devices] \
            if strategy.compute_devices else default_compute_devices()
    except (DeviceError, ValueError):
        return None


def check_devices(strategy) -> list[Problem]:
    """Each device parses, exists here, and no compute device repeats."""
    problems, seen = [], {}
    for i, spec in enumerate(strategy.compute_devices or []):
        field = f"strategy.compute_devices.{i}"
        device = _device(spec, field, problems)
        if device is not None and device in seen:
            problems.append(Problem(field, f"{spec!r} repeats compute device "
                                    f"{seen[device]!r}", "each replica needs its own "
                                    "device (logical CPUs CPU:0, CPU:1, ... are distinct)"))
        seen.setdefault(device, spec)
    if strategy.compute_devices == []:
        problems.append(Problem("strategy.compute_devices", "is empty",
                                "list at least one device, or remove the key for TF's "
                                "default"))
    if strategy.parameter_device is not None:
        _device(strategy.parameter_device, "strategy.parameter_device", problems)
    return problems


def _device(spec: str, field: str, problems: list[Problem]):
    try:
        return resolve_device(spec)
    except DeviceError as exc:
        problems.append(Problem(field, exc.message, exc.hint))
    except ValueError:  # the parser's int() of a digit that is not ASCII ('replica:²')
        problems.append(Problem(field, f"cannot parse device {spec!r}", "use forms like "
                                "'CPU:0', '/gpu:1', '/job:localhost/replica:0/task:0/"
                                "device:CPU:0', 'cuda:1'"))
    return None


def gib(count: int) -> str:
    """A byte count as the memory sizes in messages show it."""
    return f"{count / 2**30:,.1f} GiB"
