"""Jagged features (EmbeddingBag's flat ids and offsets, a dict of them per table) in a
parameter-server job served in this process: they split over replicas by examples,
train as the padded batch does, and a collection of tables is looked up in one request
per ps."""

import pytest
import torch
import torch.nn.functional as F

from csrun.core import (EmbeddingBagCollection, FixedShardsPartitioner, JaggedTensor)
from csrun.core.cluster.transport import LOOKUP
from csrun.core.data.imported import _unsplittable
from csrun.core.distribute.input import split_batch
from tests.helpers.ps_cluster import Cluster

pytestmark = pytest.mark.timeout(180)
ROWS, DIM = 30, 4


def _examples(count: int, seed: int):
    """Each example's ids (1..ROWS-1; 0 is the padding row) and a target."""
    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, ROWS, (int(torch.randint(1, 6, (1,), generator=g)),),
                         generator=g) for _ in range(count)]
    return ids, torch.randn(count, generator=g)


def test_a_jagged_feature_splits_over_replicas_by_examples():
    ids, _ = _examples(5, 0)
    batch = {"items": JaggedTensor.collate(ids), "x": torch.arange(5.0)}
    parts = split_batch(batch, 2)  # TF's rule: 3 examples, then 2
    assert [len(p["items"]) for p in parts] == [3, 2]
    assert torch.equal(parts[1]["items"].values, torch.cat(ids[3:]))
    assert torch.equal(parts[1]["items"].lengths(), torch.tensor([len(i) for i in ids[3:]]))
    assert torch.equal(parts[1]["x"], torch.tensor([3.0, 4.0]))
    assert _unsplittable(batch, 5) is None  # the runner's batch check takes it


class Bags(torch.nn.Module):
    def __init__(self, mode: str):
        super().__init__()
        self.items = torch.nn.EmbeddingBag(ROWS, DIM, mode=mode, padding_idx=0)
        self.out = torch.nn.Linear(DIM, 1)

    def forward(self, items, offsets=None):
        return self.out(self.items(items, offsets)).squeeze(1)


def _train(strategy, mode: str, jagged: bool, steps: int = 4):
    torch.manual_seed(0)
    with strategy.scope():
        model = Bags(mode)
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.2)
    batches = []
    for step in range(steps):
        ids, y = _examples(6, step)
        if jagged:
            batches.append((JaggedTensor.collate(ids), y))
        else:  # padded with row 0, which EmbeddingBag leaves out
            batches.append((torch.nn.utils.rnn.pad_sequence(ids, batch_first=True), y))

    def step(items, y):
        out = model(items.values, items.bag_offsets()) if jagged else model(items)
        F.mse_loss(out, y, reduction="sum").backward()

    for items, y in strategy.experimental_distribute_dataset(batches):
        optimizer.zero_grad()
        strategy.run(step, args=(items, y))
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_jagged_ids_train_as_the_padded_batch_does(mode):
    options = {"variable_partitioner": FixedShardsPartitioner(2),
               "compute_devices": ["CPU:0", "CPU:1"]}
    with Cluster(2, **options) as cluster:
        padded = _train(cluster.strategy, mode, jagged=False)
    with Cluster(2, **options) as cluster:
        jagged = _train(cluster.strategy, mode, jagged=True)
    for key, value in padded.items():
        torch.testing.assert_close(jagged[key], value, rtol=1e-6, atol=1e-7, msg=key)


class Ranker(torch.nn.Module):
    def __init__(self, collected: bool):
        super().__init__()
        tables = {"item": torch.nn.EmbeddingBag(ROWS, DIM, mode="sum"),
                  "user": torch.nn.EmbeddingBag(ROWS + 7, DIM, mode="mean")}
        self.collected = collected
        self.tables = EmbeddingBagCollection(tables) if collected else \
            torch.nn.ModuleDict(tables)
        self.out = torch.nn.Linear(2 * DIM, 1)

    def forward(self, features):
        if self.collected:
            pooled = self.tables(features)
        else:
            pooled = {name: self.tables[name](j.values, j.bag_offsets())
                      for name, j in features.items()}
        return self.out(torch.cat([pooled["item"], pooled["user"]], 1)).squeeze(1)


def _ranked(cluster, collected: bool):
    torch.manual_seed(0)
    with cluster.strategy.scope():
        model = Ranker(collected)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    client = None
    lookups = []
    for step in range(3):
        items, y = _examples(4, step)
        users, _ = _examples(4, step + 10)
        features = {"item": JaggedTensor.collate(items), "user": JaggedTensor.collate(users)}
        optimizer.zero_grad()
        cluster.strategy.run(lambda f, t: F.mse_loss(model(f), t).backward(),
                             args=(features, y))
        if client is None:
            client = cluster.strategy.extended._remote().client
            original = client.exchange

            def counting(messages, counted=None):
                lookups.extend(k for k, (op, _) in messages.items() if op == LOOKUP)
                return original(messages, counted)
            client.exchange = counting
        optimizer.step()
    client.exchange = original  # the state below reads the tables whole
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, lookups


def test_a_collection_looks_up_all_its_tables_in_one_request_per_ps():
    options = {"variable_partitioner": FixedShardsPartitioner(2)}
    with Cluster(2, **options) as cluster:
        alone, alone_lookups = _ranked(cluster, collected=False)
    with Cluster(2, **options) as cluster:
        together, together_lookups = _ranked(cluster, collected=True)
    # two steps counted (the first registered the tables): two tables on two ps each
    assert len(alone_lookups) == 2 * 2 * 2 and len(together_lookups) == 2 * 2
    assert alone.keys() == {k.replace("tables.tables.", "tables.") for k in together}
    for key, value in together.items():
        torch.testing.assert_close(alone[key.replace("tables.tables.", "tables.")], value,
                                   msg=key)
