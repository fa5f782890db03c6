"""A table served by rows, read whole (``state_dict``, digests): its chunks fill it
exactly, and a chunk that is not the rows asked (a ps answering fewer or more rows, or
rows of another width) is refused naming the table, the rows and both shapes, never left
as unwritten rows or a raw shape error."""

import pytest
import torch

from csrun.core.cluster import embedding_lookup
from csrun.core.cluster.embedding_lookup import RowTable
from csrun.core.cluster.transport import ParameterServerError

WHOLE = torch.arange(20.0).view(5, 4)


def _table(fetch) -> RowTable:
    return RowTable(3, (5, 4), torch.float32, False, fetch, lambda ids, rows: None,
                    lambda: WHOLE, label="Embedding(5, 4)")


@pytest.fixture(autouse=True)
def chunks_of_two(monkeypatch):
    monkeypatch.setattr(embedding_lookup, "READ_CHUNK_ROWS", 2)  # rows 0-1, 2-3, 4


def test_the_chunks_fill_the_table_in_order():
    asked = []
    table = _table(lambda ids: asked.append(ids.tolist()) or WHOLE[ids])
    assert torch.equal(table.read_all(), WHOLE)
    assert asked == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("answer,shape", [
    (lambda rows: rows[:1], "(1, 4)"),                              # a row short
    (lambda rows: torch.cat([rows, rows[:1]]), "(3, 4)"),           # a row too many
    (lambda rows: rows[:, :3], "(2, 3)"),                           # narrower rows
], ids=["short", "long", "narrow"])
def test_a_chunk_that_is_not_the_rows_asked_is_refused_naming_them(answer, shape):
    table = _table(lambda ids: answer(WHOLE[ids]) if ids[0] == 2 else WHOLE[ids])
    with pytest.raises(ParameterServerError) as refused:
        table.read_all()
    assert str(refused.value) == (
        f"Embedding(5, 4) (variable 3): the ps tasks answered rows of shape {shape} for "
        "its rows 2 to 3, shape (2, 4); the table cannot be read whole")
