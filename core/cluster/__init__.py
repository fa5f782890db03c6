"""The parameter-server cluster, in three parts: the plan (:mod:`.plan`: which ps owns
which shard of which variable), the client (:mod:`.client`: one request per ps per step,
to every ps at once) and the job coordinator (:mod:`.coordinator`, its keys in
:mod:`.store_keys`); a ps task's server (:mod:`.server` over :mod:`.shards`), the
transport, the resolvers, and ``ParameterServerStrategy``. Imports only from
:mod:`csrun.core.distribute` below it.
"""

from .combined_optimizer import CombinedOptimizer
from .embedding_collection import EmbeddingBagCollection
from .launchers import TorchrunClusterResolver
from .parameter_server_strategy import ParameterServerStrategy
from .sharded_variable import (FixedShardsPartitioner, MaxSizePartitioner, MinSizePartitioner,
                               Partitioner)
from .resolvers import (ClusterResolver, ClusterSpec, SimpleClusterResolver,
                        TFConfigClusterResolver)

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "TFConfigClusterResolver",
    "TorchrunClusterResolver",
    "ParameterServerStrategy",
    "Partitioner",
    "FixedShardsPartitioner",
    "MinSizePartitioner",
    "MaxSizePartitioner",
    "EmbeddingBagCollection",
    "CombinedOptimizer",
]
