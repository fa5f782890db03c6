"""The distributed batches of each pass over the data, from any position in it.

``dataset.distribute: global`` splits each global batch of the pipeline over the replicas
(``experimental_distribute_dataset``); ``per_replica`` deals per-replica batches of one
pipeline, or of one pipeline per replica (``distribute_datasets_from_function``). A
resumed run starts its pass at the batch it had reached.

Example::

    passes = PassBatches(config.dataset, pipeline, strategy, devices, sliced=False)
    for batch in passes.distributed(epoch=0, position=0): ...
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator, Sequence

import torch

from ..config.schema import DatasetConfig
from ..data.pipeline import Pipeline
from ..distribute import InputOptions, InputReplicationMode

__all__ = ["PassBatches"]


class PassBatches:
    """The distributed dataset of a pass, and the global example count of its steps.

    ``sliced``: the strategy feeds this process only its slice of each global batch (a
    parameter-server worker); the global sizes then come from the pipeline's plan.
    """

    def __init__(self, config: DatasetConfig, pipeline: Pipeline, strategy: Any,
                 devices: Sequence[str], sliced: bool):
        self.config, self.pipeline, self.strategy = config, pipeline, strategy
        self.devices, self.sliced = devices, sliced
        self._sizes: Iterator[int] = iter(())  # global batch sizes of the pass (sliced)

    def distributed(self, epoch: int, position: int):
        """The distributed dataset of pass ``epoch``, from batch ``position``."""
        config, pipeline = self.config, self.pipeline
        if self.sliced:  # the sizes of the global batches this process sees slices of
            self._sizes = (len(b) for b in itertools.islice(pipeline.plan(epoch),
                                                             position, None))
        pin = config.pin_memory if config.pin_memory != "auto" else \
            torch.cuda.is_available() and any(d.startswith("GPU") for d in self.devices)
        buffer = pipeline.prefetch
        if config.distribute == "global":
            loader = pipeline.loader(epoch, position, pin_memory=pin)
            return self.strategy.experimental_distribute_dataset(
                loader, InputOptions(experimental_per_replica_buffer_size=buffer))
        per_worker = config.replication == "per_worker"
        mode = InputReplicationMode.PER_WORKER if per_worker else \
            InputReplicationMode.PER_REPLICA

        def dataset_fn(context):
            # one pipeline deals `replicas` batches per step; per-replica ones one each
            skip = position * (context.num_replicas_in_sync if per_worker else 1)
            return pipeline.loader(
                epoch, skip, pipelines=context.num_input_pipelines,
                pipeline_id=context.input_pipeline_id, pin_memory=pin,
                batch_size=context.get_per_replica_batch_size(pipeline.batch_size))

        return self.strategy.distribute_datasets_from_function(
            dataset_fn, InputOptions(experimental_replication_mode=mode,
                                     experimental_per_replica_buffer_size=buffer))

    def global_examples(self, x: Any) -> int:
        """The examples of a step's global batch (``x``: its first leaf); a step function
        divides its summed loss by it, so that the summed gradients are those of the
        global-batch mean."""
        if self.sliced:
            return next(self._sizes)
        return sum(int(t.shape[0]) for t in self.strategy.experimental_local_results(x))
