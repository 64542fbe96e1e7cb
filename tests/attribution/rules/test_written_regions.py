"""Writes that replace some elements of a tensor (``index_put_``, ``scatter_``, ``masked_scatter_``, ...) (float64).

A view taken before such a write shows what the write put into its elements: a weight's values written over an
activation (``c = h.clone(); v = c[:, :2]; c.index_put_(..., w)``) make it a weight, and an activation written over
part of a weight leaves a view of the other part a weight. The view kept its mark: under AttnLRP and CP-LRP a
product ``v * g`` with a sigmoid gate passed all of its relevance to the weight's values, which lead nowhere (the
relevance of the input lost: 1.0 off in relative L2), or treated a weight as an activation. Oracle: the same model
written out of place, what each view shows written as it is (a parameter's product, the activation's slice). The
elements a write replaces are checked against those whose values changed.
"""

from __future__ import annotations

import pytest
import torch

from tdhook.attribution import CPLRP, AttnLRP, EpsilonPlus
from tdhook.attribution.rules._written_regions import REPLACING, reached_region, replaced_region
from tests.attribution.rules.test_activation_writes import _explained, assert_explained_as_out_of_place

F64 = torch.float64
pytestmark = pytest.mark.filterwarnings("ignore:index_reduce\\(\\) is in beta")  # torch's note on the call itself
ROWS = torch.arange(5)


def _weight(s: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return 3 * s * torch.ones_like(like)


def _first_columns(mask_columns: int = 3) -> torch.Tensor:
    mask = torch.zeros(5, 6, dtype=torch.bool)
    mask[:, :mask_columns] = True
    return mask


# A weight's values written over every element of an activation, a view of which was taken before.
WEIGHT_OVER_ACTIVATION = {
    "index_put_": lambda c, w: c.index_put_((ROWS,), w),
    "index_copy_": lambda c, w: c.index_copy_(1, torch.arange(6), w),
    "masked_scatter_": lambda c, w: c.masked_scatter_(torch.ones_like(c, dtype=torch.bool), w),
    "scatter_": lambda c, w: c.scatter_(1, torch.arange(6).expand(5, 6), w),
    "put_": lambda c, w: c.put_(torch.arange(30), w.reshape(-1)),
    "scatter_reduce_ without self": lambda c, w: c.scatter_reduce_(
        1, torch.arange(6).expand(5, 6), w, "sum", include_self=False
    ),
    "index_reduce_ without self": lambda c, w: c.index_reduce_(1, torch.arange(6), w, "amax", include_self=False),
    "setitem of a list of rows": lambda c, w: c.__setitem__([0, 1, 2, 3, 4], w),
}

# An activation written over the first three columns of a weight, a view of the other three taken before.
ACTIVATION_OVER_PART = {
    "index_put_": lambda c, h: c.index_put_((ROWS[:, None], torch.arange(3)[None]), h[:, :3]),
    "scatter_": lambda c, h: c.scatter_(1, torch.arange(3).expand(5, 3), h[:, :3]),
    "masked_scatter_": lambda c, h: c.masked_scatter_(_first_columns(), h[:, :3]),  # in order: h[:, :3] where written
    "index_copy_": lambda c, h: c.index_copy_(1, torch.arange(3), h[:, :3]),
    "setitem of a column list": lambda c, h: c.__setitem__((slice(None), [0, 1, 2]), h[:, :3]),
}


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP], ids=lambda p: p.__name__)
@pytest.mark.parametrize("write", sorted(WEIGHT_OVER_ACTIVATION))
def test_a_weight_written_over_an_activation_makes_its_views_weights(write: str, preset):
    def in_place(s, h, g):
        c = h.clone()
        v = c[:, :2]
        WEIGHT_OVER_ACTIVATION[write](c, _weight(s, h))
        return v * g[:, :2]

    assert_explained_as_out_of_place(in_place, lambda s, h, g: _weight(s, h[:, :2]) * g[:, :2], preset)


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP], ids=lambda p: p.__name__)
@pytest.mark.parametrize("write", sorted(ACTIVATION_OVER_PART))
def test_an_activation_written_over_part_of_a_weight_leaves_views_of_the_rest_weights(write: str, preset):
    def in_place(s, h, g):
        c = s * torch.ones_like(h)
        rest, written = c[:, 3:], c[:, 1:3]
        ACTIVATION_OVER_PART[write](c, h)
        return torch.cat([rest * g[:, 3:], written * g[:, 1:3]], 1)

    def out_of_place(s, h, g):
        return torch.cat([(s * torch.ones_like(h[:, 3:])) * g[:, 3:], h[:, 1:3] * g[:, 1:3]], 1)

    assert_explained_as_out_of_place(in_place, out_of_place, preset)


def test_a_masked_fill_makes_the_elements_filled_constants():
    """``c.masked_fill_(m, 2.0)`` over an activation: a view of the elements filled shows a constant."""

    def in_place(s, h, g):
        c = h.clone()
        v = c[:, :2]
        c.masked_fill_(_first_columns(2), 2.0)
        return v * g[:, :2]

    for preset in (AttnLRP, CPLRP, EpsilonPlus):
        relevance, _ = _explained(in_place, preset)
        expected, _ = _explained(lambda s, h, g: 2.0 * torch.ones_like(h[:, :2]) * g[:, :2], preset)
        torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12)


def test_a_reduction_with_the_elements_keeps_a_view_an_activation():
    """``scatter_reduce_(..., include_self=True)`` reduces a weight with the activation: the view shows one."""

    def in_place(s, h, g):
        c = h.clone()
        v = c[:, :2]
        c.scatter_reduce_(1, torch.arange(6).expand(5, 6), _weight(s, h), "sum")
        return v * g[:, :2]

    relevance, _ = _explained(in_place, AttnLRP)
    expected, _ = _explained(lambda s, h, g: (h[:, :2] + _weight(s, h[:, :2])) * g[:, :2], AttnLRP)
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12)


def test_an_accumulating_write_keeps_a_view_an_activation():
    """``index_put_(..., accumulate=True)`` adds a weight to the activation: the view still shows an activation."""

    def in_place(s, h, g):
        c = h.clone()
        v = c[:, :2]
        c.index_put_((ROWS,), _weight(s, h), accumulate=True)
        return v * g[:, :2]

    relevance, _ = _explained(in_place, AttnLRP)
    expected, _ = _explained(lambda s, h, g: (h[:, :2] + _weight(s, h[:, :2])) * g[:, :2], AttnLRP)
    torch.testing.assert_close(relevance, expected, rtol=1e-12, atol=1e-12)


# Each replacing write, with arguments that write values unlike every element (zeros written over with ones).
CALLS = {
    torch.Tensor.copy_: lambda t: (t.new_ones(3),),
    torch.Tensor.fill_: lambda t: (1.0,),
    torch.Tensor.zero_: lambda t: (),
    torch.Tensor.__setitem__: lambda t: ((slice(None), [0, 2]), 1.0),
    torch.Tensor.index_put_: lambda t: ((torch.tensor([1, 0]), torch.tensor([2, 2])), t.new_ones(())),
    torch.Tensor.index_copy_: lambda t: (1, torch.tensor([1]), t.new_ones(4, 1)),
    torch.Tensor.index_fill_: lambda t: (0, torch.tensor([3]), 1.0),
    torch.Tensor.masked_fill_: lambda t: (torch.tensor([True, False, True]), 1.0),
    torch.Tensor.masked_scatter_: lambda t: (torch.tensor([[True], [False], [True], [False]]), t.new_ones(4, 3)),
    torch.Tensor.scatter_: lambda t: (1, torch.tensor([[2], [0], [1], [1]]), t.new_ones(4, 1)),
    torch.Tensor.put_: lambda t: (torch.tensor([0, 11, 5]), t.new_ones(3)),
    torch.Tensor.fill_diagonal_: lambda t: (1.0,),
    torch.fill_: lambda t: (1.0,),
    torch.zero_: lambda t: (),
    torch.index_put_: lambda t: ((torch.tensor([3]),), t.new_ones(())),
    torch.Tensor.scatter_reduce_: lambda t: (1, torch.tensor([[2], [0], [1], [1]]), t.new_ones(4, 1), "sum"),
    torch.Tensor.index_reduce_: lambda t: (0, torch.tensor([3]), t.new_ones(1, 3), "prod"),
}
# Keyword arguments of the calls above that make them replace.
KEYWORDS = {torch.Tensor.scatter_reduce_: {"include_self": False}, torch.Tensor.index_reduce_: {"include_self": False}}


@pytest.mark.parametrize("func", list(REPLACING), ids=lambda f: f.__qualname__)
def test_the_region_replaced_is_where_the_values_changed(func):
    assert set(CALLS) == set(REPLACING)
    target = torch.ones(4, 3, dtype=F64) if func in (torch.Tensor.zero_, torch.zero_) else torch.zeros(4, 3, dtype=F64)
    args = (target, *CALLS[func](target))
    kwargs = KEYWORDS.get(func, {})
    region = replaced_region(func, args, kwargs)
    before = target.clone()
    func(*args, **kwargs)
    assert torch.equal(region, target != before)


# Writes that combine what they write with the elements an index picks (ones added into zeros), and their options.
ADDING = {
    torch.Tensor.index_add_: ((1, torch.tensor([1]), torch.ones(4, 1, dtype=F64)), {}),
    torch.Tensor.scatter_add_: ((1, torch.tensor([[2], [0], [1], [1]]), torch.ones(4, 1, dtype=F64)), {}),
    torch.Tensor.index_put_: (((torch.tensor([1, 0]), torch.tensor([2, 2])), torch.ones((), dtype=F64), True), {}),
    torch.Tensor.put_: ((torch.tensor([0, 11, 5]), torch.ones(3, dtype=F64)), {"accumulate": True}),
    torch.Tensor.scatter_: ((1, torch.tensor([[2], [0], [1], [1]]), torch.ones(4, 1, dtype=F64)), {"reduce": "add"}),
    torch.Tensor.scatter_reduce_: ((1, torch.tensor([[2], [0], [1], [1]]), torch.ones(4, 1, dtype=F64), "sum"), {}),
    torch.Tensor.index_reduce_: ((0, torch.tensor([3]), torch.full((1, 3), 2.0, dtype=F64), "prod"), {}),
}


@pytest.mark.parametrize("func", list(ADDING), ids=lambda f: f.__qualname__)
def test_the_region_reached_by_an_indexed_write_that_combines_is_where_the_values_changed(func):
    target = torch.ones(4, 3, dtype=F64) if func is torch.Tensor.index_reduce_ else torch.zeros(4, 3, dtype=F64)
    args, kwargs = ADDING[func]
    args = (target, *args)
    assert replaced_region(func, args, kwargs) is None  # (it replaces none)
    region = reached_region(func, args, kwargs)
    before = target.clone()
    func(*args, **kwargs)
    assert torch.equal(region, target != before)
    assert reached_region(torch.Tensor.add_, (target, 1.0), {}) is None  # every element: no index picks them
