"""The worker's client against ps tasks serving in this process: every exchange goes to
all the ps tasks at once (a slow ps delays a step by its own time, not the sum), a step
is one request per ps, a ps's failure reaches the worker named, and the optimizer's
settings reach the ps whatever changes them."""

import threading

import pytest
import torch
import torch.nn.functional as F

from csrun.core import CentralStorageStrategy, FixedShardsPartitioner
from csrun.core.cluster import server as server_module
from csrun.core.cluster.client import HandlerError
from csrun.core.cluster.optimizer_spec import OptimizerRefused, sparse_exact
from csrun.core.cluster.transport import LOOKUP, PUSH_PULL, Gathered
from csrun.core.runner.failures import located
from tests.helpers.op_count import COPIES, OpCount
from tests.helpers.ps_cluster import Cluster

pytestmark = pytest.mark.timeout(180)


class Tables(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.users = torch.nn.Embedding(40, 4, sparse=True)
        self.items = torch.nn.EmbeddingBag(60, 4, mode="sum", sparse=True)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, users, items):
        return self.out(torch.cat([self.users(users), self.items(items)], 1)).squeeze(1)


def _build(cluster):
    torch.manual_seed(0)
    with cluster.strategy.scope():
        model = Tables()
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    return model, optimizer


def _step(cluster, model, optimizer):
    users, items = torch.tensor([1, 7, 30]), torch.tensor([[2, 40], [5, 59], [11, 12]])
    optimizer.zero_grad()
    cluster.strategy.run(lambda u, i: model(u, i).pow(2).sum().backward(), args=(users, items))
    optimizer.step()


def _gate(server, method: str, barrier: threading.Barrier, calls: list):
    """Make ``server``'s ``method`` wait until every ps got its request (a barrier of
    one party per ps): a client that asked one ps after another never gets an answer."""
    shards = server.shards
    original = getattr(shards, method)

    def gated(*args, **kwargs):
        calls.append(server.task_id)
        barrier.wait(timeout=20)
        return original(*args, **kwargs)
    setattr(shards, method, gated)


@pytest.mark.parametrize("method", ["lookup", "apply"])
def test_every_ps_is_asked_at_once_and_the_slowest_sets_the_pace(method):
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(2)) as cluster:
        model, optimizer = _build(cluster)
        _step(cluster, model, optimizer)  # registered, the optimizer built
        barrier, calls = threading.Barrier(2), []
        for server in cluster.servers:
            _gate(server, method, barrier, calls)
        _step(cluster, model, optimizer)  # a sequential client: BrokenBarrierError
        assert sorted(set(calls)) == [0, 1]


def test_a_step_sends_each_ps_one_push_carrying_all_its_tables():
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(2)) as cluster:
        model, optimizer = _build(cluster)
        _step(cluster, model, optimizer)
        client = cluster.strategy.extended._remote().client
        sent: list = []
        original = client.exchange

        def counting(messages, counted=None):
            sent.append(sorted((k, op) for k, (op, _) in messages.items()))
            return original(messages, counted)
        client.exchange = counting
        _step(cluster, model, optimizer)
        pushes = [m for m in sent if any(op == PUSH_PULL for _, op in m)]
        lookups = [m for m in sent if any(op == LOOKUP for _, op in m)]
        assert pushes == [[(0, PUSH_PULL), (1, PUSH_PULL)]]  # both ps, in one exchange
        assert len(lookups) == 2  # one per table, each to both ps at once
        assert all(len(m) == 2 for m in lookups)


def test_a_step_costs_one_message_each_way_an_exchange_and_its_rows_are_cut_not_copied():
    """Each exchange with a ps is one gloo message each way, its header and parts packed
    (a push was a header and one send per part: 6 sends and receives, a lookup 5): a
    step of two lookups and a push costs 2 x 3 messages per ps. The worker cuts a table's
    ids and rows by shard as views of the gradient (slices), and a ps gathers the
    looked-up rows straight into its reply."""
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(2)) as cluster:
        model, optimizer = _build(cluster)
        gathered, ops = [], OpCount()
        for server in cluster.servers:
            original = server.shards.lookup

            def lookup(meta, ids, original=original):
                with ops.counting():
                    reply = original(meta, ids)
                gathered.extend(type(part) for part in reply)
                return reply
            server.shards.lookup = lookup
        for _ in range(2):
            _step(cluster, model, optimizer)
        stats = cluster.strategy.extended.transfer_stats()
        assert stats["steps"] == 2 and stats["messages_per_step"] == 2 * 3 * 2
        # one part a reply, its rows gathered as the message is made (Gathered): no
        # copy here (a gather and a join were two, then the message's)
        assert gathered == [Gathered] * 8
        assert not [name for name, _ in ops.touched if name in COPIES]
        remote = cluster.strategy.extended._remote()
        ids = torch.tensor([1, 7, 30, 35])
        assert all(isinstance(where, slice) for _, where in remote.plan.split_rows(0, ids))


def test_a_serving_ps_asks_the_store_at_most_every_idle_poll(monkeypatch):
    """A ps's joins-and-end polls back off to IDLE_POLL_S (every 20 ms, two idle ps
    cost 5% of a core, which the steps shared)."""
    seen, real = [], server_module.poll_until

    def recording(*args, **kwargs):
        seen.append(kwargs.get("most"))
        return real(*args, **kwargs)
    monkeypatch.setattr(server_module, "poll_until", recording)
    with Cluster(1) as cluster:
        _build(cluster)
    assert seen and set(seen) == {server_module.IDLE_POLL_S}


def test_an_exception_in_a_ps_handler_reaches_the_worker_with_its_type_and_message():
    with Cluster(2) as cluster:
        model, optimizer = _build(cluster)
        _step(cluster, model, optimizer)

        def broken(meta, ids):
            raise KeyError("shard 7")
        cluster.servers[1].shards.lookup = broken
        with pytest.raises(HandlerError, match=r"ps:1 failed on a request of worker:0: "
                                               r"KeyError: 'shard 7'") as caught:
            _step(cluster, model, optimizer)
        # the runner passes it on as the cluster's failure, not the user's code's
        assert located(caught.value, "step 2", None, []) is caught.value
        # its state may be half applied: that ps answers every later request so, and the
        # job's reason is its failure, which the chief's abort keeps
        with pytest.raises(HandlerError, match="worker:0: KeyError: 'shard 7'"):
            _step(cluster, model, optimizer)
        cluster.abort(f"worker:0 failed: HandlerError: {caught.value}")
        assert cluster.ended_why == "ps:1 failed on a request of worker:0: KeyError: 'shard 7'"


class Momentum:
    """SGD with momentum whose momentum a schedule changes (OneCycleLR cycles it)."""

    @staticmethod
    def build(params):
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return optimizer, torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=0.5, total_steps=8, cycle_momentum=True)


class Betas:
    """Adam whose betas a schedule changes (OneCycleLR cycles beta1)."""

    @staticmethod
    def build(params):
        optimizer = torch.optim.Adam(params, lr=0.01)
        return optimizer, torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=0.05, total_steps=8, cycle_momentum=True)


def _scheduled(strategy, recipe, steps=6):
    torch.manual_seed(0)
    with strategy.scope():
        model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(),
                                    torch.nn.Linear(4, 1))
        optimizer, schedule = recipe.build(model.parameters())
    g = torch.Generator().manual_seed(3)
    for _ in range(steps):
        x = torch.randn(8, 3, generator=g)
        optimizer.zero_grad()
        strategy.run(lambda x: F.mse_loss(model(x), x.sum(1, keepdim=True)).backward(),
                     args=(x,))
        optimizer.step()
        schedule.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Cyclic:
    """SGD with momentum under CyclicLR with cycle_momentum (momentum falls as lr rises)."""

    @staticmethod
    def build(params):
        optimizer = torch.optim.SGD(params, lr=0.1, momentum=0.9)
        return optimizer, torch.optim.lr_scheduler.CyclicLR(
            optimizer, base_lr=0.01, max_lr=0.3, step_size_up=2, cycle_momentum=True,
            base_momentum=0.5, max_momentum=0.95)


class ScaledSGD(torch.optim.SGD):
    """A user's SGD whose steps a group key ``scale`` scales (absent: 1)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(group.get("scale", 1.0))
        return super().step(closure)


class HandSchedule:
    """Halves ``scale`` in every group each step: a key the optimizer's groups did not
    have at its first step (a plain-loop habit: editing ``param_groups`` by hand)."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    def step(self):
        for group in self.optimizer.param_groups:
            group["scale"] = group.get("scale", 1.0) * 0.5


class ByHand:
    @staticmethod
    def build(params):
        optimizer = ScaledSGD(params, lr=0.1)
        return optimizer, HandSchedule(optimizer)


@pytest.mark.parametrize("recipe", [Momentum, Betas, Cyclic, ByHand])
def test_what_a_schedule_changes_besides_lr_reaches_the_ps(recipe):
    expected = _scheduled(CentralStorageStrategy(["CPU:0"]), recipe)
    with Cluster(1) as cluster:
        got = _scheduled(cluster.strategy, recipe)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=key)


class HalvedSGD(torch.optim.SGD):
    """A user's subclass: its step does something torch's SGD does not."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)
        return super().step(closure)


def test_a_user_subclass_of_an_optimizer_runs_as_itself_on_the_ps():
    def run(strategy, cls):
        torch.manual_seed(0)
        with strategy.scope():
            model = torch.nn.Linear(3, 1)
            optimizer = cls(model.parameters(), lr=0.1)
        optimizer.zero_grad()
        strategy.run(lambda: model(torch.ones(2, 3)).sum().backward())
        optimizer.step()
        return model.weight.detach().clone()

    expected = run(CentralStorageStrategy(["CPU:0"]), HalvedSGD)
    assert not torch.equal(expected, run(CentralStorageStrategy(["CPU:0"]), torch.optim.SGD))
    with Cluster(1) as cluster:
        torch.testing.assert_close(run(cluster.strategy, HalvedSGD), expected)


def test_an_optimizer_class_the_ps_cannot_import_is_refused_before_any_step():
    class Local(torch.optim.SGD):
        pass

    with Cluster(1) as cluster:
        with cluster.strategy.scope():
            model = torch.nn.Linear(3, 1)
            optimizer = Local(model.parameters(), lr=0.1)
        cluster.strategy.run(lambda: model(torch.ones(2, 3)).sum().backward())
        with pytest.raises(OptimizerRefused, match=r"Local .*cannot be built on the ps "
                                                   r"tasks.*define it at the top level"):
            optimizer.step()


def test_which_optimizers_take_a_dense_tables_rows_sparsely_bit_for_bit():
    assert sparse_exact(torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01})
    assert sparse_exact(torch.optim.SGD, {"lr": 0.1})
    assert sparse_exact(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})  # dense momentum
    assert not sparse_exact(torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 0.01})
    assert not sparse_exact(torch.optim.Adam, {"lr": 0.1})
