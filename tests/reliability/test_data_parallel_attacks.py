"""Attacks on ``csrun.core.DataParallel``'s scatter and gather (issue 39, round 4).

Two found silent wrong results: inputs of 10 and 7 rows were split 5/5 and 5/2 and a
(10, 3) result came back (``torch.nn.DataParallel`` does the same); a forward that
returns a generator came back as a list of the replicas' generators, whose tensors skip
the gather and the backward (``torch.nn.DataParallel`` raises ``TypeError``). Each is
refused now, with a message that names what and where. The other cases here held and
keep holding.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import csrun.core as cs

DEVICES = ["CPU:0", "CPU:1"]


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.left, self.right = nn.Linear(2, 3), nn.Linear(2, 3)

    def forward(self, a, b=None, **extra):
        out = self.left(a)
        return out if b is None else out + self.right(b)


def test_inputs_whose_batch_sizes_differ_are_refused_naming_both():
    model = cs.DataParallel(Pair(), device_ids=DEVICES)
    with pytest.raises(ValueError, match=r"args\[0\] has 10 along dim 0, args\[1\] has 7"):
        model(torch.ones(10, 2), torch.ones(7, 2))


def test_a_nested_keyword_input_of_another_batch_size_is_named_by_its_path():
    model = cs.DataParallel(Pair(), device_ids=DEVICES)
    with pytest.raises(ValueError, match=r"kwargs\['extra'\]\['mask'\] has 4"):
        model(torch.ones(6, 2), extra={"mask": torch.ones(4, 1)})


def test_inputs_of_one_batch_size_still_split_unevenly():
    model = cs.DataParallel(Pair(), device_ids=["CPU:0", "CPU:1", "CPU:2"])
    out = model(torch.ones(7, 2), torch.ones(7, 2))
    assert out.shape == (7, 3)


class Yields(nn.Module):
    def __init__(self, make):
        super().__init__()
        self.linear, self.make = nn.Linear(2, 2), make

    def forward(self, x):
        return self.make(self.linear(x))


@pytest.mark.parametrize("make, kind", [
    (lambda y: (t for t in [y]), "generator"),
    (lambda y: iter([y]), "list_iterator"),
    (lambda y: map(torch.relu, [y]), "map"),
    (lambda y: {"logits": y, "rows": (r for r in y)}, "generator"),  # nested
])
def test_an_output_it_cannot_gather_is_refused_naming_its_type(make, kind):
    model = cs.DataParallel(Yields(make), device_ids=DEVICES)
    with pytest.raises(TypeError, match=f"cannot gather the {kind} the module returned"):
        model(torch.ones(4, 2))


def test_an_object_without_attributes_that_differs_is_refused_naming_its_type():
    class Slotted:
        __slots__ = ("rows",)

        def __init__(self, rows):
            self.rows = rows

    model = cs.DataParallel(Yields(lambda y: Slotted(len(y))), device_ids=DEVICES)
    with pytest.raises(TypeError, match="cannot gather the Slotted the module returned"):
        model(torch.ones(5, 2))


def test_plain_values_the_replicas_agree_on_come_back_once_and_others_as_a_list():
    model = cs.DataParallel(Yields(lambda y: (y, "tag", len(y))), device_ids=DEVICES)
    out, tag, rows = model(torch.ones(5, 2))
    assert out.shape == (5, 2) and tag == "tag" and rows == [3, 2]


def test_a_cyclic_object_is_refused_not_recursed_forever():
    class Node:
        def __init__(self, value):
            self.value, self.me = value, self

    model = cs.DataParallel(Yields(Node), device_ids=DEVICES)
    with pytest.raises(TypeError, match="nest more than"):
        model(torch.ones(4, 2))
