"""The work of one steady-state training step, counted (never timed): host syncs, copies
of the model, and where a model built in scope is initialized.

Issue 36 measured these on a GPU (a BatchNorm model's step waited for the device ~40 times
and copied its buffers ~200 times); on this CPU-only suite the same calls are counted as
aten ops (:mod:`tests.helpers.op_count`), against the plain PyTorch loop of the same
model, optimizer and data. The ``gpu`` tests at the end run the step under
``torch.cuda.set_sync_debug_mode("error")`` where a GPU is present.

The step: Linear-BatchNorm-ReLU-Dropout-Linear, Adam, cross-entropy summed over the
replica's examples / the global batch, ``loss.backward()`` in the replica,
``optimizer.step()`` after ``run``, the loss reduced with SUM.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F

import csrun.core as cs
from csrun.core.distribute import context, parameters, values
from tests.helpers.call_count import calls
from tests.helpers.op_count import OpCount, model_tensors

BATCH = 12
WARM_STEPS = 3  # the first runs build leaves, mirrors, streams and decide the policy


def _net():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16),
                               torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 3))


def _batches(steps=WARM_STEPS + 1):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(BATCH, 8, generator=g), torch.randint(0, 3, (BATCH,), generator=g))
            for _ in range(steps)]


class _Counted:
    """The step under count: ``count`` is set for the counted step only (``counting``:
    a step is under count, for spies on csrun's own functions)."""
    count: OpCount | None = None
    counting = False


class _TwoDtypes(torch.nn.Module):
    """The net and a float64 parameter: two dtypes, two flat buffers per direction."""

    def __init__(self):
        super().__init__()
        self.net = _net()
        self.scale = torch.nn.Parameter(torch.ones((), dtype=torch.float64))

    def forward(self, x):
        return self.net(x) * self.scale.float()


def _plain(make=_net):
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y, reduction="sum") / BATCH
        loss.backward()
        opt.step()
        return loss.detach()
    return model, step, lambda batches: batches


def _csrun(devices, counted: _Counted | None, make=_net, parameter: str = "CPU:0",
           **options):
    """The csrun loop: ``(model, step, distribute)``; ``counted``: where its replicas'
    ops are counted (None: not counted)."""
    strategy = cs.CentralStorageStrategy(devices, parameter,
                                         options=cs.StrategyOptions(**options))
    torch.manual_seed(0)
    with strategy.scope():
        model = make()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def replica(x, y):
        count = counted.count if counted is not None else None
        with count.replica() if count else contextlib.nullcontext():
            loss = F.cross_entropy(model(x), y, reduction="sum") / BATCH
            loss.backward()
            return loss.detach()

    def step(x, y):
        opt.zero_grad()
        loss = strategy.reduce("SUM", strategy.run(replica, args=(x, y)))
        opt.step()
        return loss
    return model, step, lambda batches: list(strategy.experimental_distribute_dataset(batches))


def _count(_model, step, distribute, counted: _Counted | None = None) -> OpCount:
    batches = distribute(_batches())
    for x, y in batches[:WARM_STEPS]:
        step(x, y)
    count = OpCount()
    if counted is not None:
        counted.count = count
    _Counted.counting = True
    try:
        with count.counting():
            step(*batches[WARM_STEPS])
    finally:
        _Counted.counting = False
    if counted is not None:
        counted.count = None
    return count


VARIANTS = {
    "1 replica": (["CPU:0"], {}),
    "2 replicas": (["CPU:0", "CPU:1"], {}),
    "2 replicas, concurrent": (["CPU:0", "CPU:1"], {"execution": "concurrent"}),
    "3 replicas, unsynchronized BatchNorm": (["CPU:0", "CPU:1", "CPU:2"],
                                             {"sync_batch_norm": False}),
    "1 replica, copies": (["CPU:0"], {"copy_parameters": True}),
    "2 replicas, copies": (["CPU:0", "CPU:1"], {"copy_parameters": True}),
    # every tensor a bucket of its own: gradients leave during the backward (hooks)
    "2 replicas, copies in buckets": (["CPU:0", "CPU:1"], {"copy_parameters": True,
                                                           "bytes_per_pack": 1}),
}


def _measure(variant: str, make=_net):
    devices, options = VARIANTS[variant]
    counted = _Counted()
    model, step, distribute = _csrun(devices, counted, make, **options)
    return model, _count(model, step, distribute, counted)


@pytest.fixture(scope="module")
def plain() -> tuple:
    model, step, distribute = _plain()
    return model, _count(model, step, distribute)


def _names(ops) -> collections.Counter:
    return collections.Counter(name for name, _ in ops)


# -- no host sync -------------------------------------------------------------------------
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_step_waits_for_no_device_beyond_the_plain_loop(variant, plain):
    devices, _ = VARIANTS[variant]
    _, count = _measure(variant)
    syncs = count.syncs()
    if len(devices) > 1:
        # Logical CPU replicas draw dropout masks from generators of their own, seeded by
        # one draw of torch's CPU generator per run (replica_random.RunSeed): a 0-d int64
        # read on the CPU, which no device replica makes (GPU replicas keep their CUDA
        # generators). Exactly one, and nothing else.
        seeds = [s for s in syncs if s[0] == "_local_scalar_dense" and s[1][0].dim() == 0
                 and s[1][0].dtype == torch.int64 and s[1][0].is_cpu]
        assert len(seeds) == 1, seeds
        syncs = [s for s in syncs if s is not seeds[0]]
    # the plain loop's own: Adam reads each parameter's step count (a CPU tensor)
    assert _names(syncs) == _names(plain[1].syncs())
    assert _names(plain[1].syncs()) == {"_local_scalar_dense": 6}


# -- no needless copy ---------------------------------------------------------------------
def test_one_replica_issues_exactly_the_plain_loops_ops(plain):
    """One replica on the parameter device reads and writes the parameters, buffers and
    gradients themselves: not a copy, not an op more than the plain loop."""
    model, count = _measure("1 replica")
    assert count.ops == plain[1].ops
    assert count.copies_of(model_tensors(model)) == []


@pytest.mark.parametrize("variant", ["2 replicas", "3 replicas, unsynchronized BatchNorm"])
def test_replicas_on_the_parameter_device_copy_only_their_buffers(variant):
    """Logical CPU replicas alias the parameters and hand their gradients over without a
    copy. Buffers are per replica (TF's per-replica values of a variable written in
    replica context): one copy per buffer read per replica, and one write back of each
    buffer written (BatchNorm's running statistics and batch count)."""
    devices, _ = VARIANTS[variant]
    model, count = _measure(variant)
    params = list(model.parameters())
    assert count.copies_of(params) == []
    assert count.copies_of([p.grad for p in params]) == []
    buffers = list(model.buffers())
    assert collections.Counter(count.copies_of(buffers)) == {
        "_to_copy": len(buffers) * len(devices), "copy_": len(buffers)}


@pytest.mark.parametrize("variant", ["1 replica, copies", "2 replicas, copies"])
def test_copy_replicas_get_one_coalesced_copy_per_dtype_per_direction(variant, monkeypatch):
    """The copy path (GPU replicas, ``copy_parameters``): each replica reads the
    parameters through one flat buffer per dtype, filled by one copy, and hands its
    gradients back the same way (core/distribute/broadcast.py); its buffers too: one copy
    in per dtype, one copy out per dtype holding a written one (BatchNorm writes all
    three: running mean and variance in float32, the batch count in int64)."""
    devices, _ = VARIANTS[variant]
    replicas, dtypes = len(devices), 2
    moves = _spy_buffer_moves(monkeypatch)
    model, count = _measure(variant, _TwoDtypes)
    plain_count = _count(*_plain(_TwoDtypes))
    params = list(model.parameters())
    assert {p.dtype for p in params} == {torch.float32, torch.float64}
    # in: one cat per dtype into each replica's flat buffer, nothing else reads them
    assert count.copies_of(params) == ["cat"] * (replicas * dtypes)
    buffers = list(model.buffers())
    assert {b.dtype for b in buffers} == {torch.float32, torch.int64}
    # buffers in: one cat per dtype per replica; the combined writes: one copy_ each
    assert collections.Counter(count.copies_of(buffers)) == {
        "cat": replicas * dtypes, "copy_": len(buffers)}
    # the moves between devices: one per dtype per replica per direction
    assert moves == {"in": replicas * dtypes, "out": replicas * dtypes}
    # out: one cat per dtype of each replica's gradients; synchronized BatchNorm adds one
    # cat of its sums per replica (with more than one)
    batch_norm_cats = replicas if replicas > 1 else 0
    assert count.ops["cat"] - plain_count.ops["cat"] == \
        2 * replicas * dtypes + replicas * dtypes + batch_norm_cats
    # the central gradients are views of the first replica's arrived buffers, not copies
    assert [op for op in count.copies_of([p.grad for p in params]) if op != "cat"] == []


def _spy_buffer_moves(monkeypatch) -> collections.Counter:
    """Counts the counted step's moves of buffers between the replicas' devices and the
    parameter device (:class:`csrun.core.distribute.broadcast.BufferMirror`)."""
    from csrun.core.distribute import buckets
    moves: collections.Counter = collections.Counter()
    transport = buckets._SameDevice
    real_in, real_out = transport.buffers_in, transport.buffers_out

    def counted_in(self, sources, flat):
        if _Counted.counting:
            moves["in"] += 1
        return real_in(self, sources, flat)

    def counted_out(self, flat):
        if _Counted.counting:
            moves["out"] += 1
        return real_out(self, flat)
    monkeypatch.setattr(transport, "buffers_in", counted_in)
    monkeypatch.setattr(transport, "buffers_out", counted_out)
    return moves


# -- same seed, same model ----------------------------------------------------------------
class _Moves:
    """Stands in for the move to a parameter device this machine lacks: the ``meta``
    device plays it (nothing can be moved there in place), the moves are recorded."""

    def __init__(self, monkeypatch, strategy):
        self.moved: list = []
        store = strategy.extended.store
        monkeypatch.setattr(store, "_torch_param", torch.device("meta"))
        monkeypatch.setattr(parameters, "_move_in_place",
                            lambda tensor, device: self.moved.append((tensor, device)))


def test_a_model_built_in_scope_has_the_plain_loops_weights_whatever_the_device(monkeypatch):
    """With the parameters elsewhere than the CPU, a model built in scope is initialized
    on the CPU, as ``torch.manual_seed(s); Net().to(device)`` is, then moved there whole
    when the scope ends: the same objects (an optimizer made in scope keeps them)."""
    strategy = cs.CentralStorageStrategy(["CPU:0"], "CPU:0")
    moves = _Moves(monkeypatch, strategy)
    torch.manual_seed(7)
    want = _net().state_dict()
    torch.manual_seed(7)
    with strategy.scope():
        model = _net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        built = {k: v.clone() for k, v in model.state_dict().items()}
        assert moves.moved == []  # nothing moves while the scope builds
    assert built.keys() == want.keys()
    assert all(torch.equal(built[k], want[k]) for k in want)
    tensors = list(model.parameters()) + list(model.buffers())
    moved = [id(t) for t, _ in moves.moved]
    assert sorted(moved) == sorted(id(t) for t in tensors)  # each of them, once
    assert {d for _, d in moves.moved} == {torch.device("meta")}
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters()))


def test_a_model_used_before_its_scope_ends_is_placed_first(monkeypatch):
    """Called, trained or stepped inside the scope, the model is placed first."""
    strategy = cs.CentralStorageStrategy(["CPU:0"], "CPU:0")
    moves = _Moves(monkeypatch, strategy)
    with strategy.scope():
        model = _net()
        model.eval()
        model(torch.randn(2, 8))  # cross-replica call: placed, then run
        assert len(moves.moved) == len(list(model.parameters()) + list(model.buffers()))
        late = torch.nn.Linear(2, 2)
        strategy.extended.store.begin_run(reads=False)  # every run places first
        assert moves.moved[-1][0] is late.bias


def test_meta_construction_in_scope_allocates_on_the_parameter_device():
    """The opt-out for models too big to build on the host: built under
    ``torch.device("meta")``, each tensor is allocated where the parameters live and
    initialized there by the module's own reset."""
    strategy = cs.CentralStorageStrategy(["CPU:0"], "CPU:0")
    with strategy.scope(), torch.device("meta"):
        layer = torch.nn.Linear(4, 3)
    assert layer.weight.device.type == "cpu" and not layer.weight.is_meta
    assert layer.weight.abs().sum() > 0  # initialized, not left empty


# -- where reduce puts the loss -----------------------------------------------------------
def test_reduce_and_gather_leave_values_on_their_accelerator():
    """A loss reduced from GPU replicas stays on the GPU (a copy to the host would wait
    for it every step); ``meta`` stands in for the GPU here. CPU values still go to the
    current device, as in TF."""
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
    on_device = cs.PerReplica([torch.ones(2, device="meta"), torch.ones(2, device="meta")])
    assert strategy.reduce("SUM", on_device).device.type == "meta"
    assert strategy.reduce("MEAN", on_device, axis=0).device.type == "meta"
    assert strategy.gather(on_device, axis=0).device.type == "meta"
    mixed = cs.PerReplica([torch.ones(2), torch.ones(2, device="meta")])
    assert strategy.reduce("SUM", mixed).device.type == "meta"
    on_host = cs.PerReplica([torch.ones(2), torch.ones(2)])
    assert strategy.reduce("SUM", on_host).device.type == "cpu"


# -- on a GPU -----------------------------------------------------------------------------
def _gpu_loop(devices: list, parameter: str):
    _, step, distribute = _csrun(devices, None, parameter=parameter)
    return step, distribute(_batches(WARM_STEPS + 3))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("devices", [["GPU:0"], ["GPU:0", "GPU:1"]],
                         ids=["1 GPU", "2 GPUs"])
def test_a_gpu_step_never_waits_for_the_gpu(devices):
    """BatchNorm, dropout, Adam and the reduced loss, parameters on GPU:0: torch raises
    on any call that makes the host wait for the GPU. With 2 GPUs, synchronized
    BatchNorm's all-reduces order the replicas' streams with events, replica 1's buffers
    move in one copy per dtype each way, its gradients in one per bucket."""
    if torch.cuda.device_count() < len(devices):
        pytest.skip(f"needs {len(devices)} GPUs")
    step, batches = _gpu_loop(devices, "GPU:0")
    for x, y in batches[:WARM_STEPS]:
        step(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = [step(x, y) for x, y in batches[WARM_STEPS:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(loss.device == torch.device("cuda", 0) for loss in losses)
    assert all(torch.isfinite(torch.stack(losses)).tolist())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_model_built_in_scope_on_a_gpu_has_the_plain_loops_weights():
    strategy = cs.CentralStorageStrategy(["GPU:0"], "GPU:0")
    torch.manual_seed(3)
    want = _net().to("cuda:0").state_dict()
    torch.manual_seed(3)
    with strategy.scope():
        model = _net()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    got = model.state_dict()
    assert all(got[k].device == torch.device("cuda", 0) for k in got)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(a is b for a, b in zip(opt.param_groups[0]["params"], model.parameters()))


# -- what the buffer-write rule relies on -------------------------------------------------
def test_batch_norm_kernels_still_write_running_stats_without_a_version_bump():
    """csrun finds a replica's writes to a buffer by its version counter, except for
    BatchNorm's running statistics, which torch's kernels write in place unversioned
    (parameters._written_by_kernel). If torch starts bumping them, the rule is moot but
    harmless; if another buffer stops bumping, its writes are lost: this says which."""
    bn = torch.nn.BatchNorm1d(4)
    before = [t._version for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    bn(torch.randn(8, 4))
    after = [t._version for t in (bn.running_mean, bn.running_var, bn.num_batches_tracked)]
    assert after[:2] == before[:2] and after[2] == before[2] + 1
    assert not torch.equal(bn.running_mean, torch.zeros(4))  # written all the same


def test_unsynchronized_batch_norm_in_replicas_updates_the_running_stats():
    """Three replicas, each BatchNorm on its own slice: their written (unversioned)
    running means are averaged, as TF's MEAN aggregation of a per-replica update."""
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1", "CPU:2"], "CPU:0",
                                         options=cs.StrategyOptions(sync_batch_norm=False))
    with strategy.scope():
        bn = torch.nn.BatchNorm1d(2, momentum=1.0)
    x = torch.arange(12.0).reshape(6, 2)
    strategy.run(bn, args=(strategy.experimental_distribute_values_from_function(
        lambda ctx: x[2 * ctx.replica_id_in_sync_group:][:2]),))
    assert bn.running_mean.tolist() == x.mean(0).tolist()
    assert int(bn.num_batches_tracked) == 1


# -- the random-number watch of logical CPU replicas --------------------------------------
def _reads(monkeypatch) -> list:
    from csrun.core.distribute import replica_random, replica_run
    reads: list = []
    real = replica_random.global_state

    def counted():
        reads.append(1)
        return real()
    monkeypatch.setattr(replica_random, "global_state", counted)
    monkeypatch.setattr(replica_run, "global_state", counted)
    return reads


def test_the_watch_reads_the_generator_once_a_run_while_nothing_draws_between(monkeypatch):
    """Replicas that do not draw are watched for a first draw every run; while nothing
    draws between runs either, the last run's end stands for the next one's start."""
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
    x = torch.ones(4, 8)
    for _ in range(4):
        strategy.run(lambda v: v.sum(), args=(x,))
    reads = _reads(monkeypatch)
    strategy.run(lambda v: v.sum(), args=(x,))
    assert len(reads) == 1
    torch.rand(1)  # the user's own draw between runs: seen moved at this run's end...
    strategy.run(lambda v: v.sum(), args=(x,))
    strategy.run(lambda v: v.sum(), args=(x,))  # ... so the next reads both ends
    assert len(reads) == 1 + 1 + 2


@pytest.mark.parametrize("execution", ["ordered", "concurrent"])
def test_replicas_that_start_drawing_get_their_streams_back(execution):
    """Concurrent replicas get their streams back from the run after their first draw
    (the watch reads both ends of every run); replicas in order, watched once a run, a
    run later (their draws from the global generator are in replica order: they repeat)."""
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0",
                                         options=cs.StrategyOptions(execution=execution))
    x = torch.ones(4, 8)
    for _ in range(4):
        strategy.run(lambda v: v.sum(), args=(x,))
    armed = []
    for _ in range(3):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            strategy.run(lambda v: F.dropout(v, 0.5), args=(x,))
        armed.append(strategy.extended._policy._armed)
    assert armed == ([False, True, True] if execution == "ordered" else [True, True, True])


# -- the engine's own work in an empty step (issue 36: its cost is Python bookkeeping) ----
def _empty_step(replicas: int = 2, execution: str = "auto"):
    """benchmarks/throughput.py's empty step (run + reduce of an identity function),
    warmed up until the policy is steady."""
    strategy = cs.CentralStorageStrategy([f"CPU:{i}" for i in range(replicas)], "CPU:0",
                                         options=cs.StrategyOptions(execution=execution))
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor(float(ctx.replica_id_in_sync_group)))

    def step():
        return strategy.reduce("SUM", strategy.run(lambda x: x, args=(value,)))
    for _ in range(WARM_STEPS + 2):
        step()
    policy = strategy.extended._policy
    for _ in range(100):  # a replica held up by a busy machine makes a few runs count as
        if policy._steady:  # long ones: warm on until the policy is back to steady
            break
        step()
    return strategy, step


def test_an_empty_step_enters_a_bounded_number_of_functions(monkeypatch):
    """The whole empty 2-replica step (issue 36's engine cost) as a count of the Python
    functions it enters: 67 before issue 36's third round, 53 after it, 45 after its
    fourth (each replica's context pushed, called in and popped in one frame; no frames
    for empty flushes, the compiler check and comprehensions), 31 after its fifth (the
    replica context and entry made in that frame, one bound body, no closure; no frames
    for the current device, the op's name, the output watch, the thread capture and
    split, the PerReplica; the servings checked in one), 30 after its sixth (the watch
    reads the generator's fields in one C call); a change that adds to every run shows
    here, on any machine, before the benchmark sees it."""
    _, step = _empty_step()
    work = calls(step)
    assert sum(work.values()) <= 30, work
    assert work["push"] == work["pop"] == 0 and work["call_as_replica"] == 2
    assert work["ReplicaContext.__init__"] == work["Entry.__init__"] == 0
    assert work["ParameterStore.flush_pending"] == work["_prepare_for_compile"] == 0
    reads = _reads(monkeypatch)
    step()
    assert len(reads) == 1  # the watch: one read a run


def test_a_replicas_context_is_what_its_constructors_make():
    """``call_as_replica`` sets the fields of a replica's ReplicaContext and stack
    Entry without entering their constructors: the same fields, the same values."""
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
    entries = []
    strategy.run(lambda: entries.append(context.current_entry()))
    for local_id, entry in enumerate(entries):
        replica = entry.replica
        made = context.ReplicaContext(strategy, local_id, replica._run, local_id)
        assert vars(replica) == vars(made) and type(replica) is context.ReplicaContext
        expected = context.Entry(strategy, replica, replica._run.servings[local_id])
        assert [getattr(entry, f) for f in context.Entry.__slots__] == \
            [getattr(expected, f) for f in context.Entry.__slots__]
        assert entry.serving is not None and not hasattr(entry, "__dict__")


def test_a_runs_per_replica_output_is_what_its_constructor_makes():
    """``regroup`` builds run's PerReplica outputs without entering ``__init__``: the
    same type, slots and values as ``PerReplica(values)``, and no field more."""
    strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
    out = strategy.run(lambda: cs.get_replica_context().replica_id_in_sync_group)
    made = values.PerReplica([0, 1])
    assert type(out) is values.PerReplica and not hasattr(out, "__dict__")
    assert type(out._values) is tuple and out._values == made._values == (0, 1)
    nested = strategy.run(lambda: {"id": [cs.get_replica_context()
                                          .replica_id_in_sync_group]})
    assert type(nested["id"][0]) is values.PerReplica and nested["id"][0].values == (0, 1)


def test_a_run_that_reads_no_parameters_serves_and_hands_over_nothing():
    """Nothing read, nothing written: the run's parameter views are the last run's
    (untouched), none is served ahead, no output is walked for a later hand-over. A run
    that reads gets fresh views, and its gradient is handed over as before."""
    strategy, step = _empty_step()
    work = calls(step)
    assert work["ReplicaServing.__init__"] == 0
    assert work["ParameterStore._serve_again"] == work["_graph_tensors"] == 0
    with strategy.scope():
        layer = torch.nn.Linear(2, 1, bias=False)
    x = torch.ones(4, 2)

    def reading():
        strategy.run(lambda v: layer(v).sum().backward(), args=(x,))
    assert calls(reading)["ReplicaServing.__init__"] == 0  # the untouched ones, now read
    assert torch.equal(layer.weight.grad, torch.full((1, 2), 8.0))  # x, whole, on both
    layer.weight.grad = None
    work = calls(reading)  # the last run's views were read: made anew, served ahead
    assert work["ReplicaServing.__init__"] == 2 and work["ParameterStore._serve_again"] == 1
    assert torch.equal(layer.weight.grad, torch.full((1, 2), 8.0))
    assert calls(step)["ReplicaServing.__init__"] == 2  # the reading run's are not reused


def test_reducing_cpu_losses_checks_and_adds_in_one_pass():
    """A PerReplica of plain CPU tensors reduced onto the CPU: one function checks and
    adds them (no per-value conversion, no destination search); anything else takes the
    general path, with its checks and messages."""
    strategy, _ = _empty_step()
    losses = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.tensor([1.0, 2.0]) * (ctx.replica_id_in_sync_group + 1))
    work = calls(functools.partial(strategy.reduce, "SUM", losses))
    assert work["reduce_values"] == work["destination"] == work["as_tensor"] == 0
    assert sum(work.values()) <= 6, work
    assert torch.equal(strategy.reduce("SUM", losses), torch.tensor([3.0, 6.0]))
    assert torch.equal(strategy.reduce("MEAN", losses), torch.tensor([1.5, 3.0]))
    ints = strategy.experimental_distribute_values_from_function(lambda ctx: torch.tensor(3))
    assert strategy.reduce("MEAN", ints).dtype == torch.float64  # TF's integer MEAN
    bools = strategy.experimental_distribute_values_from_function(lambda ctx: torch.tensor(True))
    with pytest.raises(TypeError, match="cannot reduce booleans"):
        strategy.reduce("SUM", bools)
    shapes = strategy.experimental_distribute_values_from_function(
        lambda ctx: torch.ones(ctx.replica_id_in_sync_group + 1))
    with pytest.raises(ValueError, match="shapes differ"):
        strategy.reduce("SUM", shapes)


def test_a_steady_run_asks_the_policy_only_what_it_needs(monkeypatch):
    """Streams off, replicas in order, nothing drawing: the policy answers start() from
    its steady state and after_run() from one read of the generator (issue 36: the watch
    was ~10 µs of an empty step). Draws still bring the streams back."""
    strategy, step = _empty_step()
    work = calls(step)
    policy = {k: n for k, n in work.items() if k.startswith(("ExecutionPolicy.", "RunSeed."))}
    assert not {"ExecutionPolicy.random", "ExecutionPolicy.before_run", "RunSeed.moved",
                "ExecutionPolicy._since_last", "ExecutionPolicy._settle_streams"} & set(policy)
    assert sum(policy.values()) <= 4, policy  # start, the seed's reset, after_run, _weigh
    reads = _reads(monkeypatch)
    step()
    assert len(reads) == 1
    _draws_arm_the_streams_again(strategy, step)


def _draws_arm_the_streams_again(strategy, step) -> None:
    """Replicas that draw random numbers arm the policy's streams: no longer steady."""
    x = torch.ones(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(2):
            strategy.run(lambda v: F.dropout(v, 0.5), args=(x,))
    assert strategy.extended._policy._armed
    assert "ExecutionPolicy.random" in calls(step)  # not steady while armed


@pytest.mark.parametrize("execution", ["ordered", "concurrent"])
def test_a_steady_policy_asks_as_little_when_the_execution_is_chosen(execution, monkeypatch):
    """With ``execution`` set, not ``auto``, the policy is steady too (review: it was
    ``auto`` only): replicas in order read the generator once a run, replicas at once at
    both ends of every run (their draws would interleave: seen in the run they happen),
    and nothing else is asked. Draws still bring the streams back."""
    strategy, step = _empty_step(execution=execution)
    assert strategy.extended._policy.state == execution
    work = calls(step)
    policy = {k: n for k, n in work.items() if k.startswith(("ExecutionPolicy.", "RunSeed."))}
    assert not {"ExecutionPolicy.random", "ExecutionPolicy.before_run", "ExecutionPolicy.team",
                "ExecutionPolicy._judge", "ExecutionPolicy._since_last", "RunSeed.moved",
                "ExecutionPolicy._settle_streams"} & set(policy), policy
    assert sum(policy.values()) <= (4 if execution == "ordered" else 5), policy
    reads = _reads(monkeypatch)
    step()
    assert len(reads) == (1 if execution == "ordered" else 2)
    _draws_arm_the_streams_again(strategy, step)
