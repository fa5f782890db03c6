"""Bad device arguments.

Golden cases: ``bad_compute_device_nonexistent``, ``bad_compute_device_gpu``,
``bad_compute_device_garbage``, ``bad_compute_devices_duplicate``,
``bad_compute_devices_empty``, ``bad_parameter_device_nonexistent``,
``bad_parameter_device_types``, ``bad_compute_devices_non_string``,
``bad_device_soft_placement_off``.

Intended deviation 4: TF accepts nonexistent devices (silently falling back to CPU:0 with
soft placement, failing later without it), duplicates and empty lists; csrun checks devices
at construction and raises :class:`csrun.core.DeviceError` (a ValueError) naming the device
and listing what is available. ``parameter_device`` given as a list is a TypeError, ``""`` a
DeviceError; ``compute_devices=[1, 2]`` or ``5`` is a TypeError. Logical CPUs default to
``max(8, os.cpu_count())``, so a nonexistent CPU is e.g. ``/cpu:99`` (the golden's ``/cpu:9``
exists here). Later stages of these cases (props, run, dataset, reduce) are then not
reached; ``bad_parameter_device_types`` "compute_None_param_cpu2" is valid and fully pinned.
Soft placement (``bad_device_soft_placement_off``) has no csrun counterpart: the same
devices are refused at construction.
"""

from __future__ import annotations

import re

import pytest
import torch

import csrun.core as cs


def _check_device_error(info, device, available=True):
    err = info.value
    assert isinstance(err, cs.DeviceError) and isinstance(err, ValueError)
    assert device in str(err), str(err)
    if available:
        assert "available" in str(err) and "CPU:0" in str(err), str(err)


def test_bad_compute_device_nonexistent(golden, big_cpu_index):
    assert golden["bad_compute_device_nonexistent"]["outputs"]["construct"]["result"] == "ok"
    bad = f"/cpu:{big_cpu_index}"
    with pytest.raises(cs.DeviceError) as info:
        cs.CentralStorageStrategy(["/cpu:1", bad], "/cpu:0")
    _check_device_error(info, bad)


def test_bad_device_soft_placement_off(golden, big_cpu_index):
    out = golden["bad_device_soft_placement_off"]["outputs"]
    assert out["compute_cpu9"]["run_eager"]["error"]["type"] == "InvalidArgumentError"
    assert out["param_cpu9"]["create_variable"]["error"]["type"] == "InvalidArgumentError"
    bad = f"/cpu:{big_cpu_index}"
    with pytest.raises(cs.DeviceError) as info:
        cs.CentralStorageStrategy(["/cpu:1", bad], "/cpu:0")
    _check_device_error(info, bad)
    with pytest.raises(cs.DeviceError) as info:
        cs.CentralStorageStrategy(["/cpu:1", "/cpu:2"], bad)
    _check_device_error(info, bad)


def _missing_gpu() -> str:
    return f"/gpu:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"


def test_bad_compute_device_gpu(golden):
    assert golden["bad_compute_device_gpu"]["outputs"]["construct"]["result"] == "ok"
    gpu = _missing_gpu()
    with pytest.raises(cs.DeviceError) as info:
        cs.CentralStorageStrategy([gpu], "/cpu:0")
    _check_device_error(info, gpu)
    if not torch.cuda.is_available():
        assert "no GPU" in str(info.value)


@pytest.mark.parametrize("garbage", ["not a device", "/cpu:x"])
def test_bad_compute_device_garbage(garbage, golden):
    rec = golden["bad_compute_device_garbage"]["outputs"][garbage]["construct"]["error"]
    assert rec["type"] == "ValueError"
    with pytest.raises(cs.DeviceError) as info:
        cs.CentralStorageStrategy([garbage], "/cpu:0")
    _check_device_error(info, garbage, available=False)


@pytest.mark.parametrize("key,devices", [("dup", ["/cpu:1", "/cpu:1"]),
                                         ("dup_spelling", ["/cpu:1", "/device:CPU:1"])])
def test_bad_compute_devices_duplicate(key, devices, golden):
    out = golden["bad_compute_devices_duplicate"]["outputs"][key]
    assert out["construct"]["result"] == "ok"
    assert out["props"]["worker_devices"]["result"] == \
        ["/job:localhost/replica:0/task:0/device:CPU:1"] * 2
    with pytest.raises(cs.DeviceError) as info:
        cs.CentralStorageStrategy(devices, "/cpu:0")
    message = str(info.value)
    assert all(repr(d) in message for d in devices), message  # names both spellings
    # deviation 4: the error names the device and lists what is available
    _check_device_error(info, "CPU:1")


@pytest.mark.parametrize("key,param", [("with_param", "/cpu:0"), ("no_param", None)])
def test_bad_compute_devices_empty(key, param, golden):
    out = golden["bad_compute_devices_empty"]["outputs"][key]
    assert out["props"]["num_replicas_in_sync"]["result"] == 0
    assert out["run_eager"]["error"]["type"] == "IndexError"
    with pytest.raises(cs.DeviceError) as info:
        cs.CentralStorageStrategy([], param)
    assert re.search(r"empty", str(info.value))
    _check_device_error(info, "compute_devices")


def test_bad_parameter_device_nonexistent(golden, big_cpu_index):
    out = golden["bad_parameter_device_nonexistent"]["outputs"]
    assert out["/cpu:9"]["construct"]["result"] == out["/gpu:0"]["construct"]["result"] == "ok"
    bad = f"/cpu:{big_cpu_index}"
    with pytest.raises(cs.DeviceError) as info:
        cs.CentralStorageStrategy(["/cpu:1", "/cpu:2"], bad)
    _check_device_error(info, bad)
    gpu = _missing_gpu()
    with pytest.raises(cs.DeviceError) as info:
        cs.CentralStorageStrategy(["/cpu:1", "/cpu:2"], gpu)
    _check_device_error(info, gpu)


def test_bad_parameter_device_list_is_type_error(golden):
    out = golden["bad_parameter_device_types"]["outputs"]["list"]
    assert out["create_variable"]["error"]["type"] == "ValueError"
    with pytest.raises(TypeError, match="parameter_device") as info:
        cs.CentralStorageStrategy(["/cpu:1", "/cpu:2"], ["/cpu:0"])
    assert "list" in str(info.value)


def test_bad_parameter_device_empty_string(golden):
    assert golden["bad_parameter_device_types"]["outputs"]["empty_string"]["construct"][
        "result"] == "ok"
    with pytest.raises(cs.DeviceError, match="empty"):
        cs.CentralStorageStrategy(["/cpu:1", "/cpu:2"], "")


def test_compute_none_parameter_cpu2(golden, expect_golden):
    out = golden["bad_parameter_device_types"]["outputs"]["compute_None_param_cpu2"]
    s = cs.CentralStorageStrategy(None, "/cpu:2")
    assert s.num_replicas_in_sync == out["props"]["num_replicas_in_sync"]["result"]
    if not torch.cuda.is_available():  # recorded on a CPU-only machine
        assert s.extended.worker_devices == out["props"]["worker_devices"]["result"]
    assert s.extended.parameter_devices == tuple(out["props"]["parameter_devices"]["result"])
    with s.scope():
        v = cs.Variable(1.0)
    assert v.device == out["create_variable"]["result"]["device"]
    assert float(v.tensor.detach()) == out["create_variable"]["result"]["value"]
    rid = s.run(lambda: cs.get_replica_context().replica_id_in_sync_group)
    assert list(s.experimental_local_results(rid)) == \
        [r["value"] for r in out["run_eager"]["result"]]
    steps = [list(s.experimental_local_results(x))
             for x in s.experimental_distribute_dataset(list(torch.arange(4).split(2)))]
    expect_golden(steps, out["distribute_dataset"]["result"])
    ones = s.run(lambda: torch.tensor(1.0))
    expect_golden(s.reduce("SUM", ones, axis=None), out["reduce"]["result"])


@pytest.mark.parametrize("key,devices", [("ints", [1, 2]), ("int", 5)])
def test_bad_compute_devices_non_string(key, devices, golden):
    rec = golden["bad_compute_devices_non_string"]["outputs"][key]["construct"]["error"]
    assert rec["type"] in ("AttributeError", "TypeError")
    with pytest.raises(TypeError):
        cs.CentralStorageStrategy(devices, "/cpu:0")


def test_logical_cpu_count_can_be_raised(big_cpu_index):
    bad = f"CPU:{big_cpu_index}"
    cs.set_logical_cpu_count(big_cpu_index + 1)
    try:
        s = cs.CentralStorageStrategy(["CPU:1", bad], "CPU:0")
        assert s.extended.worker_devices[1].endswith(bad)
    finally:
        cs.set_logical_cpu_count(None)
    with pytest.raises(cs.DeviceError):
        cs.CentralStorageStrategy(["CPU:1", bad], "CPU:0")
