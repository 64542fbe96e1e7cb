"""Writes out of place (``c.index_add(1, i, h)``, ``torch.scatter(c, 1, i, h)``, ``torch.slice_scatter(c, h, 1)``)
and in place through an index that adds (``c.index_add_(1, i, h)``, ``c.index_put_(..., accumulate=True)``), times a
signal (float64).

An activation written or added into part of a constant (a buffer) leaves constants in the other elements, which in a
product take none of the relevance, as they do multiplied apart; a gate's values written into part of an activation
are a gate there; an activation added into part of a gate leaves a gate in the other elements. Oracle, from that
definition: the same values with each element's product taken apart, ``torch.where(m, reached * s, c * s)``
(``reached`` the activation written, or its sum with ``c`` for a write that adds); the layers and the signal are the
same.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from tdhook.attribution.rules._written_copies import WRITES_INTO_COPIES, writes_into_copy
from tests.attribution.rules.test_filled_constants import MAPPERS, assert_like_apart

IDX = torch.tensor([0, 2, 5])
REACHED = torch.zeros(6, dtype=torch.bool).index_fill(0, IDX, True)
ACTIVATIONS = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}


def _rows(c: torch.Tensor) -> torch.Tensor:
    return torch.arange(c.shape[0])[:, None]


def _index(c: torch.Tensor) -> torch.Tensor:
    return IDX.expand(c.shape[0], -1)


def _flat(c: torch.Tensor) -> torch.Tensor:
    return (_rows(c) * c.shape[1] + IDX).flatten()


Write = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
# Writes that put ``h``'s values at the columns IDX of ``c`` (out of place)
REPLACING: dict[str, Write] = {
    "c.index_copy": lambda c, h: c.index_copy(1, IDX, h[:, IDX]),
    "torch.index_copy": lambda c, h: torch.index_copy(c, 1, IDX, h[:, IDX]),
    "c.scatter": lambda c, h: c.scatter(1, _index(c), h[:, IDX]),
    "torch.scatter": lambda c, h: torch.scatter(c, 1, _index(c), h[:, IDX]),
    "c.index_put": lambda c, h: c.index_put((_rows(c), IDX[None]), h[:, IDX]),
    "c.masked_scatter": lambda c, h: c.masked_scatter(REACHED.expand_as(c), h[:, IDX]),
    "c.put": lambda c, h: c.put(_flat(c), h[:, IDX].flatten()),
    "torch.select_scatter": lambda c, h: torch.select_scatter(
        torch.select_scatter(torch.select_scatter(c, h[:, 0], 1, 0), h[:, 2], 1, 2), h[:, 5], 1, 5
    ),
    "torch.slice_scatter": lambda c, h: torch.slice_scatter(
        torch.slice_scatter(c, h[:, 0:3:2], 1, 0, 3, 2), h[:, 5:], 1, 5
    ),
}


def _columns_one_by_one(c: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    for column in IDX.tolist():
        c[:, column] = h[:, column]
    return c


# The same writes in place
REPLACING_IN_PLACE: dict[str, Write] = {
    "c.index_copy_": lambda c, h: c.index_copy_(1, IDX, h[:, IDX]),
    "c.scatter_": lambda c, h: c.scatter_(1, _index(c), h[:, IDX]),
    "c.index_put_": lambda c, h: c.index_put_((_rows(c), IDX[None]), h[:, IDX]),
    "c.masked_scatter_": lambda c, h: c.masked_scatter_(REACHED.expand_as(c), h[:, IDX]),
    "c[:, i] = h[:, i], one by one": _columns_one_by_one,
}
REPLACING |= REPLACING_IN_PLACE
# Writes that add ``h``'s values at the columns IDX of ``c`` (out of place, and in place)
ADDING: dict[str, Write] = {
    "c.index_add": lambda c, h: c.index_add(1, IDX, h[:, IDX]),
    "torch.index_add": lambda c, h: torch.index_add(c, 1, IDX, h[:, IDX]),
    "c.scatter_add": lambda c, h: c.scatter_add(1, _index(c), h[:, IDX]),
    "torch.scatter_add": lambda c, h: torch.scatter_add(c, 1, _index(c), h[:, IDX]),
    "c.index_put(accumulate=True)": lambda c, h: c.index_put((_rows(c), IDX[None]), h[:, IDX], accumulate=True),
    "c.scatter_reduce(sum)": lambda c, h: c.scatter_reduce(1, _index(c), h[:, IDX], "sum"),
    "c.index_add_": lambda c, h: c.index_add_(1, IDX, h[:, IDX]),
    "c.scatter_add_": lambda c, h: c.scatter_add_(1, _index(c), h[:, IDX]),
    "c.index_put_(accumulate=True)": lambda c, h: c.index_put_((_rows(c), IDX[None]), h[:, IDX], accumulate=True),
    "c.put_(accumulate=True)": lambda c, h: c.put_(_flat(c), h[:, IDX].flatten(), accumulate=True),
    "c.scatter_reduce_(sum)": lambda c, h: c.scatter_reduce_(1, _index(c), h[:, IDX], "sum"),
}


class Written(nn.Module):
    """``out(write(c, act(h(x))) * signal(s(x)))``, ``c`` a constant buffer or an activation (``root``), or
    (``apart``) each element's product taken apart."""

    def __init__(self, write: str, root: str, activation: str, signal: str, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.h, self.s, self.r, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.register_buffer("constant", torch.randn(6) + 2.0)
        self.write, self.root, self.activation, self.signal, self.apart = write, root, activation, signal, apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = ACTIVATIONS[self.activation](self.h(x))
        s = ACTIVATIONS[self.signal](self.s(x))
        if self.root == "constant":
            c = self.constant.expand(x.shape[0], -1).clone()
        else:
            c = ACTIVATIONS[self.root](self.r(x)) * 1.0  # (a copy: some writes are in place, into what no node saved)
        if self.apart:
            reached = c + h if self.write in ADDING else h
            return self.out(torch.where(REACHED, reached * s, c * s))
        return self.out({**REPLACING, **ADDING}[self.write](c, h) * s)


def _check(write: str, root: str, activation: str, signal: str, mapper: str) -> None:
    model = Written(write, root, activation, signal).double()
    assert_like_apart(model, Written(write, root, activation, signal, apart=True).double(), mapper)


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("signal", ["relu", "sigmoid"])
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("write", REPLACING)
def test_an_activation_written_into_part_of_a_constant_leaves_the_constants_none(
    write: str, activation: str, signal: str, mapper: str
):
    # Out of place, the result was an activation in every element: 0.72-1.1 off, relative L2, under AttnLRP and
    # CP-LRP, up to 1.1 under EpsilonPlus (times a sigmoid gate); a tanh written so 0.29-0.81. In place, a sigmoid
    # gate's values over every element that was no constant left a gate whole, unmarked (0.03-0.72); a tanh's
    # written twice counted as a sigmoid's in a later call (0.72).
    _check(write, "constant", activation, signal, mapper)


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("signal", ["relu", "sigmoid"])
@pytest.mark.parametrize("activation", ["tanh", "sigmoid"])
@pytest.mark.parametrize("write", [write for write in REPLACING if write not in REPLACING_IN_PLACE])
def test_a_gate_written_out_of_place_into_part_of_an_activation_is_a_gate_there(
    write: str, activation: str, signal: str, mapper: str
):
    # It was none: 0.62-1.0 off, relative L2, under AttnLRP and CP-LRP (a tanh's under CP-LRP 0.65), 0.16-0.21
    # under EpsilonPlus.
    _check(write, "relu", activation, signal, mapper)


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("signal", ["relu", "sigmoid"])
@pytest.mark.parametrize(("root", "activation"), [("constant", "relu"), ("constant", "sigmoid"), ("sigmoid", "relu")])
@pytest.mark.parametrize("write", ADDING)
def test_an_activation_added_into_part_of_a_constant_or_a_gate_leaves_the_rest_what_it_was(
    write: str, root: str, activation: str, signal: str, mapper: str
):
    # Every element was an activation's after the write: into a constant 0.50-1.07 off, relative L2, under AttnLRP
    # and CP-LRP, up to 1.03 under EpsilonPlus; into a sigmoid gate, which was left no gate, 0.58-1.7.
    _check(write, root, activation, signal, mapper)


def test_a_write_of_an_activation_into_an_activation_runs_as_it_is():
    # (so that the graph is the one a later call, planned without the rules' modes, makes)
    x = torch.randn(2, 6, requires_grad=True)
    h, g = x * 2, x * 3
    index = torch.tensor([0, 1])
    assert not writes_into_copy(torch.Tensor.index_add, (h, 1, index, g[:, :2]), {})
    assert writes_into_copy(torch.Tensor.index_add, (torch.zeros(2, 6), 1, index, g[:, :2]), {})
    assert writes_into_copy(torch.Tensor.index_fill, (h, 1, index, 2.0), {})
    assert writes_into_copy(torch.scatter, (), {"input": torch.zeros(2, 6), "dim": 1, "index": index[None], "src": g})
    with torch.no_grad():
        assert not writes_into_copy(torch.Tensor.index_add, (torch.zeros(2, 6), 1, index, g[:, :2]), {})
    assert torch.Tensor.index_add in WRITES_INTO_COPIES and torch.slice_scatter in WRITES_INTO_COPIES


class Broadcast(nn.Module):
    """``out(c.masked_scatter(m, h[m]) * relu(s(x)))`` with ``c`` a buffer of one row, which the call broadcasts to the
    mask's rows; or (``apart``) the products apart."""

    def __init__(self, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.h, self.s, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.register_buffer("constant", torch.randn(6) + 2.0)
        self.apart = apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, s = torch.relu(self.h(x)), torch.relu(self.s(x))
        mask = torch.tensor(
            [[True, False, True, False, False, True]] * 3 + [[False, True, True, False, True, False]] * 2
        )
        if self.apart:
            return self.out(torch.where(mask, h * s, self.constant * s))
        return self.out(self.constant.masked_scatter(mask, h[mask]) * s)


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
def test_a_masked_scatter_that_broadcasts_the_tensor_written_into_is_followed(mapper: str):
    # Made in place into a copy, it raised (the in-place call does not broadcast); before, 0.50 off under AttnLRP.
    assert_like_apart(Broadcast().double(), Broadcast(apart=True).double(), mapper)
