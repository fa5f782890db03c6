"""Embedding tables and partitioned variables in a parameter-server job, against real ps
tasks in this process (threads, loopback): one worker ends on the parameters central
storage reaches (same initial values, same batches), whatever the sharding."""

import pytest
import torch
import torch.nn.functional as F

from csrun.core import (CentralStorageStrategy, FixedShardsPartitioner, MinSizePartitioner,
                        ParameterServerStrategy, StrategyOptions)
from csrun.core.cluster.shards import HeldShards
from csrun.core.cluster.transport import Gathered, ParameterServerError
from tests.helpers.ps_cluster import Cluster

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
    with Cluster(ps, variable_partitioner=partitioner) as cluster:
        model = train(cluster.strategy, sparse, optimizer)
        got = model.state_dict()
        assert set(got) == set(expected)
        for key, value in expected.items():
            assert got[key].shape == value.shape, key
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_worker_keeps_no_table_and_moves_only_the_rows_it_touches():
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(2)) as cluster:
        model = train(cluster.strategy, True, "Adagrad", steps=3)
        for table in (model.users.weight, model.items.weight):
            assert table.untyped_storage().nbytes() == 4  # one float stands for it
        moved = cluster.strategy.extended.transfer_stats()
        assert moved["steps"] == 3
        # a step touches at most 8 users and 24 items of 4 floats, both ways, plus the
        # dense tower (77 floats) pushed and pulled, ids and headers: far below the
        # tables' 360 rows
        per_step = moved["pushed_bytes_per_step"] + moved["pulled_bytes_per_step"]
        assert per_step < 2 * (32 * 4 * 4 + 77 * 4) + 4096
        state = model.state_dict()  # read whole from the ps tasks
        assert state["users.weight"].shape == (50, 4)
        assert state["users.weight"][0].abs().sum() == 0  # padding_idx stays zero
        # writing the state back writes the ps tasks' rows
        state["users.weight"][7] = 42.0
        model.load_state_dict(state)
        assert torch.equal(model.state_dict()["users.weight"][7], torch.full((4,), 42.0))


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # a tied output layer reads the table whole

    def forward(self, ids):
        return self.head(self.embed(ids).mean(1))


def test_a_tied_table_is_served_whole_and_the_run_says_so_once():
    with Cluster(1) as cluster:
        with cluster.strategy.scope():
            torch.manual_seed(0)
            model = Tied()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = torch.tensor([[1, 2], [3, 4]])
        with pytest.warns(UserWarning, match=r"served whole, not by rows.*Embedding\(10, "
                                             r"4\): its weight is also another module's"):
            for _ in range(2):
                optimizer.zero_grad()
                cluster.strategy.run(lambda i: F.cross_entropy(model(i), i[:, 0]).backward(),
                                     args=(ids,))
                optimizer.step()
        assert model.embed.weight.untyped_storage().nbytes() == 10 * 4 * 4  # kept whole


def test_a_lookup_outside_the_table_fails_like_torchs():
    with Cluster(1) as cluster:
        with cluster.strategy.scope():
            model = torch.nn.Embedding(5, 2)
        with pytest.raises(Exception, match="index out of range in self: Embedding has 5 "
                                            "rows, the input holds row 7"):
            cluster.strategy.run(lambda i: model(i).sum(), args=(torch.tensor([1, 7]),))


def test_a_ps_answering_fewer_rows_than_asked_is_named_not_the_model(monkeypatch):
    """A short reply must neither shift the rows of a lookup nor surface as a shape
    error in the user's forward: the worker names the ps and both counts."""
    answer = HeldShards.lookup

    def short(self, meta, ids):  # a row of 2 values short
        part = answer(self, meta, ids)[0]
        return [(part.tensor() if isinstance(part, Gathered) else part)[:-2]]
    with Cluster(1) as cluster:
        with cluster.strategy.scope():
            model = torch.nn.Embedding(5, 2)
        model.state_dict()  # registered, read whole while the ps answers right
        monkeypatch.setattr(HeldShards, "lookup", short)
        with pytest.raises(ParameterServerError, match=r"^ps:0 \(127\.0\.0\.1:\d+\) "
                           r"answered a lookup of 2 table rows \(4 torch\.float32 values\) "
                           r"with 2 torch\.float32 values; is every task"):
            cluster.strategy.run(lambda i: model(i).sum(), args=(torch.tensor([1, 3]),))


@pytest.mark.parametrize("shards", [1, 2, 5])
def test_the_checkpointed_ps_state_is_the_same_whatever_the_sharding(shards):
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(shards)) as cluster:
        train(cluster.strategy, True, "Adagrad", steps=3)
        state = cluster.strategy.extended.ps_state()
    reference = _reference_state()
    assert set(state["variables"]) == set(reference["variables"])
    for var, value in reference["variables"].items():
        torch.testing.assert_close(state["variables"][var], value, rtol=1e-6, atol=1e-7)
        for slot, expected in reference["slots"][var].items():
            torch.testing.assert_close(state["slots"][var][slot], expected, rtol=1e-6,
                                       atol=1e-7)


_REFERENCE: list = []


def _reference_state() -> dict:
    if not _REFERENCE:
        with Cluster(1) as cluster:
            train(cluster.strategy, True, "Adagrad", steps=3)
            _REFERENCE.append(cluster.strategy.extended.ps_state())
    return _REFERENCE[0]


def test_a_checkpoint_of_one_sharding_restores_into_another():
    with Cluster(1) as cluster:
        train(cluster.strategy, True, "Adagrad", steps=3)
        saved = cluster.strategy.extended.ps_state()
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(3)) as cluster:
        torch.manual_seed(1)  # other initial values: the restore must replace them
        with cluster.strategy.scope():
            model = Ranker(True)
            optimizer = torch.optim.Adagrad(model.parameters(), lr=0.3)
        cluster.strategy.extended.load_ps_state(saved, optimizer)
        again = cluster.strategy.extended.ps_state()
    for var, value in saved["variables"].items():
        assert torch.equal(again["variables"][var], value)
        for slot, expected in saved["slots"][var].items():
            assert torch.equal(again["slots"][var][slot], expected), (var, slot)


@pytest.mark.parametrize("sparse,optimizer", [(True, "Adagrad"), (False, "Adam")])
def test_two_local_replicas_end_where_central_storages_two_do(sparse, optimizer):
    devices = ["CPU:0", "CPU:1"]
    model = train(CentralStorageStrategy(devices), sparse, optimizer)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(2),
                 compute_devices=devices) as cluster:
        got = train(cluster.strategy, sparse, optimizer).state_dict()
        for key, value in expected.items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)


def test_a_checkpoint_by_ps_task_of_an_earlier_csrun_resumes_unpartitioned_only():
    with Cluster(2) as cluster:
        model = train(cluster.strategy, True, "Adagrad", steps=2)
        ext = cluster.strategy.extended
        by_task = ext._remote().client.state()  # what earlier checkpoints held
        for state in by_task:  # as they were written: no order of shards
            state.pop("order"), state.pop("groups")
        expected = model.state_dict()
        optimizer = ext._remote()._optimizers[0]
        for dense, user, items, y in batches(2):  # move on, then go back
            optimizer.zero_grad()
            cluster.strategy.run(lambda d, u, i, t: F.binary_cross_entropy_with_logits(
                model(d, u, i), t).backward(), args=(dense, user, items, y))
            optimizer.step()
        assert not torch.equal(model.state_dict()["users.weight"], expected["users.weight"])
        ext.load_ps_state(by_task)
        for key, value in model.state_dict().items():
            assert torch.equal(value, expected[key]), key
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(2)) as cluster:
        train(cluster.strategy, True, "Adagrad", steps=1)
        with pytest.raises(ValueError, match="resume it without "
                                             "strategy.variable_partitioner"):
            cluster.strategy.extended.load_ps_state(by_task)


class Scaled(torch.nn.Embedding):
    """A subclass with a forward of its own (Hugging Face's scaled embeddings)."""

    def forward(self, ids):
        return super().forward(ids) * 10.0


class ReadsTheWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)

    def forward(self, ids):  # an L2 penalty reads the table whole
        return self.embed(ids).sum() + self.embed.weight.pow(2).sum()


def test_a_replica_reading_a_served_tables_weight_is_refused_naming_it():
    with Cluster(1) as cluster:
        with cluster.strategy.scope():
            model = ReadsTheWeight()
        with pytest.raises(Exception, match=r"Embedding.weight is an embedding table served "
                                            r"by rows .* strategy.serve_embedding_rows: false"):
            cluster.strategy.run(lambda i: model(i).backward(), args=(torch.tensor([1]),))


@pytest.mark.parametrize("make, why", [
    (lambda: Scaled(10, 4), r"Scaled\(10, 4\): Scaled has a forward of its own"),
])
def test_a_table_that_cannot_be_served_by_rows_is_served_whole_and_trains_right(make, why):
    def run(strategy):
        torch.manual_seed(0)
        with strategy.scope():
            model = make()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            optimizer.zero_grad()
            strategy.run(lambda i: model(i).pow(2).sum().backward(),
                         args=(torch.tensor([1, 2]),))
            optimizer.step()
        return model.weight.detach().clone()

    expected = run(CentralStorageStrategy(["CPU:0"]))
    with Cluster(1) as cluster:
        with pytest.warns(UserWarning, match=why):
            got = run(cluster.strategy)
        torch.testing.assert_close(got, expected)


def test_replicas_with_copies_read_tables_whole():
    with Cluster(1, options=StrategyOptions(copy_parameters=True)) as cluster:
        with cluster.strategy.scope():
            torch.manual_seed(0)
            model = torch.nn.Embedding(10, 4)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.warns(UserWarning, match="its replicas get copies"):
            cluster.strategy.run(lambda i: model(i).sum().backward(),
                                 args=(torch.tensor([1]),))
        optimizer.step()
        assert model.weight.untyped_storage().nbytes() == 10 * 4 * 4


def test_a_workers_optimizer_keeps_no_state_of_a_served_table():
    with Cluster(1) as cluster:
        model = train(cluster.strategy, True, "Adagrad", steps=1)
        optimizer = cluster.strategy.extended._remote()._optimizers[0]
        assert model.users.weight not in optimizer.state  # Adagrad's sum of it: on the ps
        assert model.tower.weight in optimizer.state  # (made at construction, unused)


def _saved_by_shard(folder, ps: int, partitioner, steps: int = 3):
    """Train, then save by shard into ``folder``: (files, index, the ps state whole)."""
    with Cluster(ps, variable_partitioner=partitioner) as cluster:
        train(cluster.strategy, True, "Adagrad", steps=steps)
        files, index = cluster.strategy.extended.save_shards(str(folder), "ckpt-00000003")
        return files, index, cluster.strategy.extended.ps_state()


@pytest.mark.parametrize("saved_as, restored_as", [
    ((1, None), (2, FixedShardsPartitioner(3))),
    ((2, FixedShardsPartitioner(3)), (3, MinSizePartitioner(min_shard_bytes=64, max_shards=5))),
])
def test_a_checkpoint_by_shard_restores_into_another_ps_and_shard_count(tmp_path, saved_as,
                                                                        restored_as):
    files, index, expected = _saved_by_shard(tmp_path, *saved_as)
    assert sorted(f["file"] for f in files) == \
        [f"ckpt-00000003.ps-{k}.safetensors" for k in range(saved_as[0])]
    with Cluster(restored_as[0], variable_partitioner=restored_as[1]) as cluster:
        torch.manual_seed(1)  # other initial values: the restore must replace them
        with cluster.strategy.scope():
            model = Ranker(True)
            optimizer = torch.optim.Adagrad(model.parameters(), lr=0.3)
        cluster.strategy.extended.restore_shards(index, str(tmp_path), files, "ckpt",
                                                 optimizer)
        again = cluster.strategy.extended.ps_state()
    for var, value in expected["variables"].items():
        assert torch.equal(again["variables"][var], value), var
        for slot, saved in expected["slots"][var].items():
            assert torch.equal(again["slots"][var][slot], saved), (var, slot)
    assert again["steps"] == {"worker:0": 3}


def test_a_checkpoint_by_shard_holds_values_and_slots_and_little_else(tmp_path):
    with Cluster(2, variable_partitioner=FixedShardsPartitioner(2)) as cluster:
        with cluster.strategy.scope():
            table = torch.nn.Embedding(20_000, 16, sparse=True)
            optimizer = torch.optim.Adagrad(table.parameters(), lr=0.1)
        cluster.strategy.run(lambda i: table(i).sum().backward(),
                             args=(torch.tensor([3, 17_000]),))
        optimizer.step()
        files, _ = cluster.strategy.extended.save_shards(str(tmp_path), "ckpt-00000001")
    held = 2 * 20_000 * 16 * 4 + 2 * 4  # the table, Adagrad's sum of it, its steps
    on_disk = sum((tmp_path / f["file"]).stat().st_size for f in files)
    assert held <= on_disk <= 1.1 * held


@pytest.mark.parametrize("forge, message", [
    (lambda index: index["files"][0]["shards"][0].update(rows=49, shape=[49, 4]),
     r"ps.files hold 49 of variable 0's 50 rows"),
    (lambda index: index["steps"].update({"worker:0": -50}),
     r"ps.steps.worker:0 is -50, not a whole number"),
    (lambda index: index["variables"][0].update(shape=[51, 4]),
     r"ps.variables.0 is float32 \[51, 4\], the model's is float32 \[50, 4\]"),
    (lambda index: index["files"][0].update(sha256="0" * 64),
     r"ps.files.0 names a file its manifest does not list"),
])
def test_a_forged_index_is_refused_naming_the_checkpoint_and_field(tmp_path, forge, message):
    from csrun.core.cluster.shard_index import CheckpointIndexError
    files, index, _ = _saved_by_shard(tmp_path, 1, None, steps=1)
    forge(index)
    with Cluster(1) as cluster:
        with cluster.strategy.scope():
            model = Ranker(True)
            optimizer = torch.optim.Adagrad(model.parameters(), lr=0.3)
        with pytest.raises(CheckpointIndexError, match=r"checkpoint 'ck.pt': " + message):
            cluster.strategy.extended.restore_shards(index, str(tmp_path), files, "ck.pt",
                                                     optimizer)
