"""TensorFlow's checks that csrun skipped, returning something instead (issue 24).

Each test is what TF 2.21 does (its ``tf.distribute`` sources and API pages: the
``tf.distribute.experimental.CentralStorageStrategy`` page for ``reduce`` and ``scope``,
``tf.distribute.StrategyExtended`` for ``reduce_to``, ``update`` and ``group``,
``tf.distribute.ReplicaContext`` for ``merge_call``, ``tf.nn.compute_average_loss``).
"""

from __future__ import annotations

import threading

import pytest
import torch

import csrun.core as cs
from csrun.core.distribute.input import ValueContext


def _strategy(n=2, **options):
    return cs.CentralStorageStrategy([f"CPU:{i}" for i in range(1, n + 1)], "CPU:0",
                                     options=cs.StrategyOptions(**options))


def _per_replica(strategy, values):
    return strategy.experimental_distribute_values_from_function(
        lambda ctx: values[ctx.replica_id_in_sync_group])


# -- reduce along an axis: only that axis's size may differ ----------------------------
@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_reduce_along_an_axis_refuses_replicas_that_differ_elsewhere(op):
    # the page: "specify an axis so that the resulting shape is consistent across
    # replicas"; TF adds the partial sums with AddN, which does not broadcast
    s = _strategy(2)
    value = _per_replica(s, [torch.ones(1, 3), torch.ones(2, 3)])
    with pytest.raises(ValueError, match="axis=1.*replica 0: \\(1, 3\\), replica 1: \\(2, 3\\)"):
        s.reduce(op, value, axis=1)
    ragged = _per_replica(s, [torch.ones(1, 3), torch.ones(2, 3)])  # along axis 0: fine
    assert s.reduce("SUM", ragged, axis=0).tolist() == [3.0, 3.0, 3.0]


# -- compute_average_loss: a [B, 1] weight weighs [B] -----------------------------------
def test_compute_average_loss_squeezes_a_trailing_weight_dimension():
    loss, weight = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([[1.0], [0.0], [2.0], [1.0]])
    got = cs.compute_average_loss(loss, sample_weight=weight, global_batch_size=8)
    assert got.shape == () and got.item() == pytest.approx((1 + 6 + 4) / 8)
    s = _strategy(2)
    out = s.run(lambda l, w: cs.compute_average_loss(l, sample_weight=w),
                args=(_per_replica(s, [loss[:2], loss[2:]]),
                      _per_replica(s, [weight[:2], weight[2:]])))
    assert s.reduce("SUM", out, axis=None).item() == pytest.approx((1 + 6 + 4) / 4)


@pytest.mark.parametrize("shape", [(4, 2), (4, 1, 1), (2,)])
def test_compute_average_loss_refuses_weights_that_do_not_fit(shape):
    with pytest.raises(ValueError, match="sample_weight of shape"):
        cs.compute_average_loss(torch.ones(4), sample_weight=torch.ones(shape),
                                global_batch_size=4)


# -- extended.reduce_to of a value that is not distributed ------------------------------
def test_reduce_to_of_a_plain_value_is_tfs_non_distributed_reduction():
    s = _strategy(2)
    value = torch.tensor([1.0, 2.0])
    with pytest.raises(ValueError, match="cannot be reduced with SUM across 2 replicas"):
        s.extended.reduce_to("SUM", value, "/cpu:0")
    with pytest.raises(ValueError, match="cannot be reduced with SUM"):
        s.extended.batch_reduce_to("SUM", [(value, "/cpu:0")])
    assert s.extended.reduce_to("MEAN", value, "/cpu:0") is value  # TF returns it as is
    zeros = torch.zeros(2)
    assert s.extended.reduce_to("SUM", zeros, "/cpu:0") is zeros
    one = _strategy(1)  # one replica: the value itself, on the destination
    assert one.extended.reduce_to("SUM", value, "/cpu:0").tolist() == [1.0, 2.0]


# -- cross-replica methods: not in a replica, not in another strategy's scope ------------
@pytest.mark.parametrize("method", ["reduce_to", "batch_reduce_to"])
def test_reduce_to_inside_run_is_refused(method):
    s = _strategy(2)

    def fn():
        x = torch.ones(1)
        if method == "reduce_to":
            return s.extended.reduce_to("SUM", x, "/cpu:0")
        return s.extended.batch_reduce_to("SUM", [(x, "/cpu:0")])
    with pytest.raises(RuntimeError, match=f"extended.{method} requires being in "
                                           "cross-replica context"):
        s.run(fn)


def test_reduce_to_in_merge_call_reduces_every_replica():
    s = _strategy(2)

    def fn():
        ctx = cs.get_replica_context()
        x = torch.tensor([float(ctx.replica_id_in_sync_group + 1)])
        return ctx.merge_call(lambda strategy, v: strategy.extended.reduce_to("SUM", v, v),
                              args=(x,))
    assert [t.tolist() for t in s.experimental_local_results(s.run(fn))] == [[3.0], [3.0]]


@pytest.mark.parametrize("where", ["scope", "run"])
def test_reduce_and_gather_of_another_strategy_are_refused(where):
    first, second = _strategy(2), _strategy(2)
    value = _per_replica(first, [torch.ones(1), torch.ones(1)])
    calls = {"reduce": lambda: first.reduce("SUM", value, axis=None),
             "gather": lambda: first.gather(value, axis=0),
             "reduce_to": lambda: first.extended.reduce_to("SUM", value, "/cpu:0")}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="Mixing different strategies"):
            if where == "scope":
                with second.scope():
                    call()
            else:
                second.run(call)
    assert first.reduce("SUM", value, axis=None).tolist() == [2.0]  # outside: fine


def test_scope_entered_inside_run_is_refused():
    s = _strategy(2)

    def fn():
        with s.scope():
            pass
    with pytest.raises(RuntimeError, match="strategy.scope\\(\\) requires being in "
                                           "cross-replica context"):
        s.run(fn)

    def merged():  # merge_fn is cross-replica: entering the scope there is fine
        return cs.get_replica_context().merge_call(lambda strategy: _entered(strategy))
    assert s.run(merged) is True


def _entered(strategy) -> bool:
    with strategy.scope():
        return cs.in_cross_replica_context()


# -- extended.update ----------------------------------------------------------------------
def test_update_of_something_that_is_not_a_variable_is_refused():
    s = _strategy(2)
    with s.scope():
        v = cs.Variable(1.0)
        layer = torch.nn.BatchNorm1d(2)
    for var in (torch.tensor(1.0), 3.0):
        with pytest.raises(ValueError, match="must be a variable"):
            s.extended.update(var, lambda t: t)
    s.extended.update(v, lambda var, d: var.assign_add(d), args=(1.0,))
    s.extended.update(layer.weight, lambda w: w.add_(1.0))
    s.extended.update(layer.running_mean, lambda m: m.fill_(3.0))
    assert float(v) == 2.0 and layer.weight.tolist() == [2.0, 2.0]
    assert layer.running_mean.tolist() == [3.0, 3.0]


def test_update_in_replica_context_merges_into_one_update():
    # TF 2.21: StrategyExtended.update in a replica context goes through merge_call
    s = _strategy(2)
    with s.scope():
        v = cs.Variable(10.0)
    calls = []

    def add(var, d):
        calls.append(cs.in_cross_replica_context())
        return var.assign_add(d)
    delta = torch.tensor(2.0)  # the same object on every replica: one value
    out = s.run(lambda: s.extended.update(v, add, args=(delta,)))
    assert float(v) == 12.0 and calls == [True]
    assert out is v

    with pytest.raises(ValueError, match="PerReplica whose 2 components differ"):
        s.run(lambda: s.extended.update(
            v, add, args=(torch.tensor(float(cs.get_replica_context()
                                             .replica_id_in_sync_group)),)))
    assert float(v) == 12.0


def test_update_with_group_false_returns_local_results():
    s = _strategy(2)
    with s.scope():
        v = cs.Variable(1.0)
    assert s.extended.update(v, lambda var: var.assign_add(1.0), group=False) == (v,)
    pair = s.extended.update(v, lambda var: (var.value() * 1, 5), group=False)
    assert isinstance(pair, tuple) and pair[1] == (5,) and float(pair[0][0]) == 2.0
    assert s.extended.update_non_slot(v, lambda: 7, group=False) == (7,)
    assert s.extended.update_non_slot(v, lambda: 7) == 7


# -- Variables: the mean of integers ----------------------------------------------------------
def test_an_integer_variable_with_mean_aggregation_refuses_replica_updates():
    s = _strategy(2)
    with s.scope():
        count = cs.Variable(torch.tensor(10), aggregation="MEAN")
    with pytest.raises(ValueError, match="with MEAN aggregation in replica context"):
        s.run(lambda: count.assign_add(torch.tensor(
            cs.get_replica_context().replica_id_in_sync_group)))
    assert int(count) == 10
    one = torch.tensor(1)  # the same object everywhere: no mean to take (TF returns it)
    s.run(lambda: count.assign_add(one))
    assert int(count) == 11


def test_an_integer_variable_refuses_a_fraction():
    with _strategy(2).scope():
        count = cs.Variable(torch.tensor(3))
    with pytest.raises(TypeError, match="not a whole number"):
        count.assign(2.5)
    count.assign_add(2.0)  # a whole number casts without loss
    assert int(count) == 5


# -- the default strategy ----------------------------------------------------------------------
def test_the_default_strategys_values_from_function_returns_the_value():
    default = cs.get_strategy()
    seen = []
    value = torch.tensor([1.0])
    result = default.experimental_distribute_values_from_function(
        lambda ctx: seen.append(ctx) or value)
    assert result is value and isinstance(seen[0], ValueContext)
    assert (seen[0].replica_id_in_sync_group, seen[0].num_replicas_in_sync) == (0, 1)


# -- merge_call and collectives: on the replica's own thread -----------------------------------
@pytest.mark.parametrize("call", ["merge_call", "all_reduce", "all_gather"])
@pytest.mark.parametrize("execution", ["ordered", "concurrent"])
def test_a_collective_from_another_thread_is_refused(call, execution):
    s = _strategy(2, execution=execution)
    errors = []

    def from_a_thread(ctx):
        try:
            if call == "merge_call":
                ctx.merge_call(lambda strategy: None)
            elif call == "all_reduce":
                ctx.all_reduce("SUM", torch.ones(1))
            else:
                ctx.all_gather(torch.ones(1), axis=0)
        except RuntimeError as exc:
            errors.append(str(exc))

    def fn():
        thread = threading.Thread(target=from_a_thread, args=(cs.get_replica_context(),),
                                  daemon=True)
        thread.start()
        thread.join(10)  # it used to wait forever
        return thread.is_alive()
    assert s.run(fn) is False  # the thread ended (same object from both replicas)
    assert len(errors) == 2 and all(f"{call} of replica" in e and "outside that replica" in e
                                    for e in errors)


def test_merge_call_inside_merge_fn_still_says_so():
    s = _strategy(2)

    def fn():
        ctx = cs.get_replica_context()
        return ctx.merge_call(lambda strategy: ctx.merge_call(lambda _: None))
    with pytest.raises(RuntimeError, match="cannot be called inside merge_call's merge_fn"):
        s.run(fn)
