"""csrun's private torch uses (csrun.core.distribute.torch_internals) against this torch.

Each test exercises one name of ``torch_internals`` the way csrun relies on it and fails
naming that name and the torch version when torch renamed or changed what it stands for.
Then: no private torch use outside that module; the global hooks and patches csrun
installs go with the last strategy; ``import csrun.core`` takes no process-wide state.
"""

from __future__ import annotations

import ast
import contextlib
import ctypes
import datetime
import functools
import gc
import os
import subprocess
import struct
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import csrun.core as cs
from csrun.core.distribute import parameters, sync_batch_norm
from csrun.core.distribute import torch_internals as ti

ROOT = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def relied_on(name: str):
    """Any failure inside says which internal broke, with which torch."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - re-raised as the test's failure
        pytest.fail(f"torch_internals.{name} no longer works as csrun relies on it with "
                    f"torch {torch.__version__}: {type(exc).__name__}: {exc}")


def _run_python(code: str, timeout: int = 300, env: dict | None = None) -> str:
    """Run ``code`` in a fresh interpreter; its stdout (fails with its stderr)."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


# -- each internal against the installed torch ---------------------------------------
def test_any_autocast_enabled():
    with relied_on("any_autocast_enabled"):
        assert ti.any_autocast_enabled() is False
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert ti.any_autocast_enabled() is True
        assert ti.any_autocast_enabled() is False


def test_inference_mode_and_set_grad_enabled():
    with relied_on("InferenceMode / set_grad_enabled"):
        with ti.InferenceMode(True):
            assert torch.is_inference_mode_enabled() and not torch.is_grad_enabled()
            with ti.InferenceMode(False):
                assert not torch.is_inference_mode_enabled()
        assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
        try:
            ti.set_grad_enabled(False)
            assert not torch.is_grad_enabled()
        finally:
            ti.set_grad_enabled(True)
        with ti.InferenceMode(False):  # leaving restores the grad mode set inside
            ti.set_grad_enabled(False)
        assert torch.is_grad_enabled()


def test_function_mode_depth():
    with relied_on("function_mode_depth"):
        assert ti.function_mode_depth() == 0
        with torch.device("cpu"):  # a default device is a function mode
            assert ti.function_mode_depth() == 1
            with torch.overrides.TorchFunctionMode():
                assert ti.function_mode_depth() == 2
        assert ti.function_mode_depth() == 0


class _Recording(dict):
    """A module dict that records how torch reaches it."""

    def __init__(self, items, log):
        super().__init__(items)
        self.log = log

    def __getitem__(self, name):
        self.log.append(("get", name))
        return dict.__getitem__(self, name)

    def __setitem__(self, name, value):
        self.log.append(("set", name))
        dict.__setitem__(self, name, value)

    def items(self):
        self.log.append(("items",))
        return dict.items(self)


def test_tensor_dict_is_what_module_reads_and_writes():
    # parameters.ServedDict relies on every parameter and buffer access of a module
    # passing through the dict object tensor_dict returns
    with relied_on("tensor_dict / set_tensor_dict"):
        layer = nn.BatchNorm1d(2)
        params, buffers = ti.tensor_dict(layer, "parameter"), ti.tensor_dict(layer, "buffer")
        assert set(params) == {"weight", "bias"} and params["weight"] is layer.weight
        assert {"running_mean", "running_var", "num_batches_tracked"} <= set(buffers)
        log = []
        ti.set_tensor_dict(layer, "parameter", _Recording(params, log))
        ti.set_tensor_dict(layer, "buffer", _Recording(buffers, log))

        def reached(action) -> list:
            log.clear()
            action()
            return list(log)
        assert reached(lambda: layer.weight) == [("get", "weight")]
        assert reached(lambda: layer.running_mean) == [("get", "running_mean")]
        assert ("set", "weight") in reached(
            lambda: setattr(layer, "weight", nn.Parameter(torch.zeros(2))))
        assert ("set", "extra") in reached(
            lambda: layer.register_buffer("extra", torch.ones(1)))
        assert ("items",) in reached(lambda: dict(layer.named_parameters(recurse=False)))
        assert isinstance(ti.tensor_dict(layer, "parameter"), _Recording)
        fresh = nn.Module()
        for kind in ("parameter", "buffer"):  # what release_modules gives back
            plain = ti.plain_tensor_dict({"x": None})
            assert type(plain) is type(ti.tensor_dict(fresh, kind)) and plain == {"x": None}


def test_tensor_dicts_are_the_dicts_a_module_reads():
    with relied_on("tensor_dicts"):
        bn = nn.BatchNorm1d(2)
        params, buffers = ti.tensor_dicts(bn)
        assert params is ti.tensor_dict(bn, "parameter") and list(params) == ["weight", "bias"]
        assert buffers is ti.tensor_dict(bn, "buffer") and "running_mean" in buffers


def test_route_module_calls_sees_every_module_call():
    seen = []
    with relied_on("route_module_calls / restore_module_calls"):
        torchs = nn.Module.__call__

        def ours(module, *args, **kwargs):
            seen.append(type(module).__name__)
            return torchs(module, *args, **kwargs)
        assert ti.route_module_calls(ours) is torchs
        try:
            model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            out = model(torch.ones(1, 2))
        finally:
            ti.restore_module_calls(torchs, ours)
        assert seen == ["Sequential", "Linear", "ReLU"] and out.shape == (1, 2)
        assert nn.Module.__call__ is torchs
        ti.route_module_calls(ours)
        nn.Module.__call__ = len  # a later patch of someone else's stays
        try:
            ti.restore_module_calls(torchs, ours)
            assert nn.Module.__call__ is len
        finally:
            nn.Module.__call__ = torchs


def test_compiled_module_type_and_compiled_original():
    with relied_on("compiled_module_type / compiled_original"):
        model = nn.Linear(2, 2)
        compiled = torch.compile(model, backend="eager")
        assert ti.compiled_module_type() is type(compiled)
        assert ti.compiled_original(compiled) is model
        assert not isinstance(model, ti.compiled_module_type())


def test_tensor_version():
    with relied_on("tensor_version"):
        t = torch.zeros(3)
        v = ti.tensor_version(t)
        t + 1  # noqa: B018
        assert ti.tensor_version(t) == v
        t.add_(1)
        assert ti.tensor_version(t) == v + 1


def test_has_post_accumulate_grad_hook():
    with relied_on("has_post_accumulate_grad_hook"):
        leaf = torch.ones(2, requires_grad=True)
        seen = []

        def hook(tensor):
            seen.append(tensor)
        assert not ti.has_post_accumulate_grad_hook(leaf, hook)
        handle = leaf.register_post_accumulate_grad_hook(hook)
        assert ti.has_post_accumulate_grad_hook(leaf, hook)
        assert not ti.has_post_accumulate_grad_hook(leaf, lambda t: None)
        leaf.sum().backward()
        assert seen == [leaf]
        handle.remove()
        assert not ti.has_post_accumulate_grad_hook(leaf, hook)


def test_grad_hooks_lists_a_tensors_hooks_in_order():
    with relied_on("grad_hooks"):
        p = nn.Parameter(torch.ones(2))
        assert ti.grad_hooks(p) == ([], [])
        first, second, post = (lambda g: g * 2), (lambda g: g + 1), (lambda t: None)
        handle = p.register_hook(first)
        p.register_hook(second)
        p.register_post_accumulate_grad_hook(post)
        assert ti.grad_hooks(p) == ([first, second], [post])
        handle.remove()
        assert ti.grad_hooks(p) == ([second], [post])
        (p * 1).sum().backward()  # what torch runs on the gradient: the listed hooks
        assert p.grad.tolist() == [2.0, 2.0]


def test_route_hook_registration_notes_every_registration():
    noted = []
    with relied_on("route_hook_registration / restore_hook_registration"):
        torchs = ti.route_hook_registration(noted.append)
        try:
            p = nn.Parameter(torch.ones(2))
            handle = p.register_hook(lambda g: g * 3)
            p.register_post_accumulate_grad_hook(lambda t: None)
            assert noted == [p, p]
            (p * 1).sum().backward()
            assert p.grad.tolist() == [3.0, 3.0]  # torch's registration still happened
            handle.remove()
        finally:
            ti.restore_hook_registration(torchs)
        assert {n: getattr(torch.Tensor, n) for n in torchs} == torchs


def test_current_backward_id_and_queue_backward_callback():
    with relied_on("current_backward_id / queue_backward_callback"):
        assert ti.current_backward_id() == -1
        a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
        ids, grads_when_called = [], []

        def callback():
            grads_when_called.append((a.grad is not None, b.grad is not None))

        def hook(_):
            ids.append(ti.current_backward_id())
            if len(ids) == 1:
                ti.queue_backward_callback(callback)
        a.register_post_accumulate_grad_hook(hook)
        b.register_post_accumulate_grad_hook(hook)
        ((a * 2).sum() + (b * 3).sum()).backward()
        (a * 2).sum().backward()
        assert ids[0] == ids[1] != -1 and ids[2] not in (-1, ids[0])
        assert grads_when_called == [(True, True)]  # once, after the whole backward


def test_foreach_add_():
    with relied_on("foreach_add_"):
        xs = [torch.ones(2), torch.full((3,), 2.0, dtype=torch.float64)]
        ys = [torch.tensor([1.0, 2.0]), torch.ones(3, dtype=torch.float64)]
        ti.foreach_add_(xs, ys)
        assert xs[0].tolist() == [2.0, 3.0] and xs[1].tolist() == [3.0] * 3


def test_pytree_leaves():
    with relied_on("pytree_leaves"):
        x = torch.tensor([[1.0, 3.0], [2.0, 0.0]])
        result = torch.max(x, 0)  # a torch.return_types structseq
        leaves = ti.pytree_leaves({"m": result, "l": [x]})
        assert len(leaves) == 3 and all(isinstance(leaf, torch.Tensor) for leaf in leaves)
        assert ti.pytree_leaves(object) == [object]  # not a container: itself


@pytest.mark.process  # starts a fresh interpreter
def test_compiler_in_use_only_once_compile_was_called():
    out = _run_python("""
        import sys, torch
        import csrun.core
        from csrun.core.distribute import torch_internals as ti
        print(ti.compiler_in_use(), "torch._dynamo" in sys.modules)
        torch.compile(lambda x: x + 1, backend="eager")(torch.ones(1))
        print(ti.compiler_in_use())
    """)
    assert out.split() == ["False", "False", "True"], \
        f"torch_internals.compiler_in_use with torch {torch.__version__}: {out}"


@pytest.mark.process  # starts a fresh interpreter
def test_compile_first_used_inside_a_run_matches_eager():
    # The compiled-read fallback is wrapped with torch.compiler.disable once compile is
    # in use (the first run after it was): a model compiled inside the very first run
    # still trains as eager. No torch.optim here: it imports torch's compiler itself.
    out = _run_python("""
        import torch
        import csrun.core as cs
        from csrun.core.distribute import parameters

        def train(compiled):
            strategy = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
            torch.manual_seed(0)
            with strategy.scope():
                model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                            torch.nn.Linear(8, 1))
            forward = []
            (batch,) = strategy.experimental_distribute_dataset(
                [torch.arange(16.0).reshape(4, 4) / 16])

            def step(v):
                if not forward:
                    forward.append(torch.compile(model, backend="eager") if compiled
                                   else model)
                loss = forward[0](v).pow(2).sum()
                loss.backward()
            for _ in range(3):
                strategy.run(step, args=(batch,))
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
                        p.grad = None
            return [p.detach().clone() for p in model.parameters()]
        compiled = train(True)
        assert parameters._eager_serve is not None
        eager = train(False)
        print(all(torch.allclose(a, b, atol=1e-6) for a, b in zip(eager, compiled)))
    """)
    assert out.split() == ["True"]


def test_is_batch_norm():
    with relied_on("is_batch_norm"):
        norms = [nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.BatchNorm3d(2), nn.SyncBatchNorm(2),
                 nn.LazyBatchNorm1d(), nn.LazyBatchNorm2d(), nn.LazyBatchNorm3d()]
        others = [nn.InstanceNorm1d(2), nn.LayerNorm(2), nn.GroupNorm(1, 2), nn.Linear(2, 2)]
        assert [ti.is_batch_norm(m) for m in norms] == [True] * len(norms)
        assert [ti.is_batch_norm(m) for m in others] == [False] * len(others)


def test_check_batch_norm_input():
    with relied_on("check_batch_norm_input"):
        ti.check_batch_norm_input(nn.BatchNorm2d(2), torch.ones(1, 2, 3, 3))
        with pytest.raises(ValueError, match="4D"):
            ti.check_batch_norm_input(nn.BatchNorm2d(2), torch.ones(1, 2, 3))


def test_generator_state_bytes():
    with relied_on("generator_state_bytes"):
        g = torch.Generator().manual_seed(3)
        before = ti.generator_state_bytes(g)
        assert before == g.get_state().numpy().tobytes()
        torch.rand(4, generator=g)
        assert ti.generator_state_bytes(g) != before
        assert ti.generator_state_bytes(g) == g.get_state().numpy().tobytes()


def test_generator_fingerprint():
    """The replicas' watch reads the global generator's seed, position, first word and
    normal samples where torch's C++ CPU generator keeps them, found on a probe
    generator set to known values and checked against get_state() step by step; a read
    that misses a field fails that check (and get_state()'s fields stand in)."""
    with relied_on("generator_fingerprint (the CPU generator's C++ fields)"):
        probe = ti._probe_generator()
        start = ti._engine_fields_at(probe)
        assert start is not None
        assert ti._tracks_the_state(ti._memory_fingerprint(probe, start), probe)
        assert isinstance(ti.generator_fingerprint, functools.partial)
        whole = ti.generator_state_bytes()
        seed, left, seeded, at, word = struct.unpack_from("<QiiQQ", whole)
        assert ti.generator_fingerprint()[:5] == (seed, left, seeded, at, word)
        values = struct.Struct("<QiB3xII2492x4xIB3xQB")  # the samples' values too
        memory = (ctypes.c_char * values.size).from_address(probe._cdata + start)
        assert not ti._tracks_the_state(lambda: values.unpack_from(memory), probe)
    g = torch.Generator()
    assert ti._tracks_the_state(lambda: ti._state_fingerprint(g), g)
    assert not ti._tracks_the_state(lambda: ti._state_fingerprint(g)[:32], g)  # no cache
    assert not ti._tracks_the_state(lambda: (lambda s: s[:24] + s[32:])(
        ti._state_fingerprint(g)), g)  # no first word: a wrap goes unseen


def test_the_generator_watch_falls_back_where_the_fields_are_not_found(monkeypatch):
    """No fields found in the C++ generator: get_state()'s; those failing too: the
    whole state."""
    assert isinstance(ti._watch_fingerprint(), functools.partial)
    real = ti._memory_fingerprint
    with monkeypatch.context() as patch:  # the global generator read elsewhere than found
        patch.setattr(ti, "_memory_fingerprint", lambda generator, start: real(
            generator, start) if generator is not torch.default_generator else lambda: ())
        assert ti._watch_fingerprint() is ti._state_fingerprint
    with monkeypatch.context() as patch:
        patch.setattr(ti, "_CPU_STATE_SIZE", 4)  # a state layout csrun does not know
        assert ti._watch_fingerprint() is ti.generator_state_bytes
    with monkeypatch.context() as patch:
        patch.setattr(ti, "_probe_generator", lambda: 1 / 0)  # a torch unlike these
        assert ti._watch_fingerprint() is ti.generator_state_bytes
    with torch.device("meta"):  # the probe's ops stay on the CPU
        assert isinstance(ti._watch_fingerprint(), functools.partial)
    monkeypatch.setattr(ti, "_engine_fields_at", lambda generator: None)
    assert ti._watch_fingerprint() is ti._state_fingerprint
    monkeypatch.setattr(ti, "_tracks_the_state", lambda read, g: False)
    assert ti._watch_fingerprint() is ti.generator_state_bytes


def test_op_overload_and_op_takes_generator():
    with relied_on("OpOverload / op_takes_generator"):
        seen = []

        class Watch(torch.overrides.TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                seen.append(func)
                return func(*args, **(kwargs or {}))
        half = torch.full((2,), 0.5)
        with Watch():
            torch.ops.aten.bernoulli.default(half)
        assert isinstance(seen[0], ti.OpOverload)
        assert ti.op_takes_generator(torch.ops.aten.bernoulli.default)
        assert not ti.op_takes_generator(torch.ops.aten.add.Tensor)


def test_private_samplers_take_a_generator():
    with relied_on("PRIVATE_SAMPLERS"):
        gamma, dirichlet = ti.PRIVATE_SAMPLERS  # both: a missing one is a renamed one
        assert (gamma, dirichlet) == (torch._standard_gamma, torch._sample_dirichlet)
        for sampler in ti.PRIVATE_SAMPLERS:
            draws = [sampler(torch.ones(4), generator=torch.Generator().manual_seed(5))
                     for _ in range(2)]
            assert torch.equal(*draws)


def test_rng_state_functions_are_what_checkpointing_and_fork_rng_call():
    from torch.utils.checkpoint import checkpoint
    calls = []
    real = (torch.get_rng_state, torch.set_rng_state)

    def get_state():
        calls.append("get")
        return real[0]()

    def set_state(state):
        calls.append("set")
        real[1](state)
    with relied_on("replace_rng_state_functions / restore_rng_state_functions"):
        replaced = ti.replace_rng_state_functions(get_state, set_state)
        try:
            assert replaced == real
            assert torch.random.get_rng_state is get_state
            x = torch.ones(3, requires_grad=True)
            for reentrant in (True, False):
                calls.clear()
                checkpoint(lambda v: torch.nn.functional.dropout(v * 2, 0.5), x,
                           use_reentrant=reentrant).sum().backward()
                # forward: save; recompute: fork_rng saves, restores the forward's, restores
                assert calls == ["get", "get", "set", "set"], (reentrant, calls)
        finally:
            ti.restore_rng_state_functions(replaced, (get_state, set_state))
        assert (torch.get_rng_state, torch.set_rng_state) == real
        assert torch.random.set_rng_state is real[1]
        # a later patch of someone else's stays
        ti.replace_rng_state_functions(get_state, set_state)
        torch.get_rng_state = len
        try:
            ti.restore_rng_state_functions(real, (get_state, set_state))
            assert torch.get_rng_state is len and torch.set_rng_state is real[1]
        finally:
            torch.get_rng_state = real[0]


def test_function_modes_lists_this_threads_modes_and_none_in_a_backward():
    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    seen = []

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(ti.function_modes())
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(ti.function_modes())
            return grad * 2
    with relied_on("function_modes"):
        mode = Mode()
        assert ti.function_modes() == []
        with mode:
            Probe.apply(torch.ones(2, requires_grad=True)).sum().backward()
        assert seen == [[mode], []]


def _devices_seen_on_a_thread() -> tuple:
    """What another thread reads, and where its factory functions allocate."""
    seen = []
    thread = threading.Thread(
        target=lambda: seen.append((ti.default_device(), torch.empty(0).device)))
    thread.start()
    thread.join()
    return seen[0]


def test_default_device_follows_every_way_of_setting_it():
    # torch.get_default_device() raised AttributeError after set(x), set(None) and ignored
    # `with torch.device(...)` on older releases (2.4 both): csrun asks this instead
    with relied_on("default_device"):
        assert ti.default_device() == torch.device("cpu")
        with torch.device("meta"):
            assert ti.default_device() == torch.device("meta")
            with torch.device("cpu"):  # the innermost wins
                assert ti.default_device() == torch.device("cpu")
            assert ti.default_device() == torch.device("meta")
        try:
            torch.set_default_device("meta")
            assert ti.default_device() == torch.device("meta") == torch.empty(0).device
            with torch.device("cpu"):
                assert ti.default_device() == torch.device("cpu") == torch.empty(0).device
            read, allocated = _devices_seen_on_a_thread()  # (thread-local on some releases)
            assert read == allocated
        finally:
            torch.set_default_device(None)
        assert ti.default_device() == torch.device("cpu") == torch.empty(0).device


def test_default_device_agrees_with_what_a_factory_function_allocates_on():
    with relied_on("default_device"):
        for enter in (lambda: torch.device("meta"), contextlib.nullcontext):
            with enter():
                assert ti.default_device() == torch.empty(0).device


def test_state_dict_hooks_run_with_the_module_and_torchs_arguments():
    calls = []

    def save(module, state, prefix, local_metadata):
        calls.append(("save", module, prefix))
        state[prefix + "weight"] = torch.full_like(state[prefix + "weight"], 7.0)

    def load_pre(module, state, prefix, local_metadata, strict, missing, unexpected, errors):
        calls.append(("load", module, prefix, strict))
        state[prefix + "weight"] = state[prefix + "weight"] * 2

    with relied_on("register_state_dict_hooks"):
        inner = nn.Linear(2, 2)
        ti.register_state_dict_hooks(inner, save, load_pre)
        outer = nn.Sequential(inner)
        state = outer.state_dict()
        assert torch.equal(state["0.weight"], torch.full((2, 2), 7.0))
        outer.load_state_dict(state)
        assert torch.equal(inner.weight.detach(), torch.full((2, 2), 14.0))
        assert calls == [("save", inner, "0."), ("load", inner, "0.", True)]


class _Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b


def test_pytree_node_flatten_and_unflatten():
    import torch.utils._pytree as pytree
    with relied_on("pytree_node / pytree_flatten / pytree_unflatten"):
        assert ti.pytree_node(dict) and not ti.pytree_node(_Pair)
        pytree.register_pytree_node(_Pair, lambda p: ([p.a, p.b], None),
                                    lambda children, _: _Pair(*children))
        try:
            assert ti.pytree_node(_Pair)
            leaves, spec = ti.pytree_flatten(_Pair(torch.ones(1), [torch.zeros(2)]))
            assert [t.tolist() for t in leaves] == [[1.0], [0.0, 0.0]]
            again = ti.pytree_unflatten([t + 1 for t in leaves], spec)
            assert type(again) is _Pair and again.b[0].tolist() == [1.0, 1.0]
        finally:
            pytree.SUPPORTED_NODES.pop(_Pair, None)


def test_dynamo_tracing_and_the_compiled_function():
    with relied_on("dynamo_tracing / compiled_function_original"):
        assert ti.dynamo_tracing() is False

        def probe(x):
            return x + 1, ti.dynamo_tracing()
        compiled = torch.compile(probe, backend="eager")
        assert compiled(torch.ones(1))[1] is True
        assert ti.compiled_function_original(compiled) is probe
        assert ti.compiled_function_original(probe) is None


def test_compiles_in_replicas_from_its_release():
    with relied_on("compiles_in_replicas"):
        release = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
        assert ti.compiles_in_replicas() == (release >= ti.COMPILED_REPLICAS_SINCE)
        assert isinstance(ti.compiler_inlines_modules(), bool)


def test_uses_openmp_reads_torchs_report():
    with relied_on("uses_openmp"):
        lines = [line for line in torch.__config__.parallel_info().splitlines()
                 if line.startswith("ATen parallel backend:")]
        assert len(lines) == 1, "parallel_info() no longer names the backend"
        assert ti.uses_openmp() == lines[0].endswith("OpenMP")


_needs_gomp = pytest.mark.skipif(ti.torch_gnu_openmp() is None,
                                 reason="torch here does not run on GNU OpenMP")


@_needs_gomp
def test_torch_gnu_openmp_is_the_runtime_torch_runs_on():
    with relied_on("torch_gnu_openmp / GnuOpenMP"):
        omp = ti.torch_gnu_openmp()
        assert os.path.basename(omp.path).startswith("libgomp")
        before = torch.get_num_threads()
        torch.set_num_threads(2)
        seen = []

        def member(_):
            torch.ones(1 << 22).sum()  # parallel in ATen, were it not inside a region
            seen.append((omp.thread_num(), omp.num_threads(), omp.in_parallel()))
        try:
            torch.ones(1 << 22).sum()  # the caller's team exists, as after any torch op
            threads = len(os.listdir("/proc/self/task"))
            omp.parallel(member, 2)
        finally:
            torch.set_num_threads(before)
        assert sorted(seen) == [(0, 2, 1), (1, 2, 1)]
        # torch's kernels saw the region (no team of their own, no new thread): it is
        # their runtime, not a second one
        assert len(os.listdir("/proc/self/task")) == threads
        assert omp.in_parallel() == 0


def test_gloo_group_on_a_chosen_device():
    with relied_on("gloo_group"):
        store = dist.HashStore()
        device = dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")
        timeout = datetime.timedelta(seconds=30)
        groups, errors = {}, []

        def join(rank):
            try:
                groups[rank] = ti.gloo_group(dist.PrefixStore("t", store), rank, 2, timeout,
                                             device)
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
        threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        sent, received = torch.arange(3.0), torch.zeros(3)
        work = groups[0].send([sent], 1, 0)
        groups[1].recv([received], 0, 0).wait()
        work.wait()
        assert received.tolist() == [0.0, 1.0, 2.0]


# -- nowhere else --------------------------------------------------------------------
_KNOWN_PRIVATE = {"_parameters", "_buffers", "_modules", "_version", "_execution_engine",
                  "_post_accumulate_grad_hooks", "_schema", "_check_input_dim", "_Options",
                  "_devices", "_timeout", "_BatchNorm", "_C", "_ops", "_dynamo", "_pytree"}
# csrun's own names that torch also uses privately (accessed on csrun's objects)
_CSRUN_OWN = {"_values": "DistributedValues' components (values.py)"}
# private uses that are no torch internals
_ALLOWED = {("cli/entry.py", "ctypes"): "PR_SET_PDEATHSIG through libc, the CLI's own"}


def _torch_private_names() -> set[str]:
    """Private attribute names of the torch objects csrun handles."""
    def private(names):
        return {n for n in names if n.startswith("_") and not n.startswith("__")}
    p = nn.Parameter(torch.ones(1))
    names = set(_KNOWN_PRIVATE)
    for obj in (torch.Tensor, nn.BatchNorm2d, nn.BatchNorm2d(2), torch.optim.Optimizer,
                torch.optim.SGD([p], lr=1.0), torch.Generator, torch.autograd.graph.Node,
                torch.ops.aten.add.Tensor, dist.ProcessGroupGloo,
                dist.ProcessGroupGloo._Options()):
        names |= private(dir(obj)) | private(getattr(obj, "__dict__", {}))
    return names - set(_CSRUN_OWN)


def _torch_aliases(tree: ast.Module) -> set[str]:
    """Names bound to torch or a torch module in this file (``torch``, ``dist``, ``F``)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    names.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            names.update(a.asname or a.name for a in node.names)
    return names


def _private_uses(path: Path, private: set[str]) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    aliases = _torch_aliases(tree)
    slots = {id(c) for n in ast.walk(tree) if isinstance(n, ast.Assign)
             and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in n.targets)
             for c in ast.walk(n.value)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names
                                       if (node.module or "").startswith("torch")]
            for module in modules:
                parts = module.split(".")
                if parts[0] == "ctypes" or (parts[0] == "torch" and any(
                        p.startswith("_") and not p.startswith("__") for p in parts)):
                    found.append((node.lineno, f"import of {module}"))
        elif isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            root = base.id if isinstance(base, ast.Name) else None
            if root in aliases and any(p.startswith("_") and not p.startswith("__")
                                       for p in chain):
                found.append((node.lineno, ".".join([root, *reversed(chain)])))
            elif node.attr in private and root not in ("self", "cls"):
                found.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in slots:
            value = node.value
            if value in private or (value.startswith("torch.") and "._" in value):
                found.append((node.lineno, f"the string {value!r}"))
    return sorted(set(found))


def test_no_private_torch_use_outside_torch_internals():
    private = _torch_private_names()
    internals = ROOT / "core" / "distribute" / "torch_internals.py"
    problems = []
    for path in sorted([*(ROOT / "core").rglob("*.py"), *(ROOT / "cli").rglob("*.py")]):
        if path == internals:
            continue
        where = path.relative_to(ROOT).as_posix()
        for line, what in _private_uses(path, private):
            if not any(where == f and what.endswith(rule) for f, rule in _ALLOWED):
                problems.append(f"{where}:{line}: {what}")
    assert not problems, ("private torch internals outside core/distribute/"
                          "torch_internals.py (add a named function there, with why):\n"
                          + "\n".join(problems))


def test_the_scan_finds_private_uses(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(textwrap.dedent("""\
        import ctypes
        import sys
        import torch
        import torch.distributed as dist
        import torch.utils._pytree as pytree
        from torch.nn.modules.batchnorm import _BatchNorm


        class Own:
            __slots__ = ("_devices", "_values")

            def f(self, module, t, options, value):
                torch._C._is_any_autocast_enabled()
                t._post_accumulate_grad_hooks
                module.__dict__["_parameters"] = {}
                "torch._dynamo" in sys.modules
                dist.ProcessGroupGloo._Options()
                options._devices
                self._devices, value._values, torch.__config__, sys._getframe
        """))
    assert _private_uses(sample, _torch_private_names()) == [
        (1, "import of ctypes"), (5, "import of torch.utils._pytree"),
        (6, "import of torch.nn.modules.batchnorm._BatchNorm"),
        (13, "torch._C"), (13, "torch._C._is_any_autocast_enabled"),
        (14, "._post_accumulate_grad_hooks"), (15, "the string '_parameters'"),
        (16, "the string 'torch._dynamo'"), (17, "dist.ProcessGroupGloo._Options"),
        (18, "._devices")]


# -- hooks and patches live as long as strategies ----------------------------------------
def _ours(hooks: dict) -> list:
    return [h for h in hooks.values() if getattr(h, "__module__", "").startswith("csrun.")]


@pytest.mark.process  # starts a fresh interpreter
def test_hooks_go_with_the_last_strategy_and_come_back_with_the_next():
    # in a fresh process: here other tests' strategies may still be alive
    out = _run_python("""
        import gc
        import threading
        import torch
        import torch.nn.modules.module as M
        import torch.optim.optimizer as O
        import csrun.core as cs

        def ours():
            dicts = (M._global_parameter_registration_hooks,
                     M._global_buffer_registration_hooks, O._global_optimizer_pre_hooks)
            return [sum(h.__module__.startswith("csrun.") for h in d.values())
                    for d in dicts] + [int(M.Module.__call__.__module__.startswith("csrun."))]

        def train(strategy):
            with strategy.scope():
                model = torch.nn.Linear(2, 1, bias=False)
                opt = torch.optim.SGD(model.parameters(), lr=0.5)
            with torch.no_grad():
                model.weight.fill_(1.0)
            (x,) = strategy.experimental_distribute_dataset([torch.ones(4, 2)])
            strategy.run(lambda v: model(v).sum().backward(), args=(x,))
            opt.step()
            return model.weight.tolist()

        print(ours())
        first, second = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0"), \\
            cs.CentralStorageStrategy(["CPU:0"], "CPU:0")
        print(ours())
        del first
        gc.collect()
        print(ours())
        del second
        gc.collect()
        print(ours())
        again = cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
        print(ours(), train(again))

        def churn():  # strategies made and collected on several threads at once
            for _ in range(25):
                cs.CentralStorageStrategy(["CPU:0"], "CPU:0")
                gc.collect()
        threads = [threading.Thread(target=churn) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print(ours())
        del again
        gc.collect()
        print(ours())
    """)
    assert out.splitlines() == ["[0, 0, 0, 0]", "[1, 1, 1, 1]", "[1, 1, 1, 1]",
                                "[0, 0, 0, 0]", "[1, 1, 1, 1] [[-1.0, -1.0]]",
                                "[1, 1, 1, 1]", "[0, 0, 0, 0]"]


@pytest.mark.process  # starts a fresh interpreter
def test_rng_state_functions_and_hook_methods_are_csruns_while_strategies_live():
    # in a fresh process: here other tests' strategies may still be alive
    out = _run_python("""
        import gc
        import torch
        import csrun.core as cs
        from csrun.core.distribute import replica_random

        def ours():
            return (torch.get_rng_state is replica_random.get_rng_state,
                    torch.random.set_rng_state is replica_random.set_rng_state)

        hook_methods = (torch.Tensor.register_hook,
                        torch.Tensor.register_post_accumulate_grad_hook)

        print(ours())
        one = cs.CentralStorageStrategy(["CPU:0"], "CPU:0")  # one replica: no streams
        print(ours())
        first, second = [cs.CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
                         for _ in range(2)]
        print(ours())
        del first
        gc.collect()
        print(ours())
        print((torch.Tensor.register_hook, torch.Tensor.register_post_accumulate_grad_hook)
              == hook_methods)
        del second, one
        gc.collect()
        print(ours(), (torch.Tensor.register_hook,
                       torch.Tensor.register_post_accumulate_grad_hook) == hook_methods)
    """)
    assert out.splitlines() == ["(False, False)", "(False, False)", "(True, True)",
                                "(True, True)", "False", "(False, False) True"]


def _strategy(n=2):
    return cs.CentralStorageStrategy([f"CPU:{i}" for i in range(n)], "CPU:0")


def test_a_model_outlives_its_strategy_as_a_plain_module():
    strategy = _strategy()
    with strategy.scope():
        model = nn.Sequential(nn.Linear(2, 4), nn.BatchNorm1d(4))
    bn = model[1]
    assert isinstance(ti.tensor_dict(bn, "buffer"), parameters.ServedDict)
    assert isinstance(bn.__dict__["forward"], functools.partial)
    (x,) = strategy.experimental_distribute_dataset([torch.arange(8.0).reshape(4, 2)])
    strategy.run(lambda v: model(v).sum().backward(), args=(x,))
    del strategy, x
    gc.collect()
    torchs = type(ti.tensor_dict(nn.Module(), "parameter"))
    for module in model.modules():
        for kind in ("parameter", "buffer"):
            assert type(ti.tensor_dict(module, kind)) is torchs
    assert "forward" not in bn.__dict__
    weight = model[0].weight
    model(torch.ones(3, 2)).sum().backward()  # plain torch from now on
    assert model[0].weight is weight and weight.grad is not None


def test_a_dead_strategy_leaves_what_another_adopted_since():
    first, second = _strategy(), _strategy()
    with first.scope():
        bn = nn.BatchNorm1d(3)
    with second.scope():
        bn.register_buffer("extra", torch.zeros(1))  # second adopts it now
    del first
    gc.collect()
    assert ti.tensor_dict(bn, "buffer").store is second.extended.store
    assert "forward" in bn.__dict__
    del second
    gc.collect()
    assert type(ti.tensor_dict(bn, "buffer")) is type(ti.tensor_dict(nn.Module(), "buffer"))
    assert "forward" not in bn.__dict__


def test_uninstall_leaves_a_forward_of_the_users_own():
    bn = nn.BatchNorm1d(2)
    bn.forward = lambda x: x
    sync_batch_norm.uninstall(bn)
    assert "forward" in bn.__dict__


def test_hooks_are_installed_while_a_strategy_lives():
    import torch.nn.modules.module as nn_module
    import torch.optim.optimizer as optim_module
    strategy = _strategy()  # noqa: F841 - alive while checked
    assert _ours(nn_module._global_parameter_registration_hooks) == [parameters._on_parameter]
    assert _ours(nn_module._global_buffer_registration_hooks) == [parameters._on_buffer]
    assert _ours(optim_module._global_optimizer_pre_hooks) == [
        parameters._before_optimizer_step]


# -- import csrun.core takes nothing process-wide ------------------------------------
_STATE = """
import atexit, faulthandler, gc, logging, os, signal, sys, threading, warnings
import torch
import torch.nn.modules.module as nn_module
import torch.optim.optimizer as optim_module

calls = []

def record(owner, name):
    real = getattr(owner, name)
    def recording(*args, **kwargs):
        calls.append(f"{getattr(owner, '__name__', owner)}.{name}")
        return real(*args, **kwargs)
    setattr(owner, name, recording)

for owner, name in [(os, "register_at_fork"), (atexit, "register"), (signal, "signal"),
                    (sys, "addaudithook"), (sys, "settrace"), (sys, "setprofile"),
                    (threading, "settrace"), (threading, "setprofile"),
                    (faulthandler, "enable"), (faulthandler, "register"),
                    (threading.Thread, "start"), (torch, "set_num_threads"),
                    (torch, "set_default_dtype"), (torch, "set_default_device"),
                    (torch, "manual_seed")]:
    record(owner, name)

def snapshot():
    hooks = {f"{m.__name__}.{k}": list(v) for m in (nn_module, optim_module)
             for k, v in vars(m).items() if k.startswith("_global") and isinstance(v, dict)}
    return {
        "signal handlers": {s.name: signal.getsignal(s) for s in signal.valid_signals()
                            if isinstance(s, signal.Signals)},
        "warnings.showwarning": warnings.showwarning, "warnings.filters": list(warnings.filters),
        "sys.excepthook": sys.excepthook, "sys.unraisablehook": sys.unraisablehook,
        "sys.displayhook": sys.displayhook, "sys.breakpointhook": sys.breakpointhook,
        "threading.excepthook": threading.excepthook,
        "threads": sorted(t.name for t in threading.enumerate()),
        "os threads": len(os.listdir("/proc/self/task")),
        "gc.callbacks": list(gc.callbacks), "gc.isenabled": gc.isenabled(),
        "recursion limit": sys.getrecursionlimit(), "switch interval": sys.getswitchinterval(),
        "root logger": (logging.root.level, list(logging.root.handlers)),
        "environment": dict(os.environ), "umask": os.umask(os.umask(0o22)),
        "torch global hooks": hooks, "torch threads": torch.get_num_threads(),
        "torch dtype": torch.get_default_dtype(),
        "torch function modes": torch.overrides._get_current_function_mode_stack(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul precision": torch.get_float32_matmul_precision(),
        "rng": torch.random.get_rng_state().tolist(),
    }

before = snapshot()
import csrun.core  # noqa: E402,F401
after = snapshot()
for k in sorted(k for k in before if before[k] != after[k]):
    print(f"changed {k}: {before[k]!r:.200} -> {after[k]!r:.200}")
for call in calls:
    print(f"called {call}")
if "torch._dynamo" in sys.modules:
    print("imported torch._dynamo (~1.7 s, and it sets an environment variable)")
"""


@pytest.mark.process  # starts a fresh interpreter
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads /proc (Linux)")
def test_import_takes_no_process_wide_state():
    out = _run_python(_STATE)
    assert out == "", "import csrun.core took process-wide state:\n" + out


def test_tensor_private_description_names_attributes_every_tensor_has():
    tensor = torch.zeros(2, requires_grad=True)
    for name in ti.TENSOR_PRIVATE_DESCRIPTION:
        getattr(tensor, name)  # an AttributeError: torch renamed it
