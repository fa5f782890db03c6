"""Tables created where they live: a worker of a parameter-server job never makes an
embedding table it serves by rows; each ps makes its shards with the values
``torch.manual_seed(s); Net()`` gives them, whatever the ps and shard count, and the layers
built after a table get the values they would have. Against real ps tasks in this process
(threads, loopback); what the worker's thread allocates is watched op by op."""

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from csrun.core import FixedShardsPartitioner, MinSizePartitioner
from csrun.core.cluster.deferred_table import DeferredTable
from csrun.core.cluster.initializers import CHUNK
from csrun.core.runner.digests import params_sha256, state_sha256
from tests.helpers.ps_cluster import Cluster

pytestmark = pytest.mark.timeout(300)


def _init_users(net):
    torch.nn.init.normal_(net.users.weight, std=0.01)


def _init_items(net):
    torch.nn.init.uniform_(net.items.weight, -0.05, 0.05)


def _xavier(net):
    torch.nn.init.xavier_uniform_(net.users.weight)
    net.items.weight.data.normal_(0, 0.02)


class Net(torch.nn.Module):
    """Tables (one with padding_idx, one a bag), layers built after them."""

    def __init__(self, init=None):
        super().__init__()
        self.users = torch.nn.Embedding(53, 4, padding_idx=5, sparse=True)
        self.after = torch.nn.Linear(8, 3)
        self.items = torch.nn.EmbeddingBag(37, 4, mode="sum")
        if init is not None:
            init(self)
        self.out = torch.nn.Linear(3, 1)

    def forward(self, user, items):
        features = torch.cat([self.users(user), self.items(items)], 1)
        return self.out(torch.relu(self.after(features))).squeeze(1)


def _plain(init) -> tuple[dict, torch.Tensor]:
    torch.manual_seed(12)
    model = Net(init)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, torch.get_rng_state()


@pytest.mark.parametrize("init", [None, _init_users, _init_items, _xavier],
                         ids=["default", "normal_", "uniform_", "xavier_and_data"])
@pytest.mark.parametrize("ps, partitioner", [
    (1, None), (1, FixedShardsPartitioner(3)), (2, FixedShardsPartitioner(2)),
    (2, FixedShardsPartitioner(3)), (2, MinSizePartitioner(min_shard_bytes=64, max_shards=3))])
def test_the_ps_tasks_make_the_tables_a_plain_build_makes(init, ps, partitioner):
    expected, rng = _plain(init)
    with Cluster(ps, variable_partitioner=partitioner) as cluster:
        torch.manual_seed(12)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing built whole, nothing said
            with cluster.strategy.scope():
                model = Net(init)
            assert type(model.users.weight) is DeferredTable
            assert type(model.items.weight) is DeferredTable
            assert torch.equal(torch.get_rng_state(), rng)  # as if the tables were drawn
            cluster.strategy.run(lambda u, i: model(u, i).sum().backward(),
                                 args=(torch.tensor([5, 7]), torch.tensor([[1, 2], [3, 4]])))
        assert model.users.weight.untyped_storage().nbytes() == 4  # one float stands for it
        got = model.state_dict()  # the tables read from the ps tasks
        assert set(got) == set(expected)
        for key, value in expected.items():
            assert torch.equal(got[key], value), key


def test_a_table_given_its_values_is_sent_with_them():
    values = torch.randn(30, 4)
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(2)) as cluster:
        with cluster.strategy.scope():
            given = torch.nn.Embedding(30, 4, _weight=values.clone())
            pretrained = torch.nn.Embedding.from_pretrained(values * 2, freeze=False)
            loaded = torch.nn.Embedding(30, 4)
            loaded.load_state_dict({"weight": values * 3})
        cluster.strategy.extended._remote().ensure_registered()
        assert torch.equal(given.state_dict()["weight"], values)
        assert torch.equal(pretrained.state_dict()["weight"], values * 2)
        assert torch.equal(loaded.state_dict()["weight"], values * 3)


def test_a_restored_job_runs_no_initializer_and_takes_the_checkpoints_rows(tmp_path):
    with Cluster(1) as cluster:
        torch.manual_seed(3)
        with cluster.strategy.scope():
            model = Net()
            optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
        files, index = cluster.strategy.extended.save_shards(str(tmp_path), "ckpt-00000000")
        saved = model.state_dict()
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(2)) as cluster:
        torch.manual_seed(4)  # other initial values: never made, the restore writes them
        with cluster.strategy.scope():
            model = Net()
            optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
        cluster.strategy.extended.restore_shards(index, str(tmp_path), files, "ckpt",
                                                 optimizer)
        held = [s.shards for s in cluster.servers]
        assert all(spec.get("init") == "restored" for shards in held
                   for spec in shards._specs.values() if spec["rows"])
        for key, value in saved.items():
            assert torch.equal(model.state_dict()[key], value), key


class Allocations(TorchDispatchMode):
    """Every tensor this thread makes or touches, watched for ``limit`` bytes of storage
    or more (``made``), and whether anything touched a large ``torch.empty`` (whose
    pages are never written, so never resident)."""

    def __init__(self, limit: int):
        super().__init__()
        self.limit, self.made, self.empty, self.touched = limit, [], set(), []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in torch.utils._pytree.tree_leaves((args, kwargs, out))
                   if isinstance(t, torch.Tensor) and t.device.type == "cpu"
                   and t.layout == torch.strided]
        if func.overloadpacket is torch.ops.aten.empty:
            if out.device.type == "cpu" and out.untyped_storage().nbytes() >= self.limit:
                self.empty.add(out.untyped_storage().data_ptr())
            return out
        for tensor in tensors:
            storage = tensor.untyped_storage()
            if storage.data_ptr() in self.empty:
                if not func.is_view:  # a view reads and writes nothing
                    self.touched.append(str(func))
            elif storage.nbytes() >= self.limit:
                self.made.append((str(func), storage.nbytes()))
        return out


def test_a_worker_never_holds_a_table_it_serves_by_rows(tmp_path):
    """A 64 MiB table: built, registered, trained, checkpointed by shard, digested. No
    op of the worker's thread makes a tensor of a quarter of it (the generator is
    advanced in chunks of 4 MiB), and the table's torch.empty is never written."""
    rows, dim = CHUNK, 16
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(3)) as cluster:
        watch = Allocations(limit=rows * dim * 4 // 4)
        with watch:
            torch.manual_seed(0)
            with cluster.strategy.scope():
                table = torch.nn.EmbeddingBag(rows, dim, mode="sum", sparse=True)
                head = torch.nn.Linear(dim, 1)
                optimizer = torch.optim.Adagrad([*table.parameters(), *head.parameters()],
                                                lr=0.1)
            ids = torch.tensor([[3, rows - 1], [rows // 2, 17]])
            for _ in range(2):
                optimizer.zero_grad()
                cluster.strategy.run(lambda i: head(table(i)).sum().backward(), args=(ids,))
                optimizer.step()
            cluster.strategy.extended.save_shards(str(tmp_path), "ckpt-00000002")
            digest = params_sha256(torch.nn.ModuleDict({"table": table, "head": head}))
        assert watch.empty and not watch.touched and not watch.made, watch.made[:3]
        whole = torch.nn.ModuleDict({"table": table, "head": head}).state_dict()
        assert digest == state_sha256(whole)  # read by chunks: the same digest
        torch.manual_seed(0)
        expected = torch.nn.EmbeddingBag(rows, dim, mode="sum").weight.detach()
        untouched = [slice(20, 100), slice(rows - 100, rows - 1)]  # rows it did not train
        for rows_ in untouched:
            assert torch.equal(whole["table.weight"][rows_], expected[rows_])
