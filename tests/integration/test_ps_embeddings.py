"""Embedding tables and partitioned variables in a parameter-server job, against real ps
tasks in this process (threads, loopback): one worker ends on the parameters central
storage reaches (same initial values, same batches), whatever the sharding."""

import threading

import pytest
import torch
import torch.nn.functional as F

from csrun.core import (CentralStorageStrategy, FixedShardsPartitioner, MinSizePartitioner,
                        ParameterServerStrategy)
from csrun.core.runner.launch import free_ports

pytestmark = pytest.mark.timeout(180)


class Ranker(torch.nn.Module):
    """Two tables (one a bag), a dense tower, a logit."""

    def __init__(self, sparse: bool):
        super().__init__()
        self.users = torch.nn.Embedding(50, 4, sparse=sparse, padding_idx=0)
        self.items = torch.nn.EmbeddingBag(40, 4, mode="sum", sparse=sparse)
        self.tower = torch.nn.Linear(3 + 8, 6)
        self.out = torch.nn.Linear(6, 1)

    def forward(self, dense, user, items):
        features = torch.cat([dense, self.users(user), self.items(items)], 1)
        return self.out(torch.relu(self.tower(features))).squeeze(1)


def batches(steps: int, size: int = 8):
    g = torch.Generator().manual_seed(5)
    for _ in range(steps):
        dense = torch.randn(size, 3, generator=g)
        user = torch.randint(0, 50, (size,), generator=g)
        items = torch.randint(0, 40, (size, 3), generator=g)
        yield dense, user, items, (dense.sum(1) > 0).float()


def train(strategy, sparse: bool, optimizer: str, steps: int = 6):
    torch.manual_seed(0)
    with strategy.scope():
        model = Ranker(sparse)
        opt = {"SGD": lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.5),
               "Adagrad": lambda p: torch.optim.Adagrad(p, lr=0.3),
               "SparseAdam": lambda p: torch.optim.SparseAdam(p, lr=0.05),
               "Adam": lambda p: torch.optim.Adam(p, lr=0.05)}[optimizer]
        if optimizer == "SparseAdam":  # sparse gradients only: the tables train alone
            for p in [*model.tower.parameters(), *model.out.parameters()]:
                p.requires_grad_(False)
        optimizers = [opt([p for p in model.parameters() if p.requires_grad])]
    for dense, user, items, y in batches(steps):
        def step(d, u, i, t):
            loss = F.binary_cross_entropy_with_logits(model(d, u, i), t)
            loss.backward()
            return loss
        for o in optimizers:
            o.zero_grad()
        strategy.run(step, args=(dense, user, items, y))
        for o in optimizers:
            o.step()
    return model


class Cluster:
    """``ps`` ps tasks serving in threads of this process, and one worker's strategy."""

    def __init__(self, ps: int, **kwargs):
        ports = free_ports(ps + 1)
        self.spec = {"worker": [f"127.0.0.1:{ports[0]}"],
                     "ps": [f"127.0.0.1:{p}" for p in ports[1:]]}
        self.threads = []
        for k in range(ps):
            thread = threading.Thread(target=self._serve, args=(k,), daemon=True)
            thread.start()
            self.threads.append(thread)
        self.strategy = ParameterServerStrategy(cluster_spec=self.spec, task_type="worker",
                                                task_id=0, timeout=60, **kwargs)

    def _serve(self, k: int) -> None:
        ParameterServerStrategy(cluster_spec=self.spec, task_type="ps", task_id=k,
                                timeout=60).extended.join()

    def close(self) -> None:
        self.strategy.extended.finish(timeout=30)
        for thread in self.threads:
            thread.join(timeout=30)


def central(sparse: bool, optimizer: str) -> dict:
    model = train(CentralStorageStrategy(["CPU:0"]), sparse, optimizer)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("sparse,optimizer,ps,partitioner", [
    (True, "SGD", 1, None),
    (True, "Adagrad", 2, FixedShardsPartitioner(3)),
    (True, "SparseAdam", 2, MinSizePartitioner(min_shard_bytes=64, max_shards=4)),
    (False, "Adam", 2, FixedShardsPartitioner(2)),
    (False, "SGD", 1, None),
])
def test_one_worker_ends_where_central_storage_does(sparse, optimizer, ps, partitioner):
    expected = central(sparse, optimizer)
    cluster = Cluster(ps, variable_partitioner=partitioner)
    try:
        model = train(cluster.strategy, sparse, optimizer)
        got = model.state_dict()
        assert set(got) == set(expected)
        for key, value in expected.items():
            assert got[key].shape == value.shape, key
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
    finally:
        cluster.close()
