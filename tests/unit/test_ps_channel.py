"""A ps channel's messages, over a real gloo pair in one process: a message up to
PACK_BYTES is one gloo send, its header and parts packed, each tensor copied once into
it (table rows gathered straight into it); a larger one is its header and a send per
part, none copied; the receiver's parts are views of what it received."""

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from csrun.core.cluster import transport
from csrun.core.cluster.transport import Channel, Gathered
from csrun.core.runner.launch import free_ports
from tests.helpers.op_count import COPIES, OpCount

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def pair():
    port = free_ports(1)[0]
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    made: dict = {}

    def make(rank):
        mine = dist.TCPStore("127.0.0.1", port, is_master=False)
        made[rank] = Channel(mine, "test", rank, datetime.timedelta(seconds=30),
                             transport.gloo_device("127.0.0.1"))
    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    yield made[0], made[1]
    del store


def _exchange(sender, receiver, op, payload):
    got = {}
    thread = threading.Thread(target=lambda: got.update(message=receiver.recv()))
    thread.start()
    ops = OpCount()
    with ops.counting():
        sender.send(op, payload)
    thread.join(60)
    return got["message"], ops


def test_a_small_message_is_one_send_each_tensor_copied_once(pair):
    ps, worker = pair
    table = torch.arange(40.0).view(10, 4)
    ids = torch.tensor([7, 2, 9])
    grads = [torch.ones(3), torch.full((2, 2), 2.0)]
    (op, parts), ops = _exchange(worker, ps, 5, [transport.encode({"a": 1}), grads,
                                                 Gathered([(table, ids)]), ids])
    assert op == 5 and worker.sent_messages == ps.received_messages == 1
    assert transport.decode(parts[0]) == {"a": 1}
    assert parts[1].tolist() == [1, 1, 1, 2, 2, 2, 2]
    assert torch.equal(parts[2].view(3, 4), table[ids]) and parts[3].tolist() == [7, 2, 9]
    assert len({p.untyped_storage().data_ptr() for p in parts}) == 1  # views of one buffer
    # the header, the meta, two gradients and the ids: one copy each; the rows gathered
    copies = [name for name, _ in ops.touched if name in COPIES]
    assert copies == ["copy_"] * 5 and ops.ops["index_select"] == 1
    assert worker.sent_bytes == ps.received_bytes == 256 + 8 + 32 + 48 + 24  # aligned to 8


def test_a_message_larger_than_pack_bytes_goes_by_parts_uncopied(pair, monkeypatch):
    monkeypatch.setattr(transport, "PACK_BYTES", 64)
    ps, worker = pair
    big, small = torch.arange(32.0), torch.arange(3)
    (op, parts), ops = _exchange(ps, worker, 2, [big, small])
    assert op == 2 and ps.sent_messages == worker.received_messages == 3  # header + 2
    assert torch.equal(parts[0], big) and torch.equal(parts[1], small)
    assert [name for name, _ in ops.touched if name in COPIES] == []


def test_a_malformed_header_is_refused_before_anything_is_made(pair):
    ps, worker = pair
    header = torch.zeros(transport._HEADER, dtype=torch.int64)
    header[0], header[1] = 2, (1 << 32) | 1  # packed, one part
    header[2], header[3] = 0, 1 << 40  # float32, 4 TiB
    got = {}

    def receive():
        try:
            ps.recv()
        except RuntimeError as exc:
            got["error"] = str(exc)
    thread = threading.Thread(target=receive)
    thread.start()
    worker._pg.send([header], 0, 0).wait()
    thread.join(60)
    assert got["error"].startswith("a malformed message: its header claims 4398046511104")
