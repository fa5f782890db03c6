"""A table's initialization recorded on a worker and run by shard (csrun.core.cluster.
deferred_table, .initializers): chunked draws equal torch's whole ones, at full chunk
size; a stand-in records what torch's init does, advances the generator as it would,
answers questions about its shape, and builds itself whole, with the same values and
once said, for anything it cannot record."""

import warnings

import pytest
import torch

from csrun.core.cluster.deferred_table import DeferredTable
from csrun.core.cluster.initializers import (CHUNK, TableInitializer, chunk_bounds,
                                             chunking_holds, draw_rows)


def test_chunks_start_every_chunk_and_the_last_holds_at_least_16():
    assert chunk_bounds(100, 32) == [(0, 32), (32, 64), (64, 100)]  # rest 4: merged
    assert chunk_bounds(120, 32) == [(0, 32), (32, 64), (64, 96), (96, 120)]
    assert chunk_bounds(7, 32) == [(0, 7)]
    assert chunk_bounds(0, 32) == []


@pytest.mark.parametrize("op", ["normal", "uniform"])
@pytest.mark.parametrize("numel", [3 * CHUNK + 21, 2 * CHUNK + 5])
def test_draws_by_chunk_at_full_size_are_torchs_whole_draws(op, numel):
    step = {"op": op, "mean": 0.0, "std": 0.01, "low": -0.05, "high": 0.05}
    whole, chunked = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    expected = torch.empty(numel)
    expected.normal_(0.0, 0.01, generator=whole) if op == "normal" else \
        expected.uniform_(-0.05, 0.05, generator=whole)
    # a ps's two pieces (one across a chunk's end, one with the table's last elements)
    pieces = [(CHUNK - 100, torch.empty(300)), (numel - 40, torch.empty(40))]
    draw_rows(step, numel, torch.float32, pieces, chunked)
    assert torch.equal(pieces[0][1], expected[CHUNK - 100:CHUNK + 200])
    assert torch.equal(pieces[1][1], expected[-40:])
    advanced = torch.Generator().manual_seed(3)  # a worker: every draw, none kept
    draw_rows(step, numel, torch.float32, [], advanced)
    assert torch.equal(advanced.get_state(), whole.get_state())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16])
def test_this_torch_draws_by_chunk_as_whole_in_every_float_dtype(dtype):
    assert chunking_holds("normal", dtype) and chunking_holds("uniform", dtype)


def test_an_initializer_fills_shards_as_its_steps_fill_the_whole_and_travels_as_json():
    g = torch.Generator().manual_seed(9)
    init = TableInitializer((23, 5), torch.float32)
    init.record({"op": "normal", "mean": 0.0, "std": 2.0}, whole=True, generator=g)
    init.record({"op": "mul", "value": 0.5}, whole=False)
    init.record({"op": "fill", "value": 0, "rows": [4, 6]}, whole=False)
    init.record({"op": "clamp", "min": -1.0, "max": None}, whole=False)
    again = TableInitializer.from_json(init.to_json())
    shards = [(0, torch.empty(9, 5)), (9, torch.empty(8, 5)), (17, torch.empty(6, 5))]
    again.fill(shards, chunk=32)
    whole = init.whole()
    assert torch.equal(torch.cat([s for _, s in shards]), whole)
    assert whole[4:6].abs().sum() == 0 and whole.min() >= -1
    expected = torch.empty(23, 5).normal_(0.0, 2.0, generator=torch.Generator().manual_seed(9))
    assert torch.equal(whole[:4], expected[:4].mul(0.5).clamp(min=-1.0))


def _stand(rows=40, dim=6, **kwargs) -> DeferredTable:
    return DeferredTable.standing_for(torch.nn.Parameter(torch.empty(rows, dim, **kwargs)),
                                      f"Embedding({rows}, {dim})")


def _plain_and_recorded(init):
    """The values ``init(weight)`` gives a plain parameter and a stand-in (built whole
    afterwards), and the generator's state after each."""
    torch.manual_seed(4)
    plain = torch.nn.Parameter(torch.empty(40, 6))
    init(plain)
    after_plain = torch.get_rng_state()
    torch.manual_seed(4)
    stand = _stand()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # recorded: nothing built, nothing said
        init(stand)
        assert type(stand) is DeferredTable
    after_recorded = torch.get_rng_state()
    stand.materialize()
    return plain, stand, after_plain, after_recorded


def _rows_zeroed(w):
    torch.nn.init.normal_(w)
    with torch.no_grad():
        w[3].fill_(0)
        w[5:7] = 0.5
        w.data[9].zero_()


@pytest.mark.parametrize("init", [
    lambda w: torch.nn.init.normal_(w, std=0.01),
    lambda w: torch.nn.init.uniform_(w, -0.1, 0.1),
    torch.nn.init.xavier_uniform_, torch.nn.init.xavier_normal_, torch.nn.init.kaiming_normal_,
    torch.nn.init.zeros_, torch.nn.init.ones_,
    lambda w: torch.nn.init.constant_(w, 0.25),
    lambda w: w.data.normal_(0, 0.02).mul_(3).add_(1).clamp_(0.9, 1.1),
    lambda w: w.data.uniform_(generator=torch.Generator().manual_seed(2)),
    _rows_zeroed,
    lambda w: w.data.copy_(torch.arange(240.0).view(40, 6)),
], ids=["normal", "uniform", "xavier_uniform", "xavier_normal", "kaiming_normal", "zeros",
        "ones", "constant", "arithmetic", "own generator", "rows", "copy"])
def test_a_recorded_init_gives_torchs_values_and_leaves_the_generator_where_torch_does(init):
    plain, stand, after_plain, after_recorded = _plain_and_recorded(init)
    assert type(stand) is torch.nn.Parameter
    assert torch.equal(plain, stand)
    assert torch.equal(after_plain, after_recorded)


def test_a_stand_in_answers_for_its_shape_and_holds_one_element():
    stand = _stand(dtype=torch.float64)
    assert stand.shape == (40, 6) and stand.dtype == torch.float64 and stand.requires_grad
    assert stand.is_contiguous() and stand.stride() == (6, 1) and stand.device.type == "cpu"
    assert stand.numel() == 240
    assert stand.to("cpu") is stand and stand.contiguous() is stand
    sums = torch.full_like(stand, 0.1)  # Adagrad's state, made when it is built
    assert sums.shape == (40, 6) and sums.untyped_storage().nbytes() == 8
    assert type(stand) is DeferredTable  # none of that built it


def test_writes_to_the_weight_with_gradients_on_are_refused_as_torch_refuses_them():
    stand = _stand()
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        stand.normal_()
    with pytest.raises(RuntimeError, match="a view of a leaf Variable"):
        stand[2].fill_(0)
    with torch.no_grad():
        stand.normal_()  # as torch: fine without gradients


@pytest.mark.parametrize("init, call", [
    (torch.nn.init.orthogonal_, r"nn.init.orthogonal_ \(new_empty\)"),
    (torch.nn.init.trunc_normal_, r"nn.init.trunc_normal_ \(new_tensor\)"),
    (torch.nn.init.kaiming_uniform_, "nn.init.kaiming_uniform_"),
    (lambda w: w.data.bernoulli_(0.5), "bernoulli_"),
])
def test_an_init_it_cannot_record_builds_the_table_whole_with_torchs_values_and_says_so(
        init, call):
    torch.manual_seed(4)
    plain = torch.nn.Parameter(torch.empty(40, 6))
    init(plain)
    torch.manual_seed(4)
    stand = _stand()
    with pytest.warns(UserWarning, match=f"Embedding\\(40, 6\\) is built whole on this "
                                         f"worker: its initialization calls {call}"):
        init(stand)
    assert type(stand) is torch.nn.Parameter and torch.equal(plain, stand)
    assert torch.get_rng_state().equal(_after(init))


def _after(init):
    torch.manual_seed(4)
    init(torch.nn.Parameter(torch.empty(40, 6)))
    return torch.get_rng_state()


def test_given_values_are_the_tables_and_a_view_taken_before_it_was_built_reads_them():
    values = torch.arange(240.0).view(40, 6)
    stand = DeferredTable.standing_for(torch.nn.Parameter(values), "Embedding(40, 6)")
    view = stand.data
    assert stand.initializer.given is not None
    with pytest.warns(UserWarning, match="calls sum"):
        total = view.sum()  # a read: built here, then read
    assert total == values.sum() and stand.data_ptr() == values.data_ptr()


def test_a_view_of_a_table_the_ps_tasks_hold_is_refused_naming_it():
    stand = _stand()
    view = stand.detach()
    stand.served()
    assert view.shape == (40, 6)  # its shape is known
    with pytest.raises(RuntimeError, match=r"view of Embedding\(40, 6\)'s weight, which the "
                                           "ps tasks hold"):
        view.sum()
