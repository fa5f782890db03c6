"""Which methods exist, the deprecated/TPU-only/v1 API, enum members.

Golden cases: ``api_availability``, ``tpu_only_methods``, ``make_numpy_dataset_and_v1_apis``,
``cluster_resolver_and_ps_strategies`` (its CentralStorageStrategy part).

Not applicable: ``env_versions`` (TF's environment); TF module paths and namespaces
(``tf.compat.v1...``, ``tf.distribute.CentralStorageStrategy`` missing); the separate TF v1
class ``CentralStorageStrategyV1`` and its graph/session behaviour (csrun has one class; the
v1 methods it offers -- make_dataset_iterator, make_input_fn_iterator, experimental_run,
experimental_make_numpy_dataset -- are pinned on it below); ``StrategyBase`` in the MRO;
``keras_model_fit_css`` (Keras); the TF v1/v2 ``ParameterServerStrategy`` parts of
``cluster_resolver_and_ps_strategies`` (TF's Estimator-only v1 class and the resolver-only
v2 class have no counterpart in the CentralStorageStrategy API under test here).

Intended deviation 8: ``experimental_run_v2`` is a deprecated alias of ``run``;
``experimental_make_numpy_dataset`` works with a DeprecationWarning; TPU-only methods raise
NotImplementedError mentioning TPU; ``update_config_proto`` raises NotImplementedError;
``extended.broadcast_to`` returns a Mirrored; ``extended.non_slot_devices`` returns the
parameter device.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import csrun.core as cs

_DEVIATION_8_PRESENT = {"experimental_run_v2", "experimental_make_numpy_dataset",
                        "experimental_assign_to_logical_device",
                        "experimental_replicate_to_logical_devices",
                        "experimental_split_to_logical_devices"}
_TPU_ONLY = {
    "experimental_assign_to_logical_device": (torch.tensor(1.0), 0),
    "experimental_replicate_to_logical_devices": (torch.tensor(1.0),),
    "experimental_split_to_logical_devices": (torch.tensor([1.0]), [1]),
}


def _rid():
    return cs.get_replica_context().replica_id_in_sync_group


def test_api_availability_strategy_methods(golden, strategy):
    has = golden["api_availability"]["outputs"]["CentralStorageStrategy(v2) has"]
    s = strategy(2)
    for name, present in has.items():
        if present:
            assert hasattr(s, name), name
        else:
            # TF 2.21 removed these from the v2 class; csrun keeps them (deviation 8)
            assert name in _DEVIATION_8_PRESENT, name
            assert hasattr(s, name), name


def test_api_availability_extended_methods(golden, strategy):
    has = golden["api_availability"]["outputs"]["CentralStorageStrategy(v2).extended has"]
    s = strategy(2)
    for name, present in has.items():
        assert hasattr(s.extended, name) is present, name


def test_api_availability_classes_and_enums(golden):
    out = golden["api_availability"]["outputs"]
    assert out["tf.distribute.experimental.CentralStorageStrategy"]["result"].endswith(
        ".CentralStorageStrategy")
    assert issubclass(cs.CentralStorageStrategy, cs.Strategy)
    assert [c.__name__ for c in cs.CentralStorageStrategy.__mro__] == \
        [n for n in out["mro"] if n != "StrategyBase"]
    assert [f"{m.name}={m.value!r}" for m in cs.ReduceOp] == out["ReduceOp members"]
    assert [f"{m.name}={m.value!r}" for m in cs.VariableAggregation] == \
        out["VariableAggregation members"]
    assert [f"{m.name}={m.value!r}" for m in cs.InputReplicationMode] == \
        out["InputReplicationMode members"]


@pytest.mark.parametrize("name", sorted(_TPU_ONLY))
def test_tpu_only_methods_raise_not_implemented(name, golden, strategy):
    assert golden["tpu_only_methods"]["outputs"][name]["error"]["type"] == "AttributeError"
    s = strategy(2)
    with pytest.raises(NotImplementedError, match="TPU"):
        getattr(s, name)(*_TPU_ONLY[name])


def test_experimental_run_v2_is_deprecated_alias(golden, strategy):
    assert golden["tpu_only_methods"]["outputs"]["experimental_run_v2"]["error"]["type"] == \
        "AttributeError"
    s = strategy(2)
    with pytest.warns(DeprecationWarning, match="experimental_run_v2"):
        out = s.experimental_run_v2(_rid)
    assert list(s.experimental_local_results(out)) == [0, 1]


def test_unwrap_group_configure(golden, strategy):
    out = golden["tpu_only_methods"]["outputs"]
    s = strategy(2)
    result = s.run(_rid)
    assert list(s.unwrap(result)) == [v["value"] for v in out["unwrap"]["result"]]
    assert out["group"]["result"] == "None" and s.group(result) is None
    assert out["configure"]["result"] == "None" and s.configure() is None


def test_update_config_proto_not_implemented(golden, strategy):
    assert "isolate_session_state" in golden["tpu_only_methods"]["outputs"][
        "update_config_proto"]["result"]
    with pytest.raises(NotImplementedError):
        strategy(2).update_config_proto(object())


def test_extended_run_steps_on_iterator_not_implemented(golden, strategy):
    rec = golden["tpu_only_methods"]["outputs"]["extended.experimental_run_steps_on_iterator"]
    assert rec["error"]["type"] == "NotImplementedError"
    with pytest.raises(NotImplementedError):
        strategy(2).extended.experimental_run_steps_on_iterator(lambda: None, iter([]))


def test_extended_non_slot_devices_is_parameter_device(golden, strategy):
    assert golden["tpu_only_methods"]["outputs"]["extended.non_slot_devices"]["error"]
    s = strategy(2)
    assert s.extended.non_slot_devices([]) == (s.extended.parameter_device.name,) == \
        ("/job:localhost/replica:0/task:0/device:CPU:0",)


def test_extended_broadcast_to_returns_mirrored(golden, strategy):
    assert golden["tpu_only_methods"]["outputs"]["extended.broadcast_to"]["error"]
    s = strategy(3)
    t = torch.tensor([1.0, 2.0])
    got = s.extended.broadcast_to(t, destinations=None)
    assert isinstance(got, cs.Mirrored) and len(got.values) == 3
    assert all(v.tolist() == [1.0, 2.0] and v is not t for v in got.values)
    assert [v.device for v in got.values] == s.extended.torch_devices


def test_make_numpy_dataset(golden, strategy):
    out = golden["make_numpy_dataset_and_v1_apis"]["outputs"]
    s = strategy(2)
    # TF: extended.experimental_make_numpy_dataset gives a TensorSliceDataset of int64 scalars
    assert "TensorSliceDataset" in out["v2_extended_experimental_make_numpy_dataset"]["result"]
    ds = s.extended.experimental_make_numpy_dataset(np.arange(6))
    assert [int(ds[i]) for i in range(len(ds))] == out["v1_experimental_make_numpy_dataset"][
        "result"]["elements"]
    assert ds[0].dtype == torch.int64 and ds[0].dim() == 0
    # deviation 8: the strategy method works, with a DeprecationWarning
    assert out["v2_experimental_make_numpy_dataset"]["error"]["type"] == "AttributeError"
    with pytest.warns(DeprecationWarning):
        ds2 = s.experimental_make_numpy_dataset({"a": np.arange(6), "b": np.ones((6, 2))})
    assert isinstance(ds2, torch.utils.data.Dataset) and len(ds2) == 6
    assert ds2[2]["a"].item() == 2 and ds2[2]["b"].tolist() == [1.0, 1.0]


def test_v1_apis(golden, strategy, expect_golden):
    out = golden["make_numpy_dataset_and_v1_apis"]["outputs"]
    s = strategy(2)
    assert s.num_replicas_in_sync == out["v1_num_replicas_in_sync"]
    assert list(s.experimental_local_results(s.run(_rid))) == \
        [v["value"] for v in out["v1_run_eager"]["result"]]
    batches = list(torch.arange(5).split(4))
    steps = [list(s.experimental_local_results(x))
             for x in s.experimental_distribute_dataset(batches)]
    expect_golden(steps, out["v1_experimental_distribute_dataset"]["result"])

    iterator = s.make_dataset_iterator(batches)
    assert iterator.initialize() == []
    got = [list(s.experimental_local_results(iterator.get_next())) for _ in range(2)]
    expect_golden(got, out["v1_experimental_distribute_dataset"]["result"])
    with pytest.raises(StopIteration):
        iterator.get_next()

    contexts = []
    it = s.make_input_fn_iterator(lambda ctx: contexts.append(ctx) or list(
        torch.arange(4).split(1)))
    it.initialize()
    assert [str(c).split("InputContext", 1)[1] for c in contexts] == \
        [c.split("InputContext", 1)[1] for c in out["v1_make_input_fn_iterator"]["result"]["ctxs"]]
    with s.scope():
        got = s.experimental_run(lambda b: b + 0, it)
    assert [t.tolist() for t in s.experimental_local_results(got)] == [[0], [1]]

    with s.scope():
        v = cs.Variable(1.0)
    assert v.device == out["v1_variable"]["device"]


def test_every_golden_case_is_accounted_for(golden):
    """Each recorded case id is named in a test module of this suite (pinned, or listed
    there as not applicable with the reason); the 120 ``dist_ds_range*`` ids are generated
    in test_golden_dataset.py."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    text = "".join(p.read_text() for p in sorted(here.glob("test_*.py")))
    generated = re.compile(r"dist_ds_range\d+_batch\d+_R\d(_drop)?")
    missing = [cid for cid in golden if cid != "__meta__" and cid not in text
               and not generated.fullmatch(cid)]
    assert not missing, f"golden cases not covered by any test module: {missing}"
