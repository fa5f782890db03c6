"""csrun.core: TensorFlow's CentralStorageStrategy for PyTorch.

Glossary (TF's words, which csrun keeps):

replica
    One copy of the computation. ``strategy.run(fn)`` calls ``fn`` once per replica.
compute device
    The device a replica computes on (``CPU:1``, ``GPU:0``). Logical CPUs ``CPU:0``,
    ``CPU:1``, ... are distinct replicas that share the host CPU.
parameter device
    The one device where parameters (and optimizer state) live: *central storage*.
per-replica value
    A :class:`PerReplica` holds one component per replica (a split batch, each replica's
    loss). :class:`Mirrored` holds the same value once per replica device.
cross-replica context
    Code inside ``strategy.scope()`` but outside ``run``: it sees every replica at once
    (``reduce``, ``gather``, ``optimizer.step()``).
replica context
    Code inside ``run``: it is one replica (``get_replica_context()`` tells which) and
    can meet the others with ``all_reduce``, ``all_gather`` and ``merge_call``.
aggregation
    How updates made inside replicas are combined (:class:`VariableAggregation`).
"""

import importlib.metadata as _metadata

from .cluster import (ClusterResolver, ClusterSpec, CombinedOptimizer, EmbeddingBagCollection,
                      FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner,
                      ParameterServerStrategy, Partitioner, SimpleClusterResolver, TFConfigClusterResolver,
                      TorchrunClusterResolver)
from .distribute.jagged import JaggedTensor
from . import distribute
from .distribute import (
    CentralStorageStrategy, DataParallel, ParameterServerStrategyExtended, Strategy,
    StrategyOptions, RunOptions, ReduceOp, ReplicaContext, get_strategy, has_strategy,
    in_cross_replica_context, get_replica_context, get_cross_replica_context,
    DistributedValues, PerReplica, Mirrored, InputContext, InputOptions,
    InputReplicationMode, ValueContext, DistributedDataset, DistributedDatasetsFromFunction,
    DistributedIterator, TensorSpec, PerReplicaSpec, TensorSliceDataset, Variable,
    VariableAggregation, VariableSynchronization, set_aggregation, get_aggregation,
    ReplicaAborted, DeviceError, LogicalDevice, canonical_name, local_devices,
    logical_cpu_count, set_logical_cpu_count, compute_average_loss,
)

__all__ = ["ParameterServerStrategy", "ClusterSpec", "ClusterResolver", "SimpleClusterResolver",
           "TFConfigClusterResolver", "TorchrunClusterResolver", "Partitioner",
           "FixedShardsPartitioner", "MinSizePartitioner", "MaxSizePartitioner",
           "EmbeddingBagCollection",
           "JaggedTensor", "CombinedOptimizer"]
__all__ += distribute.__all__  # the engine's names, listed once, in csrun.core.distribute

# the installed distribution's version: one number, kept in pyproject.toml
__version__ = _metadata.version("csrun")
