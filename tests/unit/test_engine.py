"""Engine behaviour beyond TF's recorded cases: threads, errors, gradients, buffers, input."""

import collections
import gc
import pickle
import threading
import time
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

import csrun.core as cs
from tests.helpers.replica_training import train_bits


def _strategy(n=2, **options):
    return cs.CentralStorageStrategy([f"CPU:{i}" for i in range(n)], "CPU:0",
                                     options=cs.StrategyOptions(**options))


def _rid():
    return cs.get_replica_context().replica_id_in_sync_group


# -- execution ----------------------------------------------------------------------------
@pytest.mark.timeout(30)
def test_concurrent_mode_runs_replicas_at_once():
    strategy = _strategy(3, execution="concurrent")
    barrier = threading.Barrier(3, timeout=10)
    results = strategy.run(lambda: (barrier.wait(), _rid())[1])  # passes only if concurrent
    assert strategy.experimental_local_results(results) == (0, 1, 2)


def test_rendezvous_lock_exists_before_any_worker_starts():
    # Regression: replicas racing to make the lazily built Condition each got their own
    # lock and waited forever (seen once in CI's soak run, BatchNorm all_reduce).
    from csrun.core.distribute.replica_run import ReplicaRun

    seen = []

    class Executor:
        def submit(self, replica_id, task):
            seen.append((run._cond is not None, run._collectives is not None))
            task()

    # nor two Collectives made at once
    run = ReplicaRun(3, True, lambda run, r: r, Executor(), make_collectives=lambda r: object())
    assert run.execute() == [0, 1, 2] and seen == [(True, True), (True, True)]


@pytest.mark.slow  # 3000 rounds: a stress test
@pytest.mark.timeout(120)
def test_concurrent_rendezvous_never_deadlocks_under_stress():
    strategy = _strategy(2, execution="concurrent")
    one = torch.ones(4)
    for _ in range(3000):
        out = strategy.run(lambda: cs.get_replica_context().all_reduce("SUM", one))
        assert float(strategy.experimental_local_results(out)[1][0]) == 2.0


def test_ordered_mode_keeps_tf_order_across_rendezvous():
    strategy = _strategy(3)
    order = []

    def fn():
        order.append(("before", _rid()))
        cs.get_replica_context().all_reduce("SUM", torch.tensor(1.0))
        order.append(("after", _rid()))
    strategy.run(fn)
    assert order == [("before", r) for r in range(3)] + [("after", r) for r in range(3)]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("execution", ["ordered", "concurrent"])
def test_error_names_replica_and_device_and_nothing_hangs(execution):
    strategy = _strategy(3, execution=execution)

    def fn():
        ctx = cs.get_replica_context()
        if ctx.replica_id_in_sync_group == 1:
            raise KeyError("boom")
        ctx.all_reduce("SUM", torch.tensor(1.0))  # the others wait here, then are aborted
        return 1
    with pytest.raises(KeyError) as info:
        strategy.run(fn)
    assert info.value.csrun_replica_id == 1
    assert info.value.csrun_device == "/job:localhost/replica:0/task:0/device:CPU:1"
    assert "replica 1 on /job:localhost/replica:0/task:0/device:CPU:1" in info.value.__notes__[0]
    # The strategy is still usable and its workers are idle, not stuck.
    assert strategy.experimental_local_results(strategy.run(lambda: 7)) == (7,)
    assert strategy.reduce("SUM", strategy.run(
        lambda: cs.get_replica_context().all_reduce("SUM", torch.tensor(1.0))), axis=None) == 9


def test_worker_threads_end_with_their_strategy():
    before = threading.active_count()
    for _ in range(5):
        strategy = _strategy(3)
        strategy.run(lambda: cs.get_replica_context().all_reduce("SUM", torch.tensor(1.0)))
        assert strategy.extended._executor.num_threads == 2
        del strategy
    gc.collect()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


def test_a_collected_strategy_does_not_wait_for_a_busy_worker():
    """Its workers are stopped from a finalizer, at any moment of the main thread's work:
    a wait there would swallow a Ctrl-C that lands in it (Python ignores exceptions in
    finalizers), as a full test run showed. A worker still in a task ends after it."""
    from csrun.core.distribute.replica_run import ReplicaExecutor
    executor, released, stopped = ReplicaExecutor("test"), threading.Event(), threading.Event()
    executor.submit(1, released.wait)  # a worker busy until the end of the test
    threading.Thread(target=lambda: (executor.shutdown(), stopped.set()), daemon=True).start()
    try:
        assert stopped.wait(3), "shutdown waited for a busy worker"  # (it once did, 5 s)
        assert executor.num_threads == 0
    finally:
        released.set()


def test_workers_inherit_grad_mode_of_the_caller():
    strategy = _strategy(2)

    def fn():
        cs.get_replica_context().all_reduce("SUM", torch.tensor(1.0))  # forces worker threads
        return [_rid(), torch.is_grad_enabled()]
    with torch.no_grad():
        assert strategy.experimental_local_results(strategy.run(fn)) == ([0, False], [1, False])
    assert strategy.experimental_local_results(strategy.run(fn)) == ([0, True], [1, True])

    def leaky():  # turns grad off for good on whichever thread runs it
        cs.get_replica_context().all_reduce("SUM", torch.tensor(1.0))
        torch.set_grad_enabled(False)
    try:
        strategy.run(leaky)
    finally:
        torch.set_grad_enabled(True)  # replica 0 ran on this thread
    assert strategy.experimental_local_results(strategy.run(fn)) == ([0, True], [1, True])


@pytest.mark.parametrize("execution", ["ordered", "concurrent"])
def test_autocast_a_replica_leaves_on_does_not_reach_the_next_run(execution):
    strategy = _strategy(2, execution=execution)
    w = torch.randn(4, 4)

    def leaky(x):
        cs.get_replica_context().all_reduce("SUM", torch.tensor(1.0))  # forces worker threads
        torch.autocast("cpu", dtype=torch.bfloat16).__enter__()        # never exited
        return (x @ w).dtype

    def check(x):
        cs.get_replica_context().all_reduce("SUM", torch.tensor(1.0))
        return [_rid(), (x @ w).dtype]
    try:
        strategy.run(leaky, args=(torch.randn(4, 4),))
    finally:
        _leave_autocast()  # replica 0 leaked it on this thread
    assert strategy.experimental_local_results(strategy.run(check, args=(torch.randn(4, 4),))) \
        == ([0, torch.float32], [1, torch.float32])


def _leave_autocast():
    torch.set_autocast_enabled("cpu", False)
    while torch.autocast_decrement_nesting() > 0:
        pass
    torch.clear_autocast_cache()


@pytest.mark.parametrize("execution", ["ordered", "concurrent"])
def test_an_autocast_a_replica_leaked_leaves_no_stale_casts(execution):
    # Its thread's autocast nesting stayed up, so later autocasts there kept their cast
    # of w from before the update: the second run computed with the old weights.
    strategy = _strategy(2, execution=execution)
    w = torch.ones(4, 4, requires_grad=True)  # autocast caches casts of such leaves

    def leaky():
        cs.get_replica_context().all_reduce("SUM", torch.tensor(1.0))  # forces worker threads
        torch.autocast("cpu", dtype=torch.bfloat16).__enter__()        # never exited

    def product(x):
        cs.get_replica_context().all_reduce("SUM", torch.tensor(1.0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return (x @ w).float().sum()
    try:
        strategy.run(leaky)
    finally:
        _leave_autocast()
    x = torch.ones(1, 4)
    assert [float(v) for v in strategy.experimental_local_results(
        strategy.run(product, args=(x,)))] == [16.0, 16.0]
    with torch.no_grad():
        w.add_(1.0)  # as an optimizer step would
    assert [float(v) for v in strategy.experimental_local_results(
        strategy.run(product, args=(x,)))] == [32.0, 32.0]


@pytest.mark.parametrize("execution", ["ordered", "concurrent"])
@pytest.mark.parametrize("met", [False, True])
def test_a_replica_context_kept_past_its_run_refuses_clearly(execution, met):
    # it used to wait forever on the finished run's rendezvous (ordered, after a meeting)
    strategy = _strategy(2, execution=execution)
    kept = []

    def fn():
        ctx = cs.get_replica_context()
        if met:
            ctx.all_reduce("SUM", torch.tensor(1.0))
        kept.append(ctx)
    strategy.run(fn)
    for ctx in kept:
        with pytest.raises(RuntimeError, match="strategy.run that has returned"):
            ctx.all_reduce("SUM", torch.tensor(1.0))
        with pytest.raises(RuntimeError, match="strategy.run that has returned"):
            ctx.merge_call(lambda s: None)
    assert strategy.experimental_local_results(strategy.run(_rid)) == (0, 1)  # still works


def test_workers_inherit_inference_mode_and_autocast_of_the_caller():
    strategy = _strategy(2)

    def fn():
        cs.get_replica_context().all_reduce("SUM", torch.tensor(1.0))  # forces worker threads
        return [_rid(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
                torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None]
    with torch.inference_mode():
        assert strategy.experimental_local_results(strategy.run(fn)) == (
            [0, True, False, None], [1, True, False, None])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert strategy.experimental_local_results(strategy.run(fn)) == (
            [0, False, True, torch.bfloat16], [1, False, True, torch.bfloat16])
    assert strategy.experimental_local_results(strategy.run(fn)) == (
        [0, False, False, None], [1, False, False, None])


def test_run_cannot_nest_and_reduce_needs_cross_replica_context():
    strategy = _strategy(2)
    with pytest.raises(RuntimeError, match="cross-replica"):
        strategy.run(lambda: strategy.run(lambda: 1))
    with pytest.raises(RuntimeError, match="nested"):
        strategy.run(lambda: cs.get_replica_context().merge_call(lambda s: s.run(lambda: 1)))


def test_run_takes_args_as_a_tuple_or_list_and_refuses_anything_else():
    strategy = _strategy(2)
    x = cs.PerReplica([1, 2])
    assert strategy.experimental_local_results(strategy.run(lambda a, b: a + b, args=[x, 10])) \
        == (11, 12)
    Pair = collections.namedtuple("Pair", "a b")
    assert strategy.experimental_local_results(
        strategy.run(lambda a, b: a * b, args=Pair(x, 3))) == (3, 6)
    with pytest.raises(TypeError, match="args must be a tuple, got int"):
        strategy.run(lambda a: a, args=5)


def test_per_replica_argument_of_the_wrong_size_is_refused():
    with pytest.raises(ValueError, match="3 per-replica values"):
        _strategy(2).run(lambda x: x, args=(cs.PerReplica([1, 2, 3]),))


# -- parameters and gradients -------------------------------------------------------------
@pytest.mark.parametrize("copy", [False, True])
def test_gradients_from_a_backward_after_run_reach_the_optimizer(copy):
    strategy = _strategy(2, copy_parameters=copy)
    with strategy.scope():
        layer = torch.nn.Linear(2, 1, bias=False)
        opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    x = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.full((1, 2), float(ctx.replica_id_in_sync_group + 1)))
    outputs = strategy.run(lambda v: layer(v).sum(), args=(x,))
    strategy.reduce("SUM", outputs).backward()  # in cross-replica context, after run
    opt.step()  # collects the replicas' pending gradients first
    assert layer.weight.tolist() == [[-2.0, -2.0]]  # 1 - (1 + 2)


@pytest.mark.parametrize("replicas,copy", [(1, False), (2, False), (3, False), (2, True)])
@pytest.mark.parametrize("between", ["reads nothing", "reads another model", "fails"])
def test_a_backward_through_an_earlier_runs_outputs_reaches_the_optimizer(
        replicas, copy, between):
    # gradient accumulation over several runs: the backward comes after other runs,
    # which need not read the same parameters (they used to drop the first run's leaves)
    strategy = _strategy(replicas, copy_parameters=copy)
    with strategy.scope():
        layer, other = torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)
    x = torch.ones(2, 3)
    first = strategy.run(lambda: layer(x).sum())
    if between == "reads nothing":
        strategy.run(lambda: x.sum())
    elif between == "reads another model":
        strategy.run(lambda: other(x).sum().backward())
    else:
        with pytest.raises(ValueError):
            strategy.run(lambda: (other(x).sum().backward(), _raise(ValueError("boom"))))
    strategy.reduce("SUM", first).backward()
    strategy.extended.store.flush_pending()  # what optimizer.step() does first
    assert layer.weight.grad.tolist() == [[2.0 * replicas] * 3]
    assert layer.bias.grad.tolist() == [2.0 * replicas]
    # a failed run's gradients are dropped, except one direct replica's, which are in
    # .grad already, as in a plain loop (ReplicaServing.clear_grads)
    kept = between == "reads another model" or (between == "fails" and replicas == 1
                                                and not copy)
    assert (other.weight.grad.tolist() if other.weight.grad is not None else None) \
        == ([[2.0 * replicas] * 3] if kept else None)


def test_a_late_backward_is_collected_once():
    strategy = _strategy(2)
    with strategy.scope():
        layer = torch.nn.Linear(3, 1, bias=False)
    x = torch.ones(2, 3)
    first = strategy.run(lambda: layer(x).sum())
    strategy.run(lambda: layer(x).sum().backward())
    assert layer.weight.grad.tolist() == [[4.0] * 3]
    strategy.reduce("SUM", first).backward()
    for _ in range(3):  # every later flush (run, optimizer.step) finds nothing new
        strategy.extended.store.flush_pending()
        strategy.run(lambda: x.sum())
    assert layer.weight.grad.tolist() == [[8.0] * 3]


def _raise(exc):
    raise exc


@pytest.mark.parametrize("replicas,copy", [(1, False), (2, False), (3, False), (2, True)])
def test_a_deleted_model_is_freed_and_the_next_one_trains(replicas, copy):
    # a notebook or a sweep makes one model after another in the same strategy: replica
    # aliases must not keep the old ones alive (they did, from 2 replicas). Device
    # mirrors (copies) still do: freeing under a mirror would orphan leaves in use.
    strategy = _strategy(replicas, copy_parameters=copy)
    x = torch.ones(2 * replicas, 4)
    (batch,) = strategy.experimental_distribute_dataset([x])
    freed = []
    for _ in range(3):
        with strategy.scope():
            layer = torch.nn.Linear(4, 2)
        with torch.no_grad():
            layer.weight.fill_(1.0)
        strategy.run(lambda v: layer(v).sum().backward(), args=(batch,))
        strategy.extended.store.flush_pending()
        assert layer.weight.grad.tolist() == [[2.0 * replicas] * 4] * 2  # the new one
        freed.append(weakref.ref(layer.weight))
        del layer
        gc.collect()
    assert [ref() is None for ref in freed] == [not copy] * 3
    store = strategy.extended.store
    if not copy:
        assert not any(store._aliases) and not store._followed and not store.tensors()


@pytest.mark.parametrize("copy", [False, True])
def test_a_model_freed_during_a_run_or_between_runs_leaves_the_others_whole(copy):
    # review of the weak-reference change: a free that rebuilt the mirrors orphaned the
    # leaves a run was using (stale values after a merge's optimizer step, lost
    # gradients), and those a late backward would reach
    strategy = _strategy(2, copy_parameters=copy)
    with strategy.scope():
        layer = torch.nn.Linear(3, 1, bias=False)
        doomed = [torch.nn.Linear(3, 1), torch.nn.Linear(3, 1)]
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    x = torch.ones(1, 3)

    def merge(_):
        doomed.pop()
        gc.collect()
        opt.step()
        opt.zero_grad()

    def step():
        layer(x).sum().backward()
        cs.get_replica_context().merge_call(merge)
        out = layer(x).sum()  # after the merge's step: 3 * (1 - 0.1 * 2)
        out.backward()
        return out.detach()

    outputs = strategy.experimental_local_results(strategy.run(step))
    assert [round(o.item(), 5) for o in outputs] == [2.4, 2.4]
    strategy.extended.store.flush_pending()
    assert layer.weight.grad.tolist() == [[2.0] * 3]
    layer.weight.grad = None
    first = strategy.run(lambda: layer(x).sum())
    doomed.pop()
    gc.collect()
    strategy.run(lambda: layer(x).sum().backward())
    strategy.reduce("SUM", first).backward()
    strategy.extended.store.flush_pending()
    assert layer.weight.grad.tolist() == [[4.0] * 3]


@pytest.mark.parametrize("replicas,copy", [(1, False), (2, False), (2, True)])
def test_freezing_a_parameter_between_runs_stops_its_gradient(replicas, copy):
    # fine-tuning freezes layers after some steps: replicas' cached leaves must follow
    strategy = _strategy(replicas, copy_parameters=copy)
    with strategy.scope():
        layer = torch.nn.Linear(3, 1)
    x = torch.ones(2 * replicas, 3)
    (batch,) = strategy.experimental_distribute_dataset([x])

    def step(v):
        layer(v).sum().backward()

    def grads():
        layer.weight.grad = layer.bias.grad = None
        strategy.run(step, args=(batch,))
        strategy.extended.store.flush_pending()
        return layer.weight.grad, layer.bias.grad
    assert all(g is not None for g in grads())
    layer.weight.requires_grad_(False)
    weight_grad, bias_grad = grads()
    assert weight_grad is None and bias_grad.tolist() == [2.0 * replicas]
    layer.weight.requires_grad_(True)
    weight_grad, _ = grads()
    assert weight_grad.tolist() == [[2.0 * replicas] * 3]


def test_one_replica_on_the_parameter_device_uses_the_central_parameters_directly():
    # nothing to alias or hand over: gradients accumulate straight into .grad, so a run
    # that fails after backward leaves them there, as a plain PyTorch loop would
    strategy = _strategy(1)
    with strategy.scope():
        layer = torch.nn.Linear(2, 1, bias=False)
    central = layer.weight
    assert strategy.run(lambda: layer.weight) is central

    def fails_after_backward():
        layer(torch.ones(1, 2)).sum().backward()
        raise ValueError("after backward")
    strategy.run(lambda: layer(torch.ones(1, 2)).sum().backward())
    with pytest.raises(ValueError):
        strategy.run(fails_after_backward)
    assert central.grad.tolist() == [[2.0, 2.0]]


def test_replacing_parameter_data_between_runs_is_seen_by_replicas():
    strategy = _strategy(2)
    with strategy.scope():
        layer = torch.nn.Linear(1, 1, bias=False)
    x = strategy.experimental_distribute_values_from_function(lambda ctx: torch.ones(1, 1))
    layer.weight.data = torch.full((1, 1), 3.0)  # new storage, not an in-place write
    out = strategy.experimental_local_results(strategy.run(lambda v: layer(v).item(), args=(x,)))
    assert out == (3.0, 3.0)


def test_parameters_read_last_run_are_served_before_the_replicas_start(monkeypatch):
    # A first read inside a replica contends for the GIL with the other replicas (~13 µs
    # each in the MLP's timelines): the same step's parameters are served up front.
    from csrun.core.distribute.parameters import ReplicaServing
    strategy = _strategy(2)
    with strategy.scope():
        layer = torch.nn.Linear(2, 1)
    x = strategy.experimental_distribute_values_from_function(lambda ctx: torch.ones(1, 2))

    def step(v):
        layer(v).sum().backward()
        return layer.weight.detach().clone()
    strategy.run(step, args=(x,))
    reads = []
    real = ReplicaServing.serve
    monkeypatch.setattr(ReplicaServing, "serve",
                        lambda self, *a: reads.append(a[1]) or real(self, *a))
    layer.weight.grad = None
    strategy.run(step, args=(x,))
    assert reads == [] and layer.weight.grad.tolist() == [[2.0, 2.0]]
    # still the central values of now: new data after a run is seen, not the old leaf's
    layer.weight.data = torch.full((1, 2), 3.0)
    out = strategy.experimental_local_results(strategy.run(step, args=(x,)))
    assert [o.tolist() for o in out] == [[[3.0, 3.0]]] * 2


def test_parameters_served_up_front_follow_a_merge_and_only_last_runs_reads():
    # Found in review: a parameter first read after a merge_call got the leaf served
    # before the run (old data, still requiring grad after a freeze), and parameters
    # served up front but never read were served again in every later run.
    strategy = _strategy(2)
    with strategy.scope():
        a, b = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    x = torch.ones(1, 2)
    strategy.run(lambda: a(x).sum().backward())
    strategy.run(lambda: b(x).sum().backward())
    strategy.run(lambda: None)
    assert [len(ids) for ids in strategy.extended.store._last_read] == [0, 0]
    strategy.run(lambda: b(x).sum().backward())  # b's parameters served up front next

    def freeze_then_read():
        cs.get_replica_context().merge_call(lambda s: b.weight.requires_grad_(False))
        b(x).sum().backward()
    b.weight.grad = b.bias.grad = None
    strategy.run(freeze_then_read)
    assert b.weight.grad is None and b.bias.grad.tolist() == [2.0]
    b.weight.requires_grad_(True)
    strategy.run(lambda: b(x).sum().backward())

    def replace_then_read():
        cs.get_replica_context().merge_call(
            lambda s: setattr(b.weight, "data", torch.full((1, 2), 5.0)))
        return b.weight.detach().clone()
    out = strategy.experimental_local_results(strategy.run(replace_then_read))
    assert [o.tolist() for o in out] == [[[5.0, 5.0]]] * 2


def test_optimizer_step_inside_a_replica_is_refused_with_advice():
    strategy = _strategy(2)
    with strategy.scope():
        layer = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="after run"):
        strategy.run(lambda: opt.step())


@pytest.mark.parametrize("replicas,copy", [(1, False), (2, False), (2, True)])
def test_optimizer_step_inside_merge_call_applies_this_runs_gradients(replicas, copy):
    # TF's apply_gradients in merge_call: the replicas' gradients so far are summed into
    # .grad when they meet, the same with one replica (served the central parameters) as
    # with several; each replica then reads the updated value, and nothing is added twice
    strategy = _strategy(replicas, copy_parameters=copy)
    with strategy.scope():
        layer = torch.nn.Linear(1, 1, bias=False)
        opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    with torch.no_grad():
        layer.weight.fill_(1.0)

    def fn():
        before = layer.weight.item()
        layer.weight.sum().backward()
        cs.get_replica_context().merge_call(lambda s: opt.step())
        return before, layer.weight.item()
    results = strategy.experimental_local_results(strategy.run(fn))
    assert results == ((1.0, 1.0 - replicas),) * replicas
    assert layer.weight.grad.item() == replicas
    opt.step()  # the same gradient again: nothing new arrived after merge_call
    assert layer.weight.item() == 1.0 - 2 * replicas


@pytest.mark.parametrize("replicas", [1, 2])
def test_model_moved_after_scope_is_refused_clearly(replicas):
    strategy = _strategy(replicas)
    with strategy.scope():
        layer = torch.nn.Linear(2, 1)
    layer.to(torch.float64)  # same device: allowed, copies follow
    assert strategy.run(lambda: layer(torch.ones(1, 2, dtype=torch.float64)).dtype) is torch.float64
    layer.to("meta")
    with pytest.raises(RuntimeError, match="must not be moved"):
        strategy.run(lambda: layer(torch.ones(1, 2)))


def test_parameters_created_in_scope_land_on_the_parameter_device():
    strategy = _strategy(2)
    with strategy.scope():
        layer = torch.nn.Linear(2, 1, device="meta")  # asks for another device
    assert layer.weight.device.type == "cpu" and isinstance(layer.weight, torch.nn.Parameter)


# -- buffers ------------------------------------------------------------------------------
class Counter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen += x.shape[0]
        return x


@pytest.mark.parametrize("copy", [False, True], ids=["aliases", "copies"])
@pytest.mark.parametrize("aggregation, expected", [
    ("SUM", 10.0), ("MEAN", 5.0), ("ONLY_FIRST_REPLICA", 6.0)])
def test_buffer_written_in_replicas_is_aggregated(aggregation, expected, copy):
    strategy = _strategy(2, copy_parameters=copy)
    with strategy.scope():
        counter = Counter()
    cs.set_aggregation(counter, "seen", aggregation)
    batch = list(torch.arange(12.0).split(12))  # 6 + 6 examples per replica
    for x in strategy.experimental_distribute_dataset(batch):
        strategy.run(counter, args=(x,))
    # SUM adds both replicas' increments: 6 + 6; MEAN and ONLY_FIRST take one replica's.
    assert counter.seen.item() == {"SUM": 12.0, "MEAN": 6.0, "ONLY_FIRST_REPLICA": 6.0}[
        aggregation]
    del expected


@pytest.mark.parametrize("copy", [False, True], ids=["aliases", "copies"])
def test_buffer_with_aggregation_none_written_in_replicas_is_an_error(copy):
    strategy = _strategy(2, copy_parameters=copy)
    with strategy.scope():
        counter = Counter()
    cs.set_aggregation(counter, "seen", cs.VariableAggregation.NONE)
    with pytest.raises(ValueError, match="Counter.seen.*aggregation is NONE"):
        strategy.run(counter, args=(torch.ones(1),))
    assert counter.seen.item() == 0.0


def test_default_buffer_aggregations():
    assert cs.get_aggregation(None, "x", torch.zeros(1)) is cs.VariableAggregation.MEAN
    assert cs.get_aggregation(None, "n", torch.zeros(1, dtype=torch.long)) is \
        cs.VariableAggregation.ONLY_FIRST_REPLICA
    with pytest.raises(KeyError, match="no buffer 'nope'"):
        cs.set_aggregation(Counter(), "nope", "SUM")
    with pytest.raises(ValueError, match="aggregation must be"):
        cs.set_aggregation(Counter(), "seen", "MAX")


@pytest.mark.parametrize("copy", [False, True], ids=["aliases", "copies"])
def test_buffer_reassigned_inside_a_replica(copy):
    strategy = _strategy(2, copy_parameters=copy)
    with strategy.scope():
        module = Counter()

    def fn():
        module.seen = torch.tensor(float(_rid() + 1))  # replaces the buffer
    strategy.run(fn)
    assert module.seen.item() == 1.5  # MEAN of 1 and 2


@pytest.mark.parametrize("copy", [False, True], ids=["aliases", "copies"])
def test_buffers_written_by_some_replicas_only(copy):
    """Each buffer's own writers count, though a copy replica's buffers share one flat
    buffer: replica 1 writes ``a`` only, replica 0 ``b`` only; a buffer replaced between
    runs (the central tensor is another) is served and combined as the new one."""
    strategy = _strategy(2, copy_parameters=copy)
    with strategy.scope():
        module = torch.nn.Module()
        module.register_buffer("a", torch.zeros(3))
        module.register_buffer("b", torch.zeros(2))

    def fn():
        r = _rid()
        (module.a if r == 1 else module.b).add_(r + 1.0)
        return module.a.sum() + module.b.sum()
    for _ in range(3):
        strategy.run(fn)
    assert module.a.tolist() == [6.0] * 3 and module.b.tolist() == [3.0] * 2
    module.a = torch.full((3,), 10.0)  # replaced outside replicas
    strategy.run(fn)
    strategy.run(fn)
    assert module.a.tolist() == [14.0] * 3 and module.b.tolist() == [5.0] * 2


def test_a_copy_replicas_buffer_layout_follows_the_buffers_it_reads():
    """A buffer replaced every step joins the flat layout and the one it replaced leaves
    it (the layout holds what the last run read: it does not grow with the steps)."""
    strategy = _strategy(2, copy_parameters=True)
    with strategy.scope():
        module = torch.nn.Module()
        module.register_buffer("a", torch.zeros(3))
    for step in range(6):
        module.a = torch.full((3,), float(step))
        strategy.run(lambda: module.a.add_(1.0))
        assert module.a.tolist() == [step + 1.0] * 3
    mirror = strategy.extended.store.buffer_mirror(1)
    assert len(mirror._slot) <= 2


# -- input --------------------------------------------------------------------------------
@pytest.mark.process
def test_dataloader_with_worker_processes():
    strategy = _strategy(2)
    dataset = torch.utils.data.TensorDataset(torch.arange(10.0), torch.arange(10))
    loader = torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=2)
    steps = [[[t.tolist() for t in strategy.experimental_local_results(part)] for part in step]
             for step in strategy.experimental_distribute_dataset(loader)]
    assert steps[0] == [[[0.0, 1.0], [2.0, 3.0]], [[0, 1], [2, 3]]]
    assert steps[-1] == [[[8.0], [9.0]], [[8], [9]]]


@pytest.mark.timeout(30)
def test_breaking_out_of_a_loop_stops_the_reader_thread():
    strategy = _strategy(2)
    before = threading.active_count()

    def endless():
        while True:
            yield torch.zeros(4, 2)
    for i, _ in enumerate(strategy.experimental_distribute_dataset(endless())):
        if i == 3:
            break
    gc.collect()
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threading.active_count() <= before


def test_error_in_the_dataset_reaches_the_loop():
    strategy = _strategy(2)

    def broken():
        yield torch.zeros(2, 1)
        raise OSError("disk gone")
    it = iter(strategy.experimental_distribute_dataset(broken()))
    next(it)
    with pytest.raises(OSError, match="disk gone"):
        next(it)


def test_unsplittable_batches_are_explained():
    strategy = _strategy(2)
    with pytest.raises(ValueError, match="different batch sizes"):
        next(iter(strategy.experimental_distribute_dataset([(torch.zeros(4), torch.zeros(3))])))
    with pytest.raises(TypeError, match="must hold tensors"):
        next(iter(strategy.experimental_distribute_dataset([["a", "b"]])))


def test_dropped_last_round_warns_every_pass():
    strategy = _strategy(2)
    dist = strategy.distribute_datasets_from_function(
        lambda ctx: list(torch.arange(6).split(2)))  # 3 batches for 2 replicas
    for _ in range(2):
        with pytest.warns(UserWarning, match="dropped them \\(2 examples\\)"):
            assert len(list(dist)) == 1


def test_training_loop_uses_each_batch_once():
    strategy = _strategy(2)
    with strategy.scope():
        model = torch.nn.Linear(3, 1)
    seen = []
    data = list(torch.arange(24.0).reshape(8, 3).split(4))
    for x in strategy.experimental_distribute_dataset(data):
        out = strategy.run(lambda v: (seen.append(v.sum().item()), model(v).sum())[1], args=(x,))
        assert isinstance(out, cs.PerReplica)
    assert sum(seen) == torch.arange(24.0).sum().item()


def test_no_warnings_in_a_normal_training_step():
    strategy = _strategy(2)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        opt = torch.optim.Adam(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for x in strategy.experimental_distribute_dataset([torch.randn(8, 3)] * 2):
            opt.zero_grad()
            strategy.run(lambda v: F.mse_loss(model(v), torch.zeros(4, 4)).backward(),
                         args=(x,))
            opt.step()


# -- execution policy ---------------------------------------------------------------------
def test_quick_replicas_stay_ordered_on_the_calling_thread(work_clock):
    # One slow run decides nothing: the first (its one-off costs), or one in the middle
    # (a thread preempted on a loaded machine, a garbage collection). Counted in full,
    # the first one switched the next run to concurrent.
    strategy = _strategy(2)
    assert strategy.extended.execution == "probe"
    for work in (5e-3, 10e-6, 10e-6, 5e-3, 10e-6, 10e-6):
        strategy.run(lambda seconds=work: work_clock.work(seconds))
        assert strategy.extended.execution in ("probe", "ordered")
    assert strategy.extended.execution == "ordered"
    assert strategy.extended._executor.num_threads == 0  # never left the caller's thread


def test_long_replicas_run_concurrently_and_results_still_repeat_bit_for_bit():
    first = _strategy(2)
    bits = train_bits(first)
    assert first.extended.execution == "concurrent"
    assert train_bits(_strategy(2)) == bits


def test_replicas_using_dropout_run_concurrently_and_repeat_bit_for_bit():
    # each replica draws from its own generator (more in test_replica_random.py)
    strategy = _strategy(2)
    bits = train_bits(strategy, dropout=True)
    assert strategy.extended.execution == "concurrent"
    assert train_bits(_strategy(2), dropout=True) == bits


def test_a_concurrent_run_that_draws_random_numbers_switches_back_with_a_warning():
    strategy = _strategy(2)
    for _ in range(3):
        strategy.run(lambda: time.sleep(0.002))
    assert strategy.extended.execution == "concurrent"
    # torch.rand(1) draws from the replica's own generator; a torch.ops overload without
    # a generator argument draws from the global one
    draw = lambda: (time.sleep(0.002), torch.ops.aten.rand.default([1]))[1]  # noqa: E731
    # the streams were off (nothing drew): the first draw brings them back, then the
    # probe sees the global generator still moving and names the op
    with pytest.warns(RuntimeWarning, match="interleaved in no fixed order"):
        strategy.run(draw)
    with pytest.warns(RuntimeWarning, match=r"aten\.rand.*in order from now on"):
        strategy.run(draw)
    assert strategy.extended.execution == "ordered"
    for _ in range(3):
        strategy.run(lambda: time.sleep(0.002))
    assert strategy.extended.execution == "ordered"  # for good


def test_explicit_modes_are_kept():
    ordered = _strategy(2, execution="ordered")
    concurrent = _strategy(2, execution="concurrent")
    for _ in range(3):
        ordered.run(lambda: time.sleep(0.002))
        concurrent.run(lambda: None)
    assert ordered.extended.execution == "ordered"
    assert concurrent.extended.execution == "concurrent"


def test_runs_leave_no_cyclic_garbage():
    # a run that leaves reference cycles makes the collector walk the heap every few
    # dozen steps of a long job
    strategy = _strategy(2)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group)))
    strategy.reduce("SUM", strategy.run(lambda x: x, args=(value,)))
    gc.collect()
    gc.disable()
    try:
        for _ in range(50):
            strategy.reduce("SUM", strategy.run(lambda x: x * 2, args=(value,)))
        assert gc.collect() == 0
        # runs whose replicas meet (the collectives point back at the run)
        for _ in range(20):
            strategy.run(lambda x: cs.get_replica_context().all_reduce("SUM", x), args=(value,))
        assert gc.collect() == 0
    finally:
        gc.enable()


def test_a_stores_last_reference_frees_it_without_the_collector():
    # a run that reads nothing keeps its servings for the next: they must not point back
    # at the store that keeps them, or each store left behind (a hook of an old output
    # holds one) waits for the collector, which then walks the heap mid-run
    strategy = _strategy(2)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group)))
    for _ in range(3):
        strategy.reduce("SUM", strategy.run(lambda x: x, args=(value,)))
    holder = [strategy.extended._store]
    store = weakref.ref(holder[0])
    del strategy, value
    gc.collect()  # the strategy is gone; the store is held here alone
    assert store() is not None
    gc.disable()
    try:
        holder.clear()
        assert store() is None
    finally:
        gc.enable()


def test_parameter_server_strategy_is_exported_and_is_central_storage_without_a_cluster(
        monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    for name in ("ParameterServerStrategy", "ClusterSpec", "SimpleClusterResolver",
                 "TFConfigClusterResolver", "TorchrunClusterResolver"):
        assert name in cs.__all__ and hasattr(cs, name)
    strategy = cs.ParameterServerStrategy()
    assert strategy.cluster_resolver is None and strategy.num_replicas_in_sync == 1
    assert float(strategy.reduce("SUM", strategy.run(lambda: torch.tensor(3.0)))) == 3.0


# -- input --------------------------------------------------------------------------------
@pytest.mark.parametrize("replicas", [2, 3, 4])
@pytest.mark.parametrize("size", [0, 1, 2, 3, 5, 8, 9])
@pytest.mark.parametrize("kind", [tuple, list])
def test_flat_batches_split_as_the_general_path_does(monkeypatch, kind, size, replicas):
    # (x, y) batches take a fast path; it must agree with the nest walk, partial and
    # empty batches included (TF: the last replicas get fewer or no examples)
    from csrun.core.distribute import input as input_module

    batch = kind([torch.arange(size * 3.0).reshape(size, 3), torch.arange(size)])
    fast = input_module.split_batch(batch, replicas)
    monkeypatch.setattr(input_module, "_split_flat", lambda batch, replicas: None)
    general = input_module.split_batch(batch, replicas)
    assert [type(piece) for piece in fast] == [kind] * replicas
    assert [[t.tolist() for t in piece] for piece in fast] == \
        [[t.tolist() for t in piece] for piece in general]
    assert sum(len(piece[1]) for piece in fast) == size


@pytest.mark.parametrize("batch,error", [
    ((torch.zeros(4, 2), torch.zeros(3)), "different batch sizes"),
    ((torch.zeros(4), torch.tensor(1.0)), "unbatched"),
    ((torch.zeros(4), "label"), "must hold tensors"),
])
def test_flat_batches_that_cannot_split_get_the_general_errors(batch, error):
    from csrun.core.distribute.input import split_batch

    with pytest.raises((ValueError, TypeError), match=error):
        split_batch(batch, 2)


# -- regrouping replicas' outputs ----------------------------------------------------------
def test_run_regroups_nested_outputs_position_by_position():
    strategy = _strategy(2)
    Pair = collections.namedtuple("Pair", "a b")
    shared = object()

    def fn():
        r = _rid()
        return Pair(r, {"x": [r * 10, shared], "y": (shared,)}), [r, "same"]
    out = strategy.run(fn)
    pair, listed = out
    assert type(out) is tuple and type(pair) is Pair and type(listed) is list
    assert isinstance(pair.a, cs.PerReplica) and pair.a.values == (0, 1)
    assert pair.b["x"][0].values == (0, 10)
    assert pair.b["x"][1] is shared and pair.b["y"] == (shared,)   # same object: kept
    assert listed[0].values == (0, 1) and listed[1] == "same"      # interned str: same


@pytest.mark.parametrize("first,other,message", [
    ((1, 2), (1, 2, 3), "a tuple of 2 but replica 1 returned a tuple of 3"),
    ((1, 2), [1, 2], "a tuple of 2 but replica 1 returned a list of 2"),
    ({"a": 1}, {"b": 1}, "keys \\['a'\\] but replica 1 returned a dict with keys \\['b'\\]"),
    (1, (1,), "returned a int but replica 1 returned a tuple of 1"),
    (((1,), 2), (1, 2), "returned a tuple of 1 but replica 1 returned a int"),
])
def test_regroup_names_replicas_whose_outputs_differ_in_structure(first, other, message):
    from csrun.core.distribute.values import regroup

    with pytest.raises(ValueError, match=message):
        regroup([first, other])


@pytest.mark.parametrize("source", [list, iter])
def test_batches_made_under_no_grad_keep_their_link_to_the_dataset(source):
    # in-memory batches (list) are split on the consumer's thread, others on a prefetch
    # thread: both as the prefetch thread does, with grad on
    strategy = _strategy(2)
    x = torch.arange(4.0, requires_grad=True)
    dist = strategy.experimental_distribute_dataset(source([(x, torch.arange(4))]))
    with torch.no_grad():
        (step,) = list(dist)
    part = strategy.experimental_local_results(step)[1][0]
    (part * 2).sum().backward()
    assert x.grad.tolist() == [0.0, 0.0, 2.0, 2.0]


# -- device errors ------------------------------------------------------------------------
@pytest.mark.parametrize("devices, message", [
    (["CPU:99999"], "device 'CPU:99999' does not exist"),
    (["CPU:0", "/cpu:0"], ("compute_devices lists CPU:0 twice ('CPU:0' and '/cpu:0'); "
                           "each replica needs its own device")),
    ([], "compute_devices is empty; give at least one device"),
    (["TPU:0"], "cannot parse device 'TPU:0'"),
])
def test_device_error_keeps_message_and_hint_apart(devices, message):
    with pytest.raises(cs.DeviceError) as info:
        cs.CentralStorageStrategy(devices, "CPU:0")
    err = info.value
    assert err.message.startswith(message) and "available" not in err.message
    assert err.hint.startswith("available: CPU:0..CPU:")
    assert str(err) == f"{err.message}; {err.hint}"  # the text TF-parity tests compare
    copy = pickle.loads(pickle.dumps(err))
    assert (copy.message, copy.hint, str(copy)) == (err.message, err.hint, str(err))


def test_device_error_without_hint_is_just_its_message():
    err = cs.DeviceError("logical CPU count must be a positive int, got 0")
    assert (err.message, err.hint, str(err)) == (
        "logical CPU count must be a positive int, got 0", None,
        "logical CPU count must be a positive int, got 0")
