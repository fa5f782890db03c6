"""The parameter-server cluster: resolvers, the ps transport, server and client, and
``ParameterServerStrategy``. Imports only from :mod:`csrun.core.distribute` below it.
"""

from .embedding_collection import EmbeddingBagCollection
from .launchers import TorchrunClusterResolver
from .parameter_server_strategy import ParameterServerStrategy
from .sharded_variable import FixedShardsPartitioner, MinSizePartitioner, Partitioner
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
    "EmbeddingBagCollection",
]
