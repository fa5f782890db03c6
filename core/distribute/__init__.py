"""The engine: TF's distribution strategy API on torch tensors (the lowest layer).

Strategy and context, distributed values and input, reduce and cross-device ops, the
central parameter store, variables, replica execution, devices, the coalesced device
copies, and DataParallel (torch's interface) with its scatter and gather. It imports nothing from the other layers of ``csrun.core``.
"""

from .context import (ReplicaContext, get_cross_replica_context, has_strategy,
                      in_cross_replica_context)
from .data_parallel import DataParallel
from .devices import (DeviceError, LogicalDevice, canonical_name, local_devices,
                      logical_cpu_count, set_logical_cpu_count)
from .losses import compute_average_loss
from .input import (DistributedDataset, DistributedDatasetsFromFunction, DistributedIterator,
                    InputContext, InputOptions, InputReplicationMode, PerReplicaSpec,
                    TensorSliceDataset, TensorSpec, ValueContext)
from .parameters import get_aggregation, set_aggregation
from .reduce import ReduceOp
from .replica_run import ReplicaAborted
from .strategy import (CentralStorageStrategy, ParameterServerStrategyExtended, RunOptions,
                       Strategy, StrategyOptions, get_replica_context, get_strategy)
from .values import DistributedValues, Mirrored, PerReplica
from .variables import Variable, VariableAggregation, VariableSynchronization


__all__ = [
    "compute_average_loss",
    "CentralStorageStrategy",
    "DataParallel",
    "ParameterServerStrategyExtended",
    "Strategy",
    "StrategyOptions",
    "RunOptions",
    "ReduceOp",
    "ReplicaContext",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "get_replica_context",
    "get_cross_replica_context",
    "DistributedValues",
    "PerReplica",
    "Mirrored",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "ValueContext",
    "DistributedDataset",
    "DistributedDatasetsFromFunction",
    "DistributedIterator",
    "TensorSpec",
    "PerReplicaSpec",
    "TensorSliceDataset",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "set_aggregation",
    "get_aggregation",
    "ReplicaAborted",
    "DeviceError",
    "LogicalDevice",
    "canonical_name",
    "local_devices",
    "logical_cpu_count",
    "set_logical_cpu_count",
]
