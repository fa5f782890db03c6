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
