"""Strategy properties and device handling.

Golden cases: ``props_default_ctor``, ``props_R1``, ``props_R2``, ``props_R3``,
``props_compute_only_1``, ``props_compute_only_2``, ``props_device_string_forms``,
``props_compute_devices_tuple_and_string``.

Not applicable (graph-only TF internals, no csrun equivalent): ``_variable_device``,
``_worker_device(input host)``, ``_cross_device_ops``, ``_cross_device_ops.reduce_to_device``,
``_in_multi_worker_mode``; the TF wrapper class name of ``variable_in_scope.type``
(``ResourceVariable``/``AggregatingVariable``) -- csrun's is :class:`csrun.core.Variable`,
whose device, aggregation and synchronization are pinned below.
"""

from __future__ import annotations

import pytest
import torch

import csrun.core as cs

_BOOL_PROPS = ("experimental_between_graph", "experimental_should_init", "should_checkpoint",
               "should_save_summary", "experimental_require_static_shapes")


def _check_props(s, out):
    assert type(s).__name__ == out["type"]
    assert type(s.extended).__name__ == out["extended_type"]
    assert s.num_replicas_in_sync == out["num_replicas_in_sync"]["result"]
    assert out["cluster_resolver"]["result"] == "None" and s.cluster_resolver is None
    ext = s.extended
    assert ext.worker_devices == out["worker_devices"]["result"]
    assert type(ext.worker_devices).__name__ == out["worker_devices_container_type"]["result"]
    assert ext.parameter_devices == tuple(out["parameter_devices"]["result"])
    assert type(ext.parameter_devices).__name__ == \
        out["parameter_devices_container_type"]["result"]
    assert ext.worker_devices_by_replica == out["worker_devices_by_replica"]["result"]
    for prop in _BOOL_PROPS:
        assert getattr(ext, prop) is out[prop]["result"], prop
    assert out["experimental_enable_get_next_as_optional"]["error"]["type"] == "AttributeError"
    assert not hasattr(ext, "experimental_enable_get_next_as_optional")
    # deviation 12: every logical CPU computes on torch's cpu
    assert ext.torch_devices == [torch.device("cpu")] * s.num_replicas_in_sync
    var = out["variable_in_scope"]["result"]
    with s.scope():
        v = cs.Variable(1.0)
    assert v.device == var["device"]
    assert f"VariableAggregation.{v.aggregation.name}" == var["aggregation"]
    assert f"VariableSynchronization.{v.synchronization.name}" == var["synchronization"]
    assert v.tensor.device == torch.device("cpu")


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_props_RN(num_replicas, golden):
    # Spelled exactly as meta.strategies spells S1..S3: parameter_devices reports the
    # parameter device as given ("/cpu:0").
    s = cs.CentralStorageStrategy([f"/cpu:{i}" for i in range(1, num_replicas + 1)], "/cpu:0")
    _check_props(s, golden[f"props_R{num_replicas}"]["outputs"])


@pytest.mark.parametrize("num_replicas", [1, 2, 3])
def test_golden_strategy_fixture_matches_meta(num_replicas, golden, strategy):
    meta = golden["__meta__"]["strategies"][f"S{num_replicas}"]
    devices = [f"/cpu:{i}" for i in range(1, num_replicas + 1)]
    assert meta == "CSS([" + ",".join(f'"{d}"' for d in devices) + '], "/cpu:0")'
    s = strategy(num_replicas)
    assert s.extended.worker_devices == [cs.canonical_name(d) for d in devices]
    assert s.extended.parameter_device.name == cs.canonical_name("/cpu:0")


def test_props_default_ctor(golden):
    if torch.cuda.is_available():
        pytest.skip("props_default_ctor was recorded on a CPU-only machine; with CUDA the "
                    "default compute devices are the GPUs (see test_default_ctor_with_gpus)")
    _check_props(cs.CentralStorageStrategy(), golden["props_default_ctor"]["outputs"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_default_ctor_with_gpus():
    # TF's documented default: every local GPU computes; the only GPU holds variables,
    # else the CPU does.
    s = cs.CentralStorageStrategy()
    n = torch.cuda.device_count()
    assert s.extended.worker_devices == [
        f"/job:localhost/replica:0/task:0/device:GPU:{i}" for i in range(n)]
    expected_param = ("/job:localhost/replica:0/task:0/device:GPU:0",) if n == 1 \
        else ("/device:CPU:0",)
    assert s.extended.parameter_devices == expected_param


def test_props_compute_only_2(golden):
    s = cs.CentralStorageStrategy(compute_devices=["/cpu:1", "/cpu:2"])
    _check_props(s, golden["props_compute_only_2"]["outputs"])


def test_props_compute_only_1(golden):
    s = cs.CentralStorageStrategy(compute_devices=["/cpu:2"])
    _check_props(s, golden["props_compute_only_1"]["outputs"])


_SPELLINGS = ["cpu:", "/cpu:", "CPU:", "/CPU:", "/device:CPU:", "device:CPU:",
              "/job:localhost/replica:0/task:0/device:CPU:", "/device:cpu:"]


def test_props_device_string_forms_cover_golden(golden):
    assert set(golden["props_device_string_forms"]["outputs"]) == {p + "1" for p in _SPELLINGS}


@pytest.mark.parametrize("prefix", _SPELLINGS)
def test_props_device_string_forms(prefix, golden):
    out = golden["props_device_string_forms"]["outputs"][prefix + "1"]["result"]
    s = cs.CentralStorageStrategy([prefix + "1", prefix + "2"], prefix + "1")
    assert s.extended.worker_devices == out["worker_devices"]
    # TF reports the parameter device spelled as it was given
    assert s.extended.parameter_devices == tuple(out["parameter_devices"])


def test_props_compute_devices_tuple(golden):
    out = golden["props_compute_devices_tuple_and_string"]["outputs"]
    s = cs.CentralStorageStrategy(("/cpu:1", "/cpu:2"), "/cpu:0")
    assert s.extended.worker_devices == out["tuple"]["result"]


def test_props_compute_devices_bare_string_is_type_error(golden):
    # Intended deviation 4 (props_compute_devices_tuple_and_string): TF fails with
    # ValueError("Unknown attribute 'c' ...") by iterating the string's characters; csrun
    # raises a TypeError that suggests a list.
    out = golden["props_compute_devices_tuple_and_string"]["outputs"]
    assert out["bare_string"]["error"]["type"] == "ValueError"
    with pytest.raises(TypeError, match=r"list") as info:
        cs.CentralStorageStrategy("/cpu:1", "/cpu:0")
    assert "['/cpu:1']" in str(info.value)


def test_torch_spellings_and_torch_device_are_accepted():
    s = cs.CentralStorageStrategy(["cpu:1", torch.device("cpu")], "cpu")
    assert s.extended.worker_devices == ["/job:localhost/replica:0/task:0/device:CPU:1",
                                         "/job:localhost/replica:0/task:0/device:CPU:0"]


def test_canonical_name_and_repr():
    assert cs.canonical_name("/cpu:3") == "/job:localhost/replica:0/task:0/device:CPU:3"
    assert cs.canonical_name("device:GPU:1") == "/job:localhost/replica:0/task:0/device:GPU:1"
    s = cs.CentralStorageStrategy(["CPU:1", "CPU:2"], "CPU:0")
    assert repr(s) == ("CentralStorageStrategy(compute_devices=['CPU:1', 'CPU:2'], "
                       "parameter_device='CPU:0')")
