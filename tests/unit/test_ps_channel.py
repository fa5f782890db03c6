"""A ps channel's messages, over a real gloo pair in one process: a message up to
PACK_BYTES is one gloo send, its header and parts packed, each tensor copied once into
it (table rows gathered straight into it); a larger one is its header and a send per
part, none copied; the receiver's parts are views of what it received. A header that
is malformed or claims more than the channel's limit is refused before anything is
allocated for it (fed through an in-memory wire, as a hostile or garbled peer's)."""

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
        made[rank] = Channel.connect(mine, "test", rank, datetime.timedelta(seconds=30),
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


class Wire:
    """A process group's ``send`` and ``recv`` in memory: each ``recv`` takes the next of
    ``incoming`` (what a peer sent: a header's bytes, a part) into its buffer."""

    def __init__(self, *incoming: torch.Tensor):
        self.incoming = list(incoming)

    def recv(self, tensors, peer, tag):
        data = self.incoming.pop(0).view(-1).view(torch.uint8)
        tensors[0].view(-1).view(torch.uint8)[:data.numel()].copy_(data)
        return self

    def wait(self):
        return True


def _header(op: int, parts: list[tuple[int, int]], packed: bool) -> torch.Tensor:
    """A header as a peer would send it: ``parts`` as (dtype code, size)."""
    fields = [op, len(parts) | ((1 << 32) if packed else 0)]
    for code, size in parts:
        fields += [code, size]
    return torch.tensor(fields + [0] * (transport._HEADER - len(fields)), dtype=torch.int64)


def _refused(channel: Channel) -> tuple[str, OpCount]:
    ops = OpCount()
    with ops.counting(), pytest.raises(RuntimeError) as refused:
        channel.recv()
    return str(refused.value), ops


def test_a_malformed_header_is_refused_before_anything_is_made():
    float32 = transport._CODE[torch.float32]
    wire = Wire(_header(2, [(float32, 1 << 40)], packed=True))  # 4 TiB "packed"
    error, ops = _refused(Channel(wire, 0))
    assert error.startswith("a malformed message: its header claims 4398046511104")
    assert ops.ops["empty"] == 1  # the receive buffer alone


def test_a_header_claiming_more_than_the_hosts_memory_is_refused_unallocated():
    """An unpacked message's parts are allocated as its header says: a claim above the
    host's memory (the default limit) is refused before any is."""
    float32 = transport._CODE[torch.float32]
    wire = Wire(_header(2, [(float32, 1 << 40)], packed=False))
    error, ops = _refused(Channel(wire, 0))
    assert error.startswith("a message of 4398046511104 bytes, as its header says, is "
                            "more than this host's memory (")
    assert ops.ops["empty"] == 1  # the receive buffer alone, no 4 TiB part


def test_the_limit_bounds_a_messages_parts_together():
    """Two parts of 52 bytes are refused under a 100-byte limit (each alone would fit);
    25 float32 (100 bytes) are received."""
    float32 = transport._CODE[torch.float32]
    error, ops = _refused(Channel(Wire(_header(2, [(float32, 13)] * 2, False)), 0, 100))
    assert "a message of 104 bytes" in error and ops.ops["empty"] == 1
    part = torch.arange(25.0)
    op, parts = Channel(Wire(_header(3, [(float32, 25)], False), part), 0, 100).recv()
    assert op == 3 and torch.equal(parts[0], part)
