"""Per-table optimizers in a parameter-server job: ``SparseAdam`` for the embedding tables
beside ``AdamW`` for the dense part (two optimizers in a plain loop, or one
CombinedOptimizer), each built on the ps tasks over its own variables' shards, its slots
checkpointed by shard; the values equal a plain torch loop with the same split. Against
real ps tasks in this process (threads, loopback)."""

import pytest
import torch

from csrun.core import CentralStorageStrategy, CombinedOptimizer, FixedShardsPartitioner
from tests.helpers.ps_cluster import Cluster

pytestmark = pytest.mark.timeout(300)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.users = torch.nn.Embedding(40, 4, sparse=True)
        self.items = torch.nn.EmbeddingBag(30, 4, mode="sum", sparse=True)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, user, items):
        return self.head(torch.cat([self.users(user), self.items(items)], 1)).squeeze(1)

    def split(self, lr_tables=0.05, lr_dense=0.01):
        tables = [self.users.weight, self.items.weight]
        return [torch.optim.SparseAdam(tables, lr=lr_tables),
                torch.optim.AdamW(self.head.parameters(), lr=lr_dense, weight_decay=0.1)]


def _batches(steps):
    g = torch.Generator().manual_seed(5)
    return [(torch.randint(0, 40, (6,), generator=g), torch.randint(0, 30, (6, 3), generator=g),
             torch.randn(6, generator=g)) for _ in range(steps)]


def _train(strategy, model, optimizers, batches):
    for user, items, y in batches:
        for optimizer in optimizers:
            optimizer.zero_grad()
        strategy.run(lambda u, i, t: torch.nn.functional.mse_loss(model(u, i), t).backward(),
                     args=(user, items, y))
        for optimizer in optimizers:
            optimizer.step()


def _plain(steps):
    torch.manual_seed(0)
    model = Net()
    optimizers = model.split()
    for user, items, y in _batches(steps):
        for optimizer in optimizers:
            optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(user, items), y).backward()
        for optimizer in optimizers:
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _close(got, expected):
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("combined", [False, True], ids=["two_optimizers", "combined"])
def test_sparse_adam_for_the_tables_and_adamw_for_the_rest_equal_a_plain_loop(combined):
    expected = _plain(4)
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(2)) as cluster:
        torch.manual_seed(0)
        with cluster.strategy.scope():
            model = Net()
            optimizers = model.split()
            if combined:
                optimizers = [CombinedOptimizer(optimizers)]
        _train(cluster.strategy, model, optimizers, _batches(4))
        got = model.state_dict()
        assert cluster.strategy.extended.global_step == 4  # a step, not a push, counted
        held = [s.shards for s in cluster.servers]
        kinds = {type(o).__name__ for s in held for o in s._optimizers.values() if o}
        assert kinds == {"SparseAdam", "AdamW"}
    _close(got, expected)


def test_each_optimizers_slots_are_checkpointed_by_shard_and_restored(tmp_path):
    expected = _plain(4)
    batches = _batches(4)
    with Cluster(1) as cluster:
        torch.manual_seed(0)
        with cluster.strategy.scope():
            model = Net()
            optimizer = CombinedOptimizer(model.split())
        _train(cluster.strategy, model, [optimizer], batches[:2])
        files, index = cluster.strategy.extended.save_shards(str(tmp_path), "ckpt-00000002")
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(3)) as cluster:
        torch.manual_seed(9)  # other starting values: the checkpoint's are restored
        with cluster.strategy.scope():
            model = Net()
            optimizer = CombinedOptimizer(model.split())
        cluster.strategy.extended.restore_shards(index, str(tmp_path), files, "ckpt",
                                                 optimizer)
        held = [s.shards for s in cluster.servers]
        restored = {type(o).__name__: sorted(next(iter(o.state.values())))
                    for s in held for o in s._optimizers.values() if o and o.state}
        assert restored["SparseAdam"] == ["exp_avg", "exp_avg_sq", "step"], restored
        assert restored["AdamW"] == ["exp_avg", "exp_avg_sq", "step"], restored
        _train(cluster.strategy, model, [optimizer], batches[2:])
        got = model.state_dict()
    _close(got, expected)  # Adam's moments and step counts came back: the same values


def test_a_parameter_in_two_optimizers_is_refused_by_name():
    with Cluster(1) as cluster:
        with cluster.strategy.scope():
            model = Net()
            first = torch.optim.SparseAdam([model.users.weight], lr=0.1)
            second = torch.optim.Adagrad(model.parameters(), lr=0.1)
        cluster.strategy.run(lambda: model(torch.tensor([1]), torch.tensor([[2]])).sum()
                             .backward())
        first.step()
        with pytest.raises(RuntimeError, match=r"Embedding.weight is trained by two optimizers \(Adagrad"):
            second.step()


def test_a_dense_optimizer_beside_sparse_tables_is_not_refused_for_them():
    """AdamW has no sparse update: it is refused for sparse tables it trains, not for
    tables another optimizer trains."""
    with Cluster(1) as cluster:
        with cluster.strategy.scope():
            model = Net()
            alone = torch.optim.AdamW(model.parameters(), lr=0.1)
        cluster.strategy.run(lambda: model(torch.tensor([1]), torch.tensor([[2]])).sum()
                             .backward())
        with pytest.raises(ValueError, match=r"Embedding.weight.*sparse gradients.*AdamW"):
            alone.step()


def test_a_combined_optimizer_is_one_optimizer_for_schedules_and_checkpoints():
    torch.manual_seed(0)
    model = Net()
    optimizer = CombinedOptimizer(model.split())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    _train(CentralStorageStrategy(["CPU:0"]), model, [optimizer], _batches(1))
    schedule.step()
    assert [g["lr"] for o in optimizer.optimizers for g in o.param_groups] == [0.025, 0.005]
    assert optimizer.defaults["betas"] == (0.9, 0.999)  # both have them: schedules see them
    assert "weight_decay" not in optimizer.defaults  # SparseAdam has none
    state = optimizer.state_dict()
    again = CombinedOptimizer(Net().split())
    again.load_state_dict(state)
    assert again.param_groups[1] is again.optimizers[1].param_groups[0]
    assert again.optimizers[0].state_dict()["state"].keys() == {0, 1}
    with pytest.raises(ValueError, match="not of a CombinedOptimizer of 2"):
        again.load_state_dict(state["optimizers"][0])
    with pytest.raises(ValueError, match="more than one parameter group"):
        CombinedOptimizer([torch.optim.SGD(model.parameters(), lr=1.0),
                           torch.optim.SGD(model.head.parameters(), lr=1.0)])


def _scheduled(strategy, steps=4):
    torch.manual_seed(0)
    with strategy.scope():
        model = Net()
        optimizer = CombinedOptimizer(model.split())
    # OneCycleLR cycles lr and beta1 of every group: SparseAdam's and AdamW's
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=[0.1, 0.02],
                                                   total_steps=steps, cycle_momentum=True)
    for batch in _batches(steps):
        _train(strategy, model, [optimizer], [batch])
        schedule.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_schedule_over_both_optimizers_reaches_both_on_the_ps():
    expected = _scheduled(CentralStorageStrategy(["CPU:0"]))
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(2)) as cluster:
        got = _scheduled(cluster.strategy)
        held = [s.shards for s in cluster.servers]
        betas = {type(o).__name__: o.param_groups[0]["betas"][0]
                 for s in held for o in s._optimizers.values() if o}
    assert betas["SparseAdam"] != 0.9 and betas["AdamW"] != 0.9  # cycled there
    _close(got, expected)
