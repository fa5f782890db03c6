"""TF parity, the eight left by round 3 (issue 39): each pinned to what TF 2.21 does, or
to csrun's documented deviation (docs/tf-parity.md).

What TF does was recorded by running TF 2.21 (tensorflow-cpu) on
``CentralStorageStrategy(["/cpu:1", "/cpu:2"], "/cpu:0")`` and read in its sources:
``StrategyExtendedV2.colocate_vars_with`` and ``distribute_utils.validate_colocate``,
``ParameterServerStrategyExtended._select_single_value`` (which takes a PerReplica's
first component), ``ReplicaContext.merge_call`` of the default replica context and
``require_replica_context``, ``validate_synchronization_aggregation_trainable``, and
``tf.nn.compute_average_loss`` (``nn_impl_distribute.py``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import csrun.core as cs


def _strategy():
    return cs.CentralStorageStrategy(["CPU:1", "CPU:2"], "CPU:0")


# -- colocate_vars_with: a variable of this strategy, inside its scope --------------------
@pytest.mark.parametrize("target", ["another strategy's", "plain", "a tensor"])
def test_colocate_vars_with_refuses_what_is_not_a_variable_of_this_strategy(target):
    s, other = _strategy(), _strategy()
    with other.scope():
        theirs = cs.Variable(1.0)
    var = {"another strategy's": theirs, "plain": cs.Variable(2.0),
           "a tensor": torch.tensor(1.0)}[target]
    with s.scope():
        for colocate in (s.colocate_vars_with, s.extended.colocate_vars_with):
            with pytest.raises(ValueError, match="`colocate_vars_with` must only be passed "
                               "a variable created in this strategy's scope"):
                colocate(var)


def test_colocate_vars_with_takes_its_own_variables_inside_its_scope():
    s = _strategy()
    with s.scope():
        mine, layer = cs.Variable(3.0), torch.nn.Linear(2, 1)
        for target in (mine, layer.weight):
            with s.extended.colocate_vars_with(target):
                made = cs.Variable(4.0)
            assert made.device == mine.device
    with pytest.raises(RuntimeError, match="needs to be inside `with strategy.scope\\(\\)`"):
        s.extended.colocate_vars_with(mine)  # TF: "Need to be inside ... scope()"


# -- extended.update with a PerReplica ---------------------------------------------------
def test_update_with_a_per_replica_of_equal_values_applies_it_once_as_tf():
    s = _strategy()
    with s.scope():
        v = cs.Variable(10.0)
    same = s.run(lambda: torch.tensor(2.0))  # a PerReplica: 2.0 on each replica
    s.extended.update(v, lambda var, x: var.assign_add(x), args=(same,))
    assert float(v) == 12.0  # TF: 12.0
    s.run(lambda: s.extended.update(v, lambda var, x: var.assign_add(x),
                                    args=(torch.tensor(3.0),)))
    assert float(v) == 15.0


@pytest.mark.parametrize("where", ["cross-replica", "replica"])
def test_update_with_differing_per_replica_values_is_refused_where_tf_takes_the_first(
        where):
    """Deviation: TF 2.21 adds replica 0's 1.0 and drops replica 1's 2.0 (10 -> 11)."""
    s = _strategy()
    with s.scope():
        v = cs.Variable(10.0)
    add = (lambda var, x: var.assign_add(x))
    with pytest.raises(ValueError, match="PerReplica whose 2 components differ.*TF would "
                       "take the first replica's"):
        if where == "cross-replica":
            per_replica = s.experimental_distribute_values_from_function(
                lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group + 1)))
            s.extended.update(v, add, args=(per_replica,))
        else:
            s.run(lambda: s.extended.update(v, add, args=(torch.tensor(float(
                cs.get_replica_context().replica_id_in_sync_group + 1)),)))
    assert float(v) == 10.0


# -- run inside merge_fn -----------------------------------------------------------------
def test_run_inside_merge_fn_is_refused_saying_so():
    """Deviation: TF runs fn again on every replica while they wait in merge_call."""
    s = _strategy()
    with pytest.raises(RuntimeError, match="strategy.run cannot be nested.*merge_fn"):
        s.run(lambda: cs.get_replica_context().merge_call(lambda st: st.run(lambda: 1.0)))
    # what to do instead: merge_fn works on the PerReplica it gets, run comes after
    doubled = s.run(lambda: cs.get_replica_context().merge_call(
        lambda st, x: st.reduce("SUM", x, axis=None), args=(torch.tensor(1.0),)))
    assert float(doubled) == 2.0


# -- the default replica context, from merge_fn ----------------------------------------
def test_merge_fn_of_the_default_replica_context_is_cross_replica_as_in_tf():
    default = cs.get_replica_context()
    seen = {}

    def merge_fn(strategy, x):
        seen.update(context=cs.get_replica_context(), cross=cs.in_cross_replica_context(),
                    has=cs.has_strategy(), default=strategy is cs.get_strategy(),
                    reduced=float(strategy.reduce("SUM", x, axis=None)),
                    ran=strategy.run(lambda: cs.get_replica_context() is default))
        for method in ("all_reduce", "merge_call"):
            call = (lambda: default.all_reduce("SUM", x)) if method == "all_reduce" else \
                (lambda: default.merge_call(lambda st: 7))
            with pytest.raises(RuntimeError, match="Need to be inside "
                               "`call_for_each_replica\\(\\)`"):
                call()
        return x * 2
    assert float(default.merge_call(merge_fn, args=(torch.tensor(2.0),))) == 4.0
    # TF: None, True, False, the default strategy, 2.0; its run is in the default context
    assert seen == {"context": None, "cross": True, "has": False, "default": True,
                    "reduced": 2.0, "ran": True}
    assert cs.get_replica_context() is default and not cs.in_cross_replica_context()


def test_the_default_replica_context_refuses_collectives_in_a_strategys_merge_fn():
    s, default = _strategy(), cs.get_replica_context()
    refused = []

    def merge_fn(strategy):
        for call in (lambda: default.all_reduce("SUM", torch.tensor(1.0)),
                     lambda: default.merge_call(lambda st: 7)):
            try:
                call()
            except RuntimeError as exc:
                refused.append("call_for_each_replica" in str(exc))
        return 0
    s.run(lambda: cs.get_replica_context().merge_call(merge_fn))
    assert refused == [True, True]  # TF: RuntimeError for both
    with s.scope(), pytest.raises(RuntimeError, match="call_for_each_replica"):
        default.all_reduce("SUM", torch.tensor(1.0))


# -- synchronization (and aggregation) as TF's int --------------------------------------
@pytest.mark.parametrize("number, member, trainable", [
    (0, "AUTO", True), (1, "NONE", True), (2, "ON_WRITE", True), (3, "ON_READ", False)])
def test_synchronization_is_taken_as_its_number_as_in_tf(number, member, trainable):
    with _strategy().scope():
        v = cs.Variable(1.0, synchronization=number)
    assert v.synchronization is cs.VariableSynchronization[member]
    assert v.trainable is trainable  # TF: ON_READ makes a variable not trainable


@pytest.mark.parametrize("kind, value", [("synchronization", 4), ("synchronization", True),
                                         ("aggregation", 4), ("aggregation", -1)])
def test_a_number_out_of_the_enum_is_refused_as_in_tf(kind, value):
    with pytest.raises(ValueError, match=f"Invalid variable {kind} mode: {value}"):
        cs.Variable(1.0, **{kind: value})


# -- compute_average_loss's global_batch_size and dtype ---------------------------------
LOSSES = torch.tensor([1.0, 2.0, 3.0, 4.0])


@pytest.mark.parametrize("size, error, said", [
    (2.5, TypeError, "must be an integer"), (4.0, TypeError, "must be an integer"),
    (True, TypeError, "must be an integer"), (False, TypeError, "must be an integer"),
    ("4", TypeError, "must be an integer"), (np.float32(4.0), TypeError, "must be an integer"),
    (torch.tensor(4.0), TypeError, "must be an integer"),
    (torch.tensor([4]), ValueError, "must be scalar"), ([4], ValueError, "must be scalar"),
    (-4, ValueError, "must be non-negative")])
def test_global_batch_size_is_checked_as_in_tf(size, error, said):
    with pytest.raises(error, match=f"global_batch_size {said}"):
        cs.compute_average_loss(LOSSES, global_batch_size=size)


@pytest.mark.parametrize("size, expected", [
    (0, 0.0), (8, 1.25), (np.int64(4), 2.5), (torch.tensor(4), 2.5),
    (torch.tensor(8, dtype=torch.int64), 1.25)])
def test_global_batch_size_forms_tf_takes(size, expected):
    assert float(cs.compute_average_loss(LOSSES, global_batch_size=size)) == expected


@pytest.mark.parametrize("dtype, expected", [
    (torch.int32, torch.float64), (torch.int64, torch.float64),
    (torch.float16, torch.float16), (torch.bfloat16, torch.bfloat16),
    (torch.float64, torch.float64), (torch.float32, torch.float32)])
def test_the_result_has_tfs_dtype(dtype, expected):
    losses = torch.tensor([1, 2, 3, 5], dtype=dtype)
    for weight in (None, torch.tensor([1, 1, 2, 2], dtype=dtype), 0.5):
        result = cs.compute_average_loss(losses, sample_weight=weight, global_batch_size=4)
        assert result.dtype == expected
    assert float(cs.compute_average_loss(losses, global_batch_size=4)) == 2.75  # TF: 2.75


def test_integer_losses_in_replicas_average_in_float64():
    s = _strategy()
    out = s.run(lambda: cs.compute_average_loss(torch.tensor([1, 2, 3], dtype=torch.int32)))
    assert [(float(t), t.dtype) for t in s.experimental_local_results(out)] == \
        [(1.0, torch.float64)] * 2  # TF: 1.0 (float64) on each replica


def test_integer_losses_weighed_by_a_fraction_are_not_truncated():
    """Deviation: TF casts the weighted losses back to int32 ([0, 1, 1, 2]: 1.0)."""
    losses = torch.tensor([1, 2, 3, 5], dtype=torch.int32)
    assert float(cs.compute_average_loss(losses, sample_weight=0.5,
                                         global_batch_size=4)) == 1.375
