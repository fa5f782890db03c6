"""CentralStorageStrategy: the one-machine case of the parameter-server engine.

As in TensorFlow, :class:`CentralStorageStrategy` is a thin front over
:class:`ParameterServerStrategyExtended` (the engine): parameters live on one parameter
device, compute is replicated over the compute devices, gradients are summed onto the
parameter device and the optimizer updates once there. ``ParameterServerStrategy`` reuses
the same engine with a cluster.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import warnings
from typing import Any, Callable, Iterable

import torch

from . import context
from .batch_split import MODES, BatchBalancer
from .context import (Entry, ReplicaContext, call_as_replica, cross_replica_required,
                      require_cross_replica_or_default)
from .cross_device_ops import Collectives
from .devices import (LogicalDevice, default_compute_devices, default_parameter_device,
                      resolve_device, resolve_devices)
from .input import (DistributedDataset, DistributedDatasetsFromFunction, Feeder, InputContext,
                    InputOptions, TensorSliceDataset, ValueContext, place_values)
from .buckets import DEFAULT_BYTES_PER_PACK
from .parameters import ParameterStore, eager_if_uncompilable, serve_while
from .reduce import (SPELLINGS, ReduceOp, as_tensor, current_device, destination,
                     gather_values, reduce_on_cpu, reduce_values)
from .replica_run import ExecutionPolicy, ReplicaAborted, ReplicaExecutor, ReplicaRun
from .values import (DistributedValues, Mirrored, PerReplica, flatten, local_results,
                     map_structure, regroup, unstack)
from .variables import Variable

__all__ = ["Strategy", "CentralStorageStrategy", "ParameterServerStrategyExtended",
           "StrategyOptions", "RunOptions", "get_strategy", "get_replica_context"]


@dataclasses.dataclass(frozen=True)
class StrategyOptions:
    """csrun's engine settings (TF has no equivalent; the defaults need no change).

    Attributes:
      copy_parameters: give every replica its own copy of the parameters even on the
        parameter's own device (the copy path GPUs use; lets CPU-only CI exercise it).
      execution: ``"auto"`` (replicas run concurrently when that keeps results
        reproducible, see ``ExecutionPolicy``), ``"ordered"`` (TF's replica order) or
        ``"concurrent"``.
      sync_batch_norm: BatchNorm created in scope normalizes with global-batch statistics.
      batch_split: how a global batch is split over the replicas: ``"even"`` (TF's
        equal shares), ``"balanced"`` (in proportion to each replica's measured speed,
        see :mod:`.batch_split`), or ``"auto"``: balanced for replicas on different
        kinds of device (GPU and CPU), else even.
      bytes_per_pack: the most bytes a replica that computes on a copy of the parameters
        (a GPU, or ``copy_parameters``) moves in one copy: its parameters and gradients
        cross in buckets of this size, the gradients while the backward still runs (TF's
        ``CommunicationOptions.bytes_per_pack``; DDP's ``bucket_cap_mb``). 0: one copy
        per dtype each way. Default 25 MiB.
    """

    copy_parameters: bool = False
    execution: str = "auto"
    sync_batch_norm: bool = True
    batch_split: str = "auto"
    bytes_per_pack: int = DEFAULT_BYTES_PER_PACK

    def __post_init__(self):
        if self.execution not in ("auto", "ordered", "concurrent"):
            raise ValueError(f"execution must be 'auto', 'ordered' or 'concurrent', got "
                             f"{self.execution!r}")
        if self.batch_split not in MODES:
            raise ValueError(f"batch_split must be 'auto', 'even' or 'balanced', got "
                             f"{self.batch_split!r}")
        size = self.bytes_per_pack
        if isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise ValueError(f"bytes_per_pack must be an integer >= 0 (0: one copy per "
                             f"dtype), got {size!r}")


@dataclasses.dataclass
class RunOptions:
    """TF's ``tf.distribute.RunOptions``; accepted for compatibility, no effect here."""

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: Any = None


class _Scope:
    """``strategy.scope()``: makes the strategy current in cross-replica context."""

    __slots__ = ("_strategy", "_entry")

    def __init__(self, strategy: "Strategy"):
        self._strategy = strategy
        self._entry = None

    def __enter__(self) -> "Strategy":
        current = context.current_entry()
        _check_not_mixing(current, self._strategy)
        cross_replica_required("strategy.scope()")  # TF's rule: scope() is cross-replica
        self._entry = Entry(self._strategy)
        context.push(self._entry)
        return self._strategy

    def __exit__(self, *exc) -> None:
        context.pop(self._entry)
        self._entry = None
        # what was built on the CPU in scope goes to the parameter device now
        self._strategy.extended.store.place_pending()


def _check_not_mixing(current: Entry, strategy: "Strategy") -> None:
    if current.strategy is not None and current.strategy is not strategy:
        raise RuntimeError(
            f"Mixing different strategies: {strategy!r} cannot enter its scope "
            f"inside the scope of {current.strategy!r}")


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated; use {new}", DeprecationWarning, stacklevel=3)


def _tpu_only(name: str) -> NotImplementedError:
    return NotImplementedError(f"{name} is TPU-only in TensorFlow (TPUStrategy); "
                               "a CentralStorageStrategy has no logical TPU cores")


class Strategy:
    """TF's ``tf.distribute.Strategy`` API over an engine (``self.extended``)."""

    def __init__(self, extended: "ParameterServerStrategyExtended"):
        self._extended = extended

    # -- attributes ----------------------------------------------------------------------
    @property
    def extended(self) -> "ParameterServerStrategyExtended":
        """The engine, with TF's ``StrategyExtended`` methods."""
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """How many replicas compute each step (gradients are aggregated over them)."""
        return self._extended.num_replicas_in_sync

    @property
    def cluster_resolver(self):
        """The cluster resolver (None on one machine, as in TF)."""
        return self._extended.cluster_resolver

    def scope(self) -> _Scope:
        """Make this strategy current; modules and Variables created inside live on the
        parameter device. ``run`` and ``reduce`` enter it for you."""
        return _Scope(self)

    # -- running -------------------------------------------------------------------------
    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None,
            options: RunOptions | None = None) -> Any:
        """Call ``fn`` once per replica with that replica's part of ``args``/``kwargs``.

        Returns a PerReplica (or a nest of them) of the replicas' results; a result that
        is the same object on every replica, or any result with one replica, is returned
        as it is. Parameters of modules created in scope are served on each replica's
        device, and when the replicas are done their gradients are summed into the
        central ``.grad``.

        Example::

            def step(x, y):
                loss = F.cross_entropy(model(x), y, reduction="sum") / global_batch
                loss.backward()
                return loss
            losses = strategy.run(step, args=(x, y))
            optimizer.step()
        """
        if options is not None and not isinstance(options, RunOptions):
            raise TypeError(f"options must be a RunOptions, got {type(options).__name__}")
        # Only the scope's check: each replica pushes its own context, and nothing else
        # in run reads the caller's (entering the scope would cost ~5 µs a step).
        entry = context.current_entry()
        if entry.replica is not None:
            cross_replica_required("run")
        if entry.strategy is not None and entry.strategy is not self:
            _check_not_mixing(entry, self)
        return self._extended.call_for_each_replica(fn, args, kwargs)

    def experimental_run_v2(self, fn, args=(), kwargs=None, options=None):
        """Deprecated alias of :meth:`run` (its TF 2.0/2.1 name)."""
        _deprecated("experimental_run_v2", "run")
        return self.run(fn, args, kwargs, options)

    def experimental_run(self, fn: Callable, input_iterator=None) -> Any:
        """TF v1: run ``fn`` on the next element of ``input_iterator`` (or no input)."""
        args = () if input_iterator is None else (input_iterator.get_next(),)
        return self.run(fn, args=args)

    # -- reducing ------------------------------------------------------------------------
    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        """Reduce ``value`` across replicas (and along ``axis`` when given).

        The result goes to the current default device (``torch.get_default_device()``,
        the CPU unless set), TF's "current device"; with the CPU there, values on a GPU
        stay on the GPU (the first replica's that is on one), so reducing a GPU loss
        does not wait for the GPU. Nests are reduced leaf by leaf.
        """
        require_cross_replica_or_default(self, "reduce")
        op = SPELLINGS.get(reduce_op) if type(reduce_op) is str else None
        if op is None:  # (a name known by one lookup, without resolve's call)
            op = ReduceOp.resolve(reduce_op)
        if type(value) is PerReplica:  # run's output: the usual case, without the detours
            values = value._values
            if axis is None:
                total = reduce_on_cpu(op, values)  # (onto the CPU: asks no device)
                if total is not None:
                    return total
            return reduce_values(op, values, axis, destination(values, current_device()))
        device = current_device()
        return map_structure(lambda v: self._reduce_leaf(op, v, axis, device), value) \
            if isinstance(value, (tuple, list, dict)) else \
            self._reduce_leaf(op, value, axis, device)

    def _reduce_leaf(self, op: ReduceOp, value: Any, axis: int | None, device) -> Any:
        if isinstance(value, DistributedValues):
            return reduce_values(op, value.values, axis, destination(value.values, device))
        replicas = self._extended.num_local_replicas
        if axis is None:
            _check_not_ambiguous(op, value, replicas)
            return value
        tensor = as_tensor(value.value() if isinstance(value, Variable) else value)
        return reduce_values(op, [tensor] * replicas, axis, destination([tensor], device))

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate the replicas' components along ``axis`` on the current device
        (values on a GPU stay there, as in :meth:`reduce`)."""
        require_cross_replica_or_default(
            self, "gather", "use get_replica_context().all_gather() instead")
        device = current_device()

        def leaf(v):
            values = v.values if isinstance(v, DistributedValues) else [v]
            return gather_values(values, axis, destination(values, device))
        return map_structure(leaf, value)

    def experimental_local_results(self, value: Any) -> tuple:
        """The per-replica components of ``value`` as a tuple (``(value,)`` if plain)."""
        return local_results(value, self._extended.num_local_replicas)

    def unwrap(self, value: Any) -> tuple:
        """TF v1 name of :meth:`experimental_local_results`."""
        return self.experimental_local_results(value)

    def group(self, value: Any, name: str | None = None) -> None:
        """TF v1: group ops for graph mode; nothing to do in eager PyTorch."""
        return None

    # -- input ---------------------------------------------------------------------------
    def experimental_distribute_dataset(self, dataset: Iterable,
                                        options: InputOptions | None = None):
        """Split each global batch of ``dataset`` across the replicas (see ``input.py``)."""
        return DistributedDataset(self, dataset, options)

    def distribute_datasets_from_function(self, dataset_fn: Callable,
                                          options: InputOptions | None = None):
        """Deal per-replica batches of ``dataset_fn(InputContext)`` to the replicas."""
        return DistributedDatasetsFromFunction(self, dataset_fn, options)

    def experimental_distribute_datasets_from_function(self, dataset_fn, options=None):
        """Deprecated alias of :meth:`distribute_datasets_from_function`."""
        _deprecated("experimental_distribute_datasets_from_function",
                    "distribute_datasets_from_function")
        return self.distribute_datasets_from_function(dataset_fn, options)

    def experimental_distribute_values_from_function(self, value_fn: Callable) -> Any:
        """A PerReplica of ``value_fn(ValueContext)`` for each replica (nests: per leaf).

        A tensor ``value_fn`` made on another torch device than its replica's moves to
        the replica's (TF would copy it when the replica's op reads it; torch would fail).
        """
        ext = self._extended
        values = place_values(
            [value_fn(ValueContext(ext.replica_offset + r, self.num_replicas_in_sync))
             for r in range(ext.num_local_replicas)],
            [d.torch_device for d in ext.compute_devices])
        if len(values) == 1:
            return map_structure(lambda v: PerReplica([v]), values[0])
        return regroup(values, collapse_identical=False)

    def experimental_make_numpy_dataset(self, numpy_input: Any) -> TensorSliceDataset:
        """Deprecated in TF: a dataset of slices of ``numpy_input``; batch it yourself."""
        _deprecated("experimental_make_numpy_dataset",
                    "torch.utils.data.TensorDataset (or csrun.core.TensorSliceDataset)")
        return self._extended.experimental_make_numpy_dataset(numpy_input)

    def make_dataset_iterator(self, dataset: Iterable):
        """TF v1: an iterator over ``experimental_distribute_dataset(dataset)``."""
        return _InitializableIterator(lambda: iter(self.experimental_distribute_dataset(dataset)))

    def make_input_fn_iterator(self, input_fn: Callable, replication_mode=None):
        """TF v1: an iterator over ``distribute_datasets_from_function(input_fn)``."""
        options = None if replication_mode is None else \
            InputOptions(experimental_replication_mode=replication_mode)
        return _InitializableIterator(
            lambda: iter(self.distribute_datasets_from_function(input_fn, options)))

    # -- graph-era and TPU-only API ------------------------------------------------------
    def configure(self, session_config=None, cluster_spec=None, task_type=None, task_id=None):
        """TF v1 configuration hook; nothing to configure on one machine."""
        return None

    def update_config_proto(self, config_proto):
        raise NotImplementedError(
            "update_config_proto edits a TF session ConfigProto; PyTorch has no sessions or "
            "graphs, so there is nothing to update")

    def colocate_vars_with(self, colocate_with_variable):
        return self._extended.colocate_vars_with(colocate_with_variable)

    def experimental_assign_to_logical_device(self, tensor, logical_device_id):
        raise _tpu_only("experimental_assign_to_logical_device")

    def experimental_replicate_to_logical_devices(self, tensor):
        raise _tpu_only("experimental_replicate_to_logical_devices")

    def experimental_split_to_logical_devices(self, tensor, partition_dimensions):
        raise _tpu_only("experimental_split_to_logical_devices")

    def __repr__(self) -> str:
        ext = self._extended
        return (f"{type(self).__name__}(compute_devices="
                f"{[d.short_name for d in ext.compute_devices]}, "
                f"parameter_device={ext.parameter_device.short_name!r})")


class _InitializableIterator:
    """TF v1 InputIterator: ``initialize()`` (re)starts it, ``get_next()`` advances."""

    def __init__(self, make: Callable[[], Any]):
        self._make = make
        self._iterator = None

    def initialize(self) -> list:
        self._iterator = self._make()
        return []

    def get_next(self) -> Any:
        if self._iterator is None:
            self.initialize()
        return next(self._iterator)

    def __iter__(self):
        return self

    __next__ = get_next


def _check_not_ambiguous(op: ReduceOp, value: Any, replicas: int) -> None:
    """TF's rule for a non-distributed value: the same on every replica, so its SUM over
    several replicas is ambiguous (unless it is zero); MEAN is the value itself."""
    if op is ReduceOp.SUM and replicas > 1 and not _is_zero(value):
        raise ValueError(
            f"A non-distributed value {value!r:.80} cannot be reduced with SUM across "
            f"{replicas} replicas: it is the same on every replica, so the sum is "
            "ambiguous. Reduce run's per-replica output, or use MEAN.")


def _single_value(value: Any) -> Any:
    """TF's ``_select_single_value`` for update's arguments: a variable is updated once,
    with one value. TF takes a PerReplica's first component whatever the others hold;
    csrun takes it when every component equals it, and refuses values that differ (the
    others' would be dropped without a word)."""
    if isinstance(value, DistributedValues):
        first, others = value.values[0], value.values[1:]
        if any(not _same_value(first, other) for other in others):
            raise ValueError(
                f"extended.update got a {type(value).__name__} whose {len(value.values)} "
                "components differ: a variable is updated once, with one value, and TF "
                "would take the first replica's and drop the rest; reduce it first "
                "(strategy.reduce or extended.reduce_to), or pass one value")
        return first
    return value


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and \
            bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
    try:
        return bool(a == b)
    except (TypeError, ValueError, RuntimeError):
        return False


def _is_zero(value: Any) -> bool:
    try:
        tensor = as_tensor(value)
    except TypeError:
        return False
    return bool((tensor == 0).all())


class ParameterServerStrategyExtended:
    """The engine: device table, central parameter store, replicated calls, reductions.

    TF's ``StrategyExtended`` methods live here (``worker_devices``, ``reduce_to``,
    ``update``, ``colocate_vars_with``, ...).
    """

    def __init__(self, container: Strategy, compute: list[LogicalDevice],
                 parameter: LogicalDevice, parameter_spelling: str,
                 options: StrategyOptions | None = None, cluster_resolver=None,
                 num_workers: int = 1, worker_index: int = 0, store: ParameterStore | None = None):
        self._container = container
        self._compute = compute
        self._parameter = parameter
        self._parameter_spelling = parameter_spelling
        self.options = options if options is not None else StrategyOptions()
        self._cluster_resolver = cluster_resolver
        self._num_local_replicas = len(compute)
        self._replica_offset = worker_index * len(compute)
        self._num_replicas_in_sync = num_workers * len(compute)
        self._store = store if store is not None else ParameterStore(
            parameter, compute, self.options.copy_parameters)
        self._store.bytes_per_pack = self.options.bytes_per_pack
        serve_while(container, self._store)
        self._executor = ReplicaExecutor(f"csrun-{id(self):x}")
        self._body = self._replica_body  # every run's body, bound once
        self._executor.close_with(container)
        self._policy = ExecutionPolicy(compute, self.options.execution)
        self._streams = None
        self._has_gpu = any(d.is_gpu for d in compute)  # checked on every run
        # an argument can be on another replica's device only where the replicas are not
        # all the host's (logical CPUs): checked on every run
        self._arg_devices = [d.torch_device for d in compute]
        self._places_args = any(d.type != "cpu" for d in self._arg_devices)
        # Where replicas' all-reduces and all-gathers combine: the parameter device, but
        # GPU replicas of CPU parameters combine on the first GPU (a combination on the
        # host would wait for every GPU at each synchronized BatchNorm; the arithmetic,
        # in replica order, gives the same bits on either)
        self._collective_device = compute[0].torch_device if (
            parameter.torch_device.type == "cpu" and all(d.is_gpu for d in compute)) \
            else parameter.torch_device
        self._balancer = BatchBalancer(self.options.batch_split, compute)
        self._balanced = self._balancer.balanced  # checked on every run
        self._run_lock = threading.Lock()
        self._current_run = None  # the ReplicaRun in progress, for backwards that meet there

    @property
    def execution(self) -> str:
        """How the next run executes: ``"ordered"``, ``"concurrent"``, or ``"probe"``
        (ordered, still deciding; see ``ExecutionPolicy``)."""
        return self._policy.state

    # -- TF attributes -------------------------------------------------------------------
    @property
    def worker_devices(self) -> list[str]:
        """Canonical names of the compute devices, one per replica."""
        return [d.name for d in self._compute]

    @property
    def worker_devices_by_replica(self) -> list[list[str]]:
        return [[d.name] for d in self._compute]

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        """The parameter device, spelled as it was given (TF reports it that way)."""
        return (self._parameter_spelling,)

    @property
    def torch_devices(self) -> list[torch.device]:
        """The :class:`torch.device` of each replica (logical CPUs all map to ``cpu``)."""
        return list(self._store.torch_devices)

    @property
    def parameter_device(self) -> LogicalDevice:
        return self._parameter

    @property
    def current_run(self) -> ReplicaRun | None:
        """The run in progress, if any: a collective's backward after its own run has
        returned meets the other replicas there (``DataParallel``'s backward run)."""
        return self._current_run

    # -- for the rest of the engine (input, context, variables, collectives) ------------
    @property
    def compute_devices(self) -> list[LogicalDevice]:
        """The replicas' devices, in replica order."""
        return self._compute

    @property
    def store(self) -> ParameterStore:
        """The central parameters and what each replica was served of them."""
        return self._store

    @property
    def num_local_replicas(self) -> int:
        """Replicas on this machine (each step's input has this many components)."""
        return self._num_local_replicas

    @property
    def replica_offset(self) -> int:
        """The sync-group id of this machine's first replica (0 without a cluster)."""
        return self._replica_offset

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas of the whole sync group (all workers of a cluster)."""
        return self._num_replicas_in_sync

    @property
    def cluster_resolver(self):
        return self._cluster_resolver

    experimental_between_graph = True
    experimental_should_init = True
    should_checkpoint = True
    should_save_summary = True
    experimental_require_static_shapes = False

    # -- replicated calls ----------------------------------------------------------------
    def call_for_each_replica(self, fn: Callable, args: tuple = (),
                              kwargs: dict | None = None) -> Any:
        """Run ``fn`` on every replica (``Strategy.run`` without entering the scope)."""
        if type(args) is not tuple:
            if not isinstance(args, (tuple, list)):
                raise TypeError(f"args must be a tuple, got {type(args).__name__}")
            args = tuple(args)
        if not self._run_lock.acquire(False):
            self._refuse_nested()
        try:
            count = self._num_local_replicas
            replica_args = unstack(args, count)
            replica_kwargs = unstack(kwargs, count) if kwargs else None
            if self._places_args:
                replica_args, replica_kwargs = self._placed(replica_args, replica_kwargs)
            outputs = self._call(fn, replica_args, replica_kwargs)
            store = self._store
            if store.has_leaves and not store.direct:  # after the run: it cannot undo it
                store.watch_outputs(outputs)  # (no leaf yet: no graph can reach one)
            return outputs[0] if count == 1 else regroup(outputs)
        finally:
            self._run_lock.release()

    def _placed(self, replica_args: list, replica_kwargs: list | None) -> tuple:
        """Each replica's arguments with their tensors on its device: TF's ops read an
        input from wherever it is (copying it), torch's fail on another device, so a
        tensor elsewhere is copied now, once per device (a plain tensor passed to every
        replica, a batch already on a GPU given to a CPU replica)."""
        devices = self._arg_devices
        args = place_values(replica_args, devices)
        kwargs = place_values(replica_kwargs, devices) if replica_kwargs is not None \
            else None
        streams = self._replica_streams()
        if streams is not None:  # a copy made on the caller's stream, read on the replica's
            for r, stream in enumerate(streams):
                if stream is None:
                    continue
                for new, old in zip(flatten((args[r], kwargs and kwargs[r])),
                                    flatten((replica_args[r],
                                             replica_kwargs and replica_kwargs[r]))):
                    if new is not old and isinstance(new, torch.Tensor):
                        new.record_stream(stream)
        return args, kwargs

    def call_for_each_replica_split(self, fn: Callable, replica_args: list,
                                    replica_kwargs: list | None = None, *,
                                    backward: bool = False) -> list:
        """Call ``fn(*replica_args[r], **replica_kwargs[r])`` on every replica ``r``, as
        ``run`` does, with arguments already split per replica; the outputs as a list in
        replica order. Outputs are not watched for a later backward: the caller runs it
        (``DataParallel``'s gather runs each replica's backward as a run of its own,
        ``backward=True``: it reads no parameters, so the next run is served what the
        run before it read).

        Raises:
          ValueError: not one argument tuple (and kwargs dict) per replica.
          RuntimeError: called while this strategy runs.
        """
        count = self._num_local_replicas
        if len(replica_args) != count or (replica_kwargs is not None
                                          and len(replica_kwargs) != count):
            raise ValueError(f"call_for_each_replica_split needs the arguments of each of "
                             f"the {count} replicas, got {len(replica_args)}")
        self._enter_run()
        try:
            return self._call(fn, list(replica_args), replica_kwargs, not backward)
        finally:
            self._run_lock.release()

    def _enter_run(self) -> None:
        """Take the run lock (its caller releases it), or refuse a nested run."""
        if not self._run_lock.acquire(False):
            self._refuse_nested()

    @staticmethod
    def _refuse_nested() -> None:
        raise RuntimeError("strategy.run cannot be nested: this strategy is already "
                           "running (e.g. run called inside merge_call's merge_fn)")

    def _call(self, fn: Callable, replica_args: list, replica_kwargs: list | None,
              reads: bool = True) -> list:
        # The hot path of every step: an empty run's cost is all Python bookkeeping here.
        count, store, policy = self._num_local_replicas, self._store, self._policy
        servings = store.begin_run(reads)
        fn = eager_if_uncompilable(fn)  # (where this torch cannot compile in replicas)
        streams = self._replica_streams() if self._has_gpu else None
        body = self._body  # (one bound method: a closure made per run cost more)
        timing = self._balancer.begin_run(streams) if self._balanced else None
        if timing is not None:
            body = timing.wrap(body)
        call = (fn, replica_args, replica_kwargs, streams)
        if policy.fixed:  # one replica, or devices of their own: nothing to decide
            run = ReplicaRun(count, policy.concurrent, body, self._executor, None, servings,
                             self._collectives_for, call=call)
            snapshot = None
        else:
            concurrent, threads, random, team, snapshot = policy.start()
            run = ReplicaRun(count, concurrent, body, self._executor, threads,
                             servings, self._collectives_for, random, team, call)
        if streams is not None:
            self._start_streams(streams)
        self._current_run = run
        try:
            outputs = run.execute()
            if streams is not None:
                self._join_streams(streams)
            store.finish_run(servings, reads)
        except BaseException:
            store.discard_run(servings)
            if timing is not None:
                self._balancer.discard_run()
            raise
        finally:
            self._current_run = None
            run.release()
        if not policy.fixed:
            policy.after_run(snapshot, run.durations)
        if timing is not None:
            self._balancer.end_run(timing, replica_args, replica_kwargs)
        return outputs

    def _collectives_for(self, run: ReplicaRun) -> Collectives:
        return Collectives(run, self._container, self._store.torch_devices,
                           self._collective_device, self._streams,
                           self._balancer.active)

    def _replica_body(self, run: ReplicaRun, replica_id: int) -> Any:
        """One replica's call of the run's function (``run.call``: the function, each
        replica's args and kwargs, and its CUDA streams) in its replica context."""
        fn, replica_args, replica_kwargs, streams = run.call
        a = replica_args[replica_id]
        k = replica_kwargs[replica_id] if replica_kwargs is not None else None
        try:
            if streams is not None and streams[replica_id] is not None:
                device = self._compute[replica_id].torch_device
                with torch.cuda.device(device), torch.cuda.stream(streams[replica_id]):
                    return call_as_replica(self._container, self._replica_offset + replica_id,
                                           replica_id, run, run.servings[replica_id], fn, a, k)
            return call_as_replica(self._container, self._replica_offset + replica_id,
                                   replica_id, run, run.servings[replica_id], fn, a, k)
        except ReplicaAborted:
            raise
        except BaseException as exc:
            _note_replica(exc, replica_id, self._compute[replica_id])
            raise

    def _replica_streams(self) -> list | None:
        if not self._has_gpu:
            return None
        if self._streams is None:
            self._streams = [torch.cuda.Stream(d.torch_device) if d.is_gpu else None
                             for d in self._compute]
        return self._streams

    def _start_streams(self, streams) -> None:
        """Each replica's stream waits for work the caller queued (optimizer updates,
        arguments) on its own device and on the parameter device."""
        param = self._parameter.torch_device
        for device, stream in zip(self._compute, streams):
            if stream is None:
                continue
            stream.wait_stream(torch.cuda.current_stream(device.torch_device))
            if param.type == "cuda" and param != device.torch_device:
                stream.wait_stream(torch.cuda.current_stream(param))

    def _join_streams(self, streams) -> None:
        for device, stream in zip(self._compute, streams):
            if stream is not None:
                torch.cuda.current_stream(device.torch_device).wait_stream(stream)

    @property
    def batch_balancer(self) -> BatchBalancer:
        """How global batches are split over this machine's replicas (even or by speed)."""
        return self._balancer

    def input_feeder(self, options: InputOptions) -> Feeder:
        """What places each step's input on the replicas' devices (``input.py``)."""
        return Feeder(self._compute, options.experimental_fetch_to_device,
                      self._replica_streams())

    # -- TF StrategyExtended methods -----------------------------------------------------
    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any) -> Any:
        """Reduce ``value`` across replicas onto ``destinations`` (a device, a tensor or
        Variable -- its device --, or a DistributedValues: a Mirrored copy per replica).

        A value that is not distributed is the same on every replica, as in TF: MEAN
        returns it as it is, SUM across several replicas is a ValueError (unless zero).

        Raises:
          RuntimeError: inside a replica (use merge_call), or in another strategy's scope.
        """
        require_cross_replica_or_default(self._container, "extended.reduce_to")
        op = ReduceOp.resolve(reduce_op)
        if not isinstance(value, DistributedValues) and self._num_local_replicas > 1:
            _check_not_ambiguous(op, value, self._num_local_replicas)
            return value
        values = value.values if isinstance(value, DistributedValues) else [value]
        if isinstance(destinations, DistributedValues):
            result = reduce_values(op, values, None, self._parameter.torch_device)
            return Mirrored([result.to(d.torch_device, copy=True) for d in self._compute])
        return reduce_values(op, values, None, self._destination_device(destinations))

    def batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Iterable) -> list:
        """:meth:`reduce_to` for each ``(value, destinations)`` pair."""
        require_cross_replica_or_default(self._container, "extended.batch_reduce_to")
        return [self.reduce_to(reduce_op, v, d) for v, d in value_destination_pairs]

    def _destination_device(self, destinations: Any) -> torch.device:
        if isinstance(destinations, Variable):
            return destinations.tensor.device
        if isinstance(destinations, torch.Tensor):
            return destinations.device
        return resolve_device(destinations).torch_device

    def update(self, var: Any, fn: Callable, args: tuple = (), kwargs: dict | None = None,
               group: bool = True) -> Any:
        """Run ``fn(var, *args, **kwargs)`` once, in cross-replica context, where the
        variable lives; its result, or with ``group=False`` a tuple of its local results.

        Called by every replica inside ``run`` it merges into one call (TF 2.21's
        ``merge_call``), which each replica gets the result of. A per-replica argument
        (here, or a PerReplica given in cross-replica context) is updated with once: its
        value when every replica's is the same, else a ValueError (TF silently takes the
        first replica's).

        Raises:
          ValueError: ``var`` is not a variable (a :class:`Variable`, a parameter, or a
            tensor or buffer of the strategy), or an argument's components differ.
        """
        replica = context.current_entry().replica
        if replica is not None:
            return replica.merge_call(
                lambda _, *a, **k: self.update(var, fn, a, k, group), args, kwargs)
        if not self._is_variable(var):
            raise ValueError(f"extended.update cannot update {var!r:.80}: it must be a "
                             "variable (a csrun.core.Variable, or a module's parameter or "
                             "buffer)")
        args = map_structure(_single_value, tuple(args))
        kwargs = map_structure(_single_value, dict(kwargs or {}))
        with self._container.scope(), torch.no_grad():
            return self._grouped(fn(var, *args, **kwargs), group)

    def update_non_slot(self, colocate_with: Any, fn: Callable, args: tuple = (),
                        kwargs: dict | None = None, group: bool = True) -> Any:
        """Run ``fn(*args, **kwargs)`` once, in cross-replica context (see :meth:`update`
        for ``group``)."""
        require_cross_replica_or_default(self._container, "extended.update_non_slot")
        with self._container.scope():
            return self._grouped(fn(*args, **(kwargs or {})), group)

    def _grouped(self, result: Any, group: bool) -> Any:
        """TF: ``group=False`` gives each leaf's local results (a 1-tuple for a plain
        value)."""
        if group:
            return result
        return map_structure(lambda v: local_results(v, self._num_local_replicas), result)

    def _is_variable(self, var: Any) -> bool:
        if isinstance(var, (Variable, torch.nn.Parameter)):
            return True
        return isinstance(var, torch.Tensor) and (self._store.owns(var)
                                                  or self._store.holds_buffer(var))

    def non_slot_devices(self, var_list: Any) -> tuple[str, ...]:
        return (self._parameter.name,)

    def colocate_vars_with(self, colocate_with_variable: Any):
        """Variables created inside go where ``colocate_with_variable`` lives (here: all
        variables already share the parameter device).

        Raises:
          RuntimeError: outside this strategy's scope (TF: "Need to be inside ``with
            strategy.scope()``").
          ValueError: ``colocate_with_variable`` is not a variable created in this
            strategy's scope (another strategy's, a plain one, a tensor), as in TF.
        """
        self.check_colocation_target(colocate_with_variable)
        return contextlib.nullcontext()

    def check_colocation_target(self, var: Any) -> None:
        """TF's checks of ``colocate_vars_with``'s argument (``_require_strategy_scope``
        and ``distribute_utils.validate_colocate``), for this strategy and its cluster
        subclass."""
        if context.current_entry().strategy is not self._container:
            raise RuntimeError(f"colocate_vars_with needs to be inside `with "
                               f"strategy.scope()` of {self._container!r}")
        if not self.variable_created_in_scope(var):
            raise ValueError(f"`colocate_vars_with` must only be passed a variable created "
                             f"in this strategy's scope, not {var!r:.120}")

    def read_var(self, var: Any) -> torch.Tensor:
        return var.value() if isinstance(var, Variable) else var

    def value_container(self, value: Any) -> Any:
        return value

    def variable_created_in_scope(self, value: Any) -> bool:
        if isinstance(value, Variable):
            return value.distribute_strategy is self._container
        if isinstance(value, torch.Tensor):
            return any(t is value for t in self._store.tensors())
        return False

    def broadcast_to(self, tensor: Any, destinations: Any) -> Mirrored:
        """A Mirrored copy of ``tensor`` on every replica device."""
        require_cross_replica_or_default(self._container, "extended.broadcast_to")
        tensor = as_tensor(tensor)
        return Mirrored([tensor.to(d.torch_device, copy=True) for d in self._compute])

    def experimental_make_numpy_dataset(self, numpy_input: Any) -> TensorSliceDataset:
        return TensorSliceDataset(numpy_input)

    def experimental_run_steps_on_iterator(self, *args, **kwargs):
        raise NotImplementedError("experimental_run_steps_on_iterator is a TF 1 graph-loop "
                                  "API; iterate a distributed dataset and call run")


def _note_replica(exc: BaseException, replica_id: int, device: LogicalDevice) -> None:
    if getattr(exc, "csrun_replica_id", None) is not None:
        return
    try:
        exc.csrun_replica_id = replica_id
        exc.csrun_device = device.name
    except AttributeError:  # pragma: no cover - exceptions with __slots__
        pass
    exc.add_note(f"(raised in replica {replica_id} on {device.name})")


class CentralStorageStrategy(Strategy):
    """A one-machine strategy that puts all variables on a single device.

    Parameters are placed on the parameter device; computation is replicated over the
    compute devices. Gradients of all replicas are summed onto the parameter device and the
    optimizer updates the parameters once there.

    Args:
      compute_devices: device names of the replicas (TF or torch spellings). Default: every
        local GPU, else the CPU.
      parameter_device: where parameters live. Default: the only compute device if there is
        one, else the CPU.
      options: csrun engine settings (:class:`StrategyOptions`), keyword-only.

    Raises:
      DeviceError: a device that cannot be parsed, does not exist, or repeats.

    Example::

        strategy = CentralStorageStrategy(["CPU:0", "CPU:1"], "CPU:0")
        with strategy.scope():
            model = torch.nn.Linear(3, 1)
        dist = strategy.experimental_distribute_dataset(batches)
        for x in dist:
            print(strategy.run(lambda v: v + 1, args=(x,)))
    """

    def __init__(self, compute_devices: Iterable | None = None, parameter_device: Any = None,
                 *, options: StrategyOptions | None = None):
        if compute_devices is None:
            compute = default_compute_devices()
        else:
            compute = resolve_devices(compute_devices)
        if parameter_device is None:
            parameter, spelling = default_parameter_device(compute)
        else:
            if isinstance(parameter_device, (list, tuple)):
                raise TypeError(f"parameter_device must be one device name, got "
                                f"{type(parameter_device).__name__} {parameter_device!r}")
            parameter = resolve_device(parameter_device)
            spelling = parameter_device if isinstance(parameter_device, str) else parameter.name
        super().__init__(ParameterServerStrategyExtended(self, compute, parameter, spelling,
                                                         options))


# -- the default strategy ---------------------------------------------------------------
class _DefaultExtended:
    worker_devices = ["/job:localhost/replica:0/task:0/device:CPU:0"]
    parameter_devices = ("/job:localhost/replica:0/task:0/device:CPU:0",)
    num_replicas_in_sync = 1
    num_local_replicas = 1
    replica_offset = 0
    cluster_resolver = None

    def call_for_each_replica(self, fn, args=(), kwargs=None):
        return fn(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def colocate_vars_with(self, var):
        yield


class _DefaultStrategy(Strategy):
    """What ``get_strategy()`` returns outside any scope: no distribution at all."""

    def __init__(self):
        super().__init__(_DefaultExtended())

    def scope(self):
        return contextlib.nullcontext(self)

    def run(self, fn, args=(), kwargs=None, options=None):
        # in the default replica context, also from a merge_fn (TF enters it there)
        entry = context.Entry(None)
        context.push(entry)
        try:
            return fn(*args, **(kwargs or {}))
        finally:
            context.pop(entry)

    def experimental_distribute_dataset(self, dataset, options=None):
        return dataset

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        return dataset_fn(InputContext())

    def experimental_distribute_values_from_function(self, value_fn):
        """``value_fn(ValueContext())`` itself: TF's default strategy returns the value,
        not a PerReplica (its ``run`` would not unwrap one)."""
        return value_fn(ValueContext())

    def __repr__(self) -> str:
        return "DefaultStrategy()"


_DEFAULT = _DefaultStrategy()
_DEFAULT_REPLICA = ReplicaContext(_DEFAULT, 0)


def get_strategy() -> Strategy:
    """The current strategy: the one whose scope or run we are in, else the default one."""
    strategy = context.current_entry().strategy
    return _DEFAULT if strategy is None else strategy


def get_replica_context() -> ReplicaContext | None:
    """The replica context, None in cross-replica context (a merge_fn of the default
    replica context's included), or the default replica context."""
    entry = context.current_entry()
    return _DEFAULT_REPLICA if context.in_default_replica_mode(entry) else entry.replica
