"""Device names: parsing, canonical TF names, discovery and TF's default placement.

csrun accepts TensorFlow spellings (``"CPU:0"``, ``"/cpu:1"``, ``"/device:GPU:0"``,
``"/job:localhost/replica:0/task:0/device:CPU:1"``) and torch spellings (``"cpu"``,
``"cuda:1"``, :class:`torch.device`). Every device resolves to a :class:`LogicalDevice`
that knows its canonical TF name and the :class:`torch.device` that holds its tensors.

Logical CPU devices (``CPU:0``, ``CPU:1``, ...) are distinct replicas that all compute on
the host CPU, as TensorFlow's virtual CPUs do. ``torch.device("cpu:1")`` forgets its index,
so the strategy keeps its own replica -> device table built from these objects.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from typing import Iterable, Sequence

import torch

__all__ = [
    "LogicalDevice",
    "DeviceError",
    "canonical_name",
    "resolve_device",
    "resolve_devices",
    "logical_cpu_count",
    "set_logical_cpu_count",
    "MAX_LOGICAL_CPUS",
    "local_devices",
    "default_compute_devices",
    "default_parameter_device",
]

_LOCAL_PREFIX = "/job:localhost/replica:0/task:0"
_ENV_LOGICAL_CPUS = "CSRUN_LOGICAL_CPUS"
# Each logical CPU is a replica with a thread of its own, and a row of inspect-devices:
# far beyond what a host computes with, and small enough that listing them stays quick.
MAX_LOGICAL_CPUS = 4096
_logical_cpus_override: int | None = None


class DeviceError(ValueError):
    """A device that cannot be parsed, does not exist here, or repeats another.

    Attributes:
      message: what is wrong.
      hint: what exists instead (``"available: CPU:0..CPU:7 ..."``), or None.

    ``str(exc)`` is ``"<message>; <hint>"`` (TF-parity tests compare it); callers that
    show the two apart read the fields rather than split the text.
    """

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(f"{message}; {hint}" if hint else message)
        self.message = message
        self.hint = hint

    def __reduce__(self):  # pickles with both fields, not the joined text
        return type(self), (self.message, self.hint)


@dataclasses.dataclass(frozen=True)
class LogicalDevice:
    """One device of the replica table.

    Attributes:
      kind: ``"CPU"`` or ``"GPU"``.
      index: the logical index (``CPU:3`` -> 3, ``GPU:1`` -> 1).
      job, task: the cluster task that owns the device (``localhost``/0 on one machine).
    """

    kind: str
    index: int
    job: str = "localhost"
    task: int = 0

    @property
    def name(self) -> str:
        """TF's canonical full name, e.g. ``/job:localhost/replica:0/task:0/device:CPU:1``."""
        return f"/job:{self.job}/replica:0/task:{self.task}/device:{self.kind}:{self.index}"

    @property
    def short_name(self) -> str:
        """The short TF spelling, e.g. ``CPU:1``."""
        return f"{self.kind}:{self.index}"

    @functools.cached_property
    def torch_device(self) -> torch.device:
        """Where tensors of this device live: the host CPU for every logical CPU."""
        if self.kind == "GPU":
            return torch.device("cuda", self.index)
        return torch.device("cpu")

    @property
    def is_gpu(self) -> bool:
        return self.kind == "GPU"

    def __str__(self) -> str:  # pragma: no cover - repr helper
        return self.name


def logical_cpu_count() -> int:
    """How many logical CPU devices exist (``CPU:0`` .. ``CPU:n-1``).

    TensorFlow needs virtual CPUs configured explicitly; csrun offers
    ``max(8, os.cpu_count())`` unless ``set_logical_cpu_count`` or the
    ``CSRUN_LOGICAL_CPUS`` environment variable says otherwise.

    Raises:
      DeviceError: ``CSRUN_LOGICAL_CPUS`` is not a whole number in 1..MAX_LOGICAL_CPUS.
    """
    if _logical_cpus_override is not None:
        return _logical_cpus_override
    env = os.environ.get(_ENV_LOGICAL_CPUS)
    if env:
        hint = f"set {_ENV_LOGICAL_CPUS} to a count of 1..{MAX_LOGICAL_CPUS}, or unset it"
        text = env.strip()
        if not (text.isascii() and text.isdigit()):  # also bounds int()'s work
            raise DeviceError(f"{_ENV_LOGICAL_CPUS}={env[:40]!r} is not a whole number",
                              hint)
        value = int(text[:12])  # longer is over the bound anyway
        if not 1 <= value <= MAX_LOGICAL_CPUS or len(text) > 12:
            raise DeviceError(f"{_ENV_LOGICAL_CPUS}={env[:40]!r} is not in "
                              f"1..{MAX_LOGICAL_CPUS}", hint)
        return value
    return max(8, os.cpu_count() or 1)


def set_logical_cpu_count(count: int | None) -> None:
    """Set how many logical CPU devices exist; ``None`` restores the default."""
    global _logical_cpus_override
    if count is not None and (not isinstance(count, int) or not 1 <= count <= MAX_LOGICAL_CPUS):
        raise DeviceError(f"logical CPU count must be an int in 1..{MAX_LOGICAL_CPUS}, "
                          f"got {count!r}")
    _logical_cpus_override = count


def _gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _available_hint() -> str:
    cpus = logical_cpu_count()
    hint = f"available: CPU:0..CPU:{cpus - 1} (logical CPUs"
    hint += f"; raise with {_ENV_LOGICAL_CPUS} or csrun.core.set_logical_cpu_count)"
    gpus = _gpu_count()
    hint += f", GPU:0..GPU:{gpus - 1}" if gpus else ", no GPU"
    return hint


_TYPE_INDEX = re.compile(r"^(cpu|gpu|cuda)(?::(\d+|\*))?$", re.IGNORECASE)
_KEYED = re.compile(r"^(job|replica|task):(.*)$", re.IGNORECASE)


def _parse_part(part: str, fields: dict, spec: str) -> None:
    """Parse one ``/``-separated part of a device string into ``fields``."""
    low = part.lower()
    if low.startswith("device:"):
        part = part[len("device:"):]
        low = part.lower()
    keyed = _KEYED.match(part)
    if keyed:
        key, value = keyed.group(1).lower(), keyed.group(2)
        if key == "job":
            if not value:
                raise DeviceError(f"empty job name in device {spec!r}")
            fields["job"] = value
        else:
            if not value.isdigit():
                raise DeviceError(f"{key} in device {spec!r} must be a number, got {value!r}")
            fields[key] = int(value)
        return
    typed = _TYPE_INDEX.match(part)
    if not typed:
        raise DeviceError(
            f"cannot parse device {spec!r}: {part!r} is not a device type "
            "(expected forms like 'CPU:0', '/gpu:1', '/device:GPU:0', 'cuda:1', 'cpu')"
        )
    kind = "CPU" if typed.group(1).lower() == "cpu" else "GPU"
    index = typed.group(2)
    if index == "*":
        raise DeviceError(f"device {spec!r} names no single device ('*'); give an index")
    fields["kind"] = kind
    fields["index"] = int(index) if index is not None else 0


def parse_device(spec: object) -> LogicalDevice:
    """Parse a device spelling into a :class:`LogicalDevice` without checking it exists.

    Raises:
      TypeError: ``spec`` is neither a string nor a :class:`torch.device`.
      DeviceError: the string cannot be parsed.
    """
    if isinstance(spec, LogicalDevice):
        return spec
    if isinstance(spec, torch.device):
        if spec.type == "cpu":
            return LogicalDevice("CPU", 0)
        if spec.type == "cuda":
            return LogicalDevice("GPU", spec.index if spec.index is not None else 0)
        raise DeviceError(f"device type {spec.type!r} is not supported (CPU and CUDA GPUs are)")
    if not isinstance(spec, str):
        raise TypeError(
            f"a device must be a string such as 'CPU:0' or a torch.device, "
            f"got {type(spec).__name__} {spec!r}"
        )
    text = spec.strip()
    if not text:
        raise DeviceError("empty device name ''; use e.g. 'CPU:0' or 'GPU:0'")
    fields: dict = {}
    for part in text.strip("/").split("/"):
        if not part:
            raise DeviceError(f"cannot parse device {spec!r}: empty part between '/'")
        _parse_part(part, fields, spec)
    if "kind" not in fields:
        raise DeviceError(f"device {spec!r} names no device type; add e.g. '/device:CPU:0'")
    if fields.get("replica", 0) != 0:
        raise DeviceError(f"device {spec!r}: only replica:0 exists (TF's in-graph replica)")
    return LogicalDevice(fields["kind"], fields["index"], fields.get("job", "localhost"),
                         fields.get("task", 0))


def canonical_name(spec: object) -> str:
    """TF's canonical full name of a device spelling (no existence check)."""
    return parse_device(spec).name


def _check_exists(device: LogicalDevice, spec: object) -> None:
    if device.job != "localhost" or device.task != 0:
        raise DeviceError(
            f"device {spec!r} belongs to task /job:{device.job}/task:{device.task}; "
            "a CentralStorageStrategy uses local devices only (use ParameterServerStrategy "
            "for a cluster)"
        )
    if device.kind == "CPU" and device.index >= logical_cpu_count():
        raise DeviceError(f"device {spec!r} does not exist", _available_hint())
    if device.kind == "GPU" and device.index >= _gpu_count():
        raise DeviceError(f"device {spec!r} is not here", _available_hint())


def resolve_device(spec: object) -> LogicalDevice:
    """Parse ``spec`` and make sure the device exists on this machine."""
    try:
        device = parse_device(spec)
    except DeviceError as exc:
        raise DeviceError(str(exc), _available_hint()) from None
    _check_exists(device, spec)
    return device


def resolve_devices(specs: object) -> list[LogicalDevice]:
    """Resolve a list of compute device spellings; refuse empty lists and duplicates.

    A bare string is refused (TF fails on it too, by iterating its characters).
    """
    if isinstance(specs, (str, torch.device)):
        raise TypeError(f"compute_devices must be a list of device names, got the single device "
                        f"{specs!r}; did you mean [{str(specs)!r}]?")
    if not isinstance(specs, Iterable):
        raise TypeError(f"compute_devices must be a list of device names, got "
                        f"{type(specs).__name__} {specs!r}")
    specs = list(specs)
    if not specs:
        raise DeviceError("compute_devices is empty; give at least one device", _available_hint())
    devices = [resolve_device(s) for s in specs]
    seen: dict[LogicalDevice, object] = {}
    for spec, device in zip(specs, devices):
        if device in seen:
            raise DeviceError(
                f"compute_devices lists {device.short_name} twice ({seen[device]!r} and {spec!r}); "
                "each replica needs its own device", _available_hint())
        seen[device] = spec
    return devices


def default_compute_devices() -> list[LogicalDevice]:
    """TF's default: every local GPU, else the CPU."""
    gpus = _gpu_count()
    if gpus:
        return [LogicalDevice("GPU", i) for i in range(gpus)]
    return [LogicalDevice("CPU", 0)]


def default_parameter_device(compute: Sequence[LogicalDevice]) -> tuple[LogicalDevice, str]:
    """TF's default parameter device and the spelling TF reports for it.

    The only compute device when there is one (reported by its full name), else the
    CPU (reported as ``/device:CPU:0``).
    """
    if len(compute) == 1:
        return compute[0], compute[0].name
    return LogicalDevice("CPU", 0), "/device:CPU:0"


def local_devices() -> list[dict]:
    """Every local device with what is known of it, for ``csrun inspect-devices``."""
    rows = []
    cpu_count = os.cpu_count() or 1
    for i in range(logical_cpu_count()):
        rows.append({
            "name": f"/job:localhost/replica:0/task:0/device:CPU:{i}",
            "short_name": f"CPU:{i}",
            "torch": "cpu",
            "kind": "CPU",
            "logical": True,
            "physical_cores": cpu_count,
            "memory_bytes": _host_memory_bytes(),
        })
    for i in range(_gpu_count()):
        props = torch.cuda.get_device_properties(i)
        rows.append({
            "name": f"/job:localhost/replica:0/task:0/device:GPU:{i}",
            "short_name": f"GPU:{i}",
            "torch": f"cuda:{i}",
            "kind": "GPU",
            "logical": False,
            "model": props.name,
            "capability": f"{props.major}.{props.minor}",
            "memory_bytes": int(props.total_memory),
            "multiprocessors": int(props.multi_processor_count),
        })
    return rows


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return None
