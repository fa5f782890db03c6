"""The distributed batches of each pass over the data, from any position in it.

``dataset.distribute: global`` splits each global batch of the pipeline over the replicas
(``experimental_distribute_dataset``); ``per_replica`` deals per-replica batches of one
pipeline, or of one pipeline per replica (``distribute_datasets_from_function``). A
resumed run starts its pass at the batch it had reached.

A parameter-server worker (``sliced``) reads only its share of each pass (TF's dataset
per worker, :mod:`csrun.core.data.worker_share`): ``distribute_datasets_from_function``
hands its input pipeline the worker's ``InputContext`` (pipeline ``w`` of ``W``), whose
plan keeps the worker's part of every global step, one batch per local replica. Its
loss is still divided by the whole global step's examples, read off the plan.

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
from ..data.worker_share import WorkerShare, rounds
from ..distribute import InputContext, InputOptions, InputReplicationMode

__all__ = ["PassBatches"]


class PassBatches:
    """The distributed dataset of a pass, and the global example count of its steps.

    ``sliced``: this process is one worker of a parameter-server job; it reads only its
    share of each pass, and the global sizes come from the pipeline's plan.
    """

    def __init__(self, config: DatasetConfig, pipeline: Pipeline, strategy: Any,
                 devices: Sequence[str], sliced: bool):
        self.config, self.pipeline, self.strategy = config, pipeline, strategy
        self.devices, self.sliced = devices, sliced
        self._sizes: Iterator[int] = iter(())  # global step sizes of the pass (sliced)

    def distributed(self, epoch: int, position: int):
        """The distributed dataset of pass ``epoch``, from batch ``position``."""
        config, pipeline = self.config, self.pipeline
        if self.sliced:
            self._sizes = self._global_sizes(epoch, position)
            return self._worker_input(epoch, position)
        pin = self._pin()
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

    def _pin(self) -> bool:
        pin = self.config.pin_memory
        return pin if pin != "auto" else \
            torch.cuda.is_available() and any(d.startswith("GPU") for d in self.devices)

    def _worker_input(self, epoch: int, position: int):
        """A parameter-server worker's pass: its share, one batch per local replica."""
        pipeline, pin = self.pipeline, self._pin()
        local = self.strategy.extended.num_local_replicas
        per_replica = self.config.replication == "per_replica" and \
            self.config.distribute == "per_replica"
        steps = pipeline.steps_per_epoch(self.strategy.num_replicas_in_sync)

        def dataset_fn(context):
            if per_replica:  # this replica's own pipeline, as in central storage
                size = context.get_per_replica_batch_size(pipeline.batch_size)
                loader = pipeline.loader(
                    epoch, position, pipelines=context.num_input_pipelines,
                    pipeline_id=context.input_pipeline_id, batch_size=size, pin_memory=pin)
                # every worker stops where the shortest replica pipeline of all does
                return loader if steps is None else \
                    itertools.islice(loader, max(0, steps - position))
            return pipeline.loader(epoch, position * local, pin_memory=pin,
                                   **self._share(context, local))

        mode = InputReplicationMode.PER_REPLICA if per_replica else \
            InputReplicationMode.PER_WORKER
        return self.strategy.distribute_datasets_from_function(
            dataset_fn, InputOptions(experimental_replication_mode=mode,
                                     experimental_per_replica_buffer_size=pipeline.prefetch))

    def steps_per_epoch(self) -> int | None:
        """Distributed steps in one pass (None: unknown); a parameter-server worker's
        counted over its own share, which has a part of every global step."""
        replicas = self.strategy.num_replicas_in_sync
        if not self.sliced or (self.config.distribute == "per_replica"
                               and self.config.replication == "per_replica"):
            return self.pipeline.steps_per_epoch(replicas)  # (lockstep over all replicas)
        ext = self.strategy.extended
        local = ext.num_local_replicas
        context = InputContext(replicas // local, ext.replica_offset // local, replicas)
        batches = self.pipeline.batches_per_epoch(**self._share(context, local))
        return batches if batches is None else batches // local

    def _share(self, context, local: int) -> dict:
        """The loader arguments of the worker ``context`` names (input pipeline ``w`` of
        ``W``): its share of the same plan every worker computes, whose ``shard`` steps
        resolve as in central storage (one pipeline), so the shares divide one pass."""
        share = WorkerShare(context.num_input_pipelines, context.input_pipeline_id, local,
                            rounds=self.config.distribute == "per_replica")
        size = context.get_per_replica_batch_size(self.pipeline.batch_size) \
            if share.rounds else None
        return {"batch_size": size, "share": share}

    def _global_sizes(self, epoch: int, position: int) -> Iterator[int]:
        """The examples of each global step of pass ``epoch`` from ``position``, as the
        plan holds them (every replica's, this worker's or not)."""
        pipeline, config = self.pipeline, self.config
        if config.distribute == "global":
            steps: Iterator = ([b] for b in pipeline.plan(epoch))
        else:
            replicas = self.strategy.num_replicas_in_sync
            size = pipeline.batch_size // replicas
            if config.replication == "per_replica":  # lockstep: the shortest ends it
                steps = zip(*(pipeline.plan(epoch, replicas, r, size)
                              for r in range(replicas)))
            else:  # rounds of `replicas` batches of one pipeline
                steps = rounds(pipeline.plan(epoch, 1, 0, size), replicas)
        return (sum(len(b) for b in step) for step in itertools.islice(steps, position, None))

    def global_examples(self, x: Any) -> int:
        """The examples of a step's global batch (``x``: its first leaf); a step function
        divides its summed loss by it, so that the summed gradients are those of the
        global-batch mean."""
        if self.sliced:
            return next(self._sizes)
        return sum(int(t.shape[0]) for t in self.strategy.experimental_local_results(x))

