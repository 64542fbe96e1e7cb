"""A gate or a softmax's weights with constants written into some elements (``masked_fill``, ``torch.where`` with a
number, a padding mask) is a gate, or weights, still: held where a product takes it.

The oracle: the same model with the filled gate detached (a gate held is a constant to the product: its relevance
all the signal's); for a join of a gate and another activation, the join's gate elements detached and the other's
product taken apart. Each model is explained twice in one open context: the first call records the rules, the
second may apply them without the function modes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tdhook.attribution.mappers.presets import EpsilonPlus
from tdhook.attribution.mappers.transformer import CPLRP, AttnLRP
from tdhook.attribution.rules._filled_gates import filled_pieces
from tdhook.attribution.rules.gates import is_gate, keep_gate_mark, mark_gate
from tests.attribution.rules._helpers import randn
from tests.attribution.rules._oracle_calls import check_like_oracle

MAPPERS = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, "EpsilonPlus": EpsilonPlus}
_MASK = torch.tensor([True, False, True, False, False, True])

#: Constants written into some elements of a tensor of shape (batch, 6).
FILLED = {
    "t.masked_fill(mask, 0.0)": lambda t: t.masked_fill(_MASK, 0.0),
    "torch.masked_fill(t, mask, 1.0)": lambda t: torch.masked_fill(t, _MASK, 1.0),
    "t.masked_fill(mask, tensor(0.0))": lambda t: t.masked_fill(_MASK, torch.tensor(0.0, dtype=t.dtype)),
    "torch.where(c, t, 0.0)": lambda t: torch.where(~_MASK, t, 0.0),
    "torch.where(c, 0.5, t)": lambda t: torch.where(_MASK, 0.5, t),
    "t.where(c, zeros)": lambda t: t.where(~_MASK, torch.zeros(6, dtype=t.dtype)),
    "aten.masked_fill": lambda t: torch.ops.aten.masked_fill.Scalar(t, _MASK, 0.0),
    # By keyword (read by position alone, no gate was kept: 1.2 off, relative L2, under AttnLRP and CP-LRP, 0.76
    # under EpsilonPlus).
    "torch.where(c, t, other=0.0)": lambda t: torch.where(~_MASK, t, other=0.0),
    "torch.where(condition=c, input=t, other=0.0)": lambda t: torch.where(condition=~_MASK, input=t, other=0.0),
    "t.where(condition=c, other=0.0)": lambda t: t.where(condition=~_MASK, other=0.0),
    "torch.masked_fill(input=t, mask=mask, value=1.0)": lambda t: torch.masked_fill(input=t, mask=_MASK, value=1.0),
}


class Filled(nn.Module):
    """A sigmoid's gate or a softmax's weights over 6 units (``kind``), or (``joined``) a gate over 3 joined with an
    activation over 3, filled by ``fill`` and times a signal; ``apart``: the filled gate detached (the oracle)."""

    def __init__(self, fill: str, kind: str, joined: bool = False, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.h, self.s = nn.Linear(4, 3 if joined else 6), nn.Linear(4, 3), nn.Linear(4, 6)
        self.out = nn.Linear(6, 3)
        self.fill, self.kind, self.joined, self.apart = FILLED.get(fill, fill), kind, joined, apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(self.a(x), -1) if self.kind == "softmax" else torch.sigmoid(self.a(x))
        signal = torch.relu(self.s(x))
        filled = self.fill(torch.cat([gate, torch.relu(self.h(x))], 1) if self.joined else gate)
        if not self.apart:
            return self.out(filled * signal)
        held = filled.detach()
        if self.joined:
            return self.out(torch.cat([held[:, :3] * signal[:, :3], filled[:, 3:] * signal[:, 3:]], 1))
        return self.out(held * signal)


def _check(fill, kind: str, joined: bool, mapper: str) -> None:
    torch.manual_seed(1)
    model, oracle = Filled(fill, kind, joined).double(), Filled(fill, kind, joined, apart=True).double()
    check_like_oracle(model, oracle, randn(3, 4), MAPPERS[mapper])


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("fill", sorted(FILLED))
def test_a_gate_with_constants_written_into_it_is_one(fill: str, mapper: str):
    # It was none: the product shared its relevance with the gate (1.7-6.5 off, relative L2, under AttnLRP and
    # CP-LRP, 0.04-0.22 under EpsilonPlus).
    _check(fill, "sigmoid", False, mapper)


@pytest.mark.parametrize("fill", sorted(FILLED))
def test_weights_with_constants_written_into_them_are_weights(fill: str):
    # They were none: AttnLRP shared the product's relevance with them (0.50-0.54 off, relative L2).
    _check(fill, "softmax", False, "AttnLRP")


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("fill", sorted(FILLED))
def test_a_join_of_a_gate_and_others_filled_keeps_its_gate_elements(fill: str, mapper: str):
    # Its gate elements were lost (0.61-1.1 off, relative L2, under AttnLRP and CP-LRP, 0.04-0.12 under EpsilonPlus).
    _check(fill, "sigmoid", True, mapper)


def _set_columns(t: torch.Tensor) -> torch.Tensor:
    t[:, :2] = 1.0
    return t


IN_PLACE = {
    "g.masked_fill_(mask, 0.0)": lambda t: (t * 1).masked_fill_(_MASK, 0.0),
    "g[:, :2] = 1.0": lambda t: _set_columns(t * 1),
}


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("fill", sorted(IN_PLACE))
def test_a_gate_with_a_constant_written_in_place_is_one(fill: str, mapper: str):
    # A gate's marks were dropped as after any write into part of it (1.3-6.5 off, relative L2, under AttnLRP and
    # CP-LRP, 0.10-0.22 under EpsilonPlus).
    _check(IN_PLACE[fill], "sigmoid", False, mapper)


def test_the_pieces_kept_by_a_fill_are_marked_as_they_are():
    x = randn(2, 6).requires_grad_(True)
    gate = mark_gate(torch.sigmoid(x * 1), x, sigmoid=True)
    assert is_gate(keep_gate_mark(torch.where, (_MASK, gate, 0.0), torch.where(_MASK, gate, 0.0)))
    assert not is_gate(keep_gate_mark(torch.where, (_MASK, gate, x * 2), torch.where(_MASK, gate, x * 2)))
    assert filled_pieces(torch.Tensor.masked_fill, (gate, _MASK, x[0, 0] * 1), {}) is None  # an activation written


#: A gate (``t``) chosen element by element with a parameter (``p``, of shape (6,)): the parameter a constant.
CHOSEN_WITH_PARAMETER = {
    "torch.where(c, t, p)": lambda t, p: torch.where(_MASK, t, p),
    "torch.where(c, p.expand(...), t)": lambda t, p: torch.where(_MASK, p.expand(t.shape), t),
    "t.where(c, other=p)": lambda t, p: t.where(_MASK, other=p),
}


class ChosenWithParameter(Filled):
    """:class:`Filled` with the gate chosen with a parameter of the model as ``choice`` says."""

    def __init__(self, choice: str, kind: str, apart: bool = False) -> None:
        super().__init__(lambda t: CHOSEN_WITH_PARAMETER[choice](t, self.p), kind, apart=apart)
        self.p = nn.Parameter(torch.randn(6))


# A softmax's weights are held by the transformer presets alone: under EpsilonPlus a softmax is no gate.
CHOSEN_KINDS = [(mapper, "sigmoid") for mapper in sorted(MAPPERS)]
CHOSEN_KINDS += [(mapper, "softmax") for mapper in sorted(MAPPERS) if mapper != "EpsilonPlus"]


@pytest.mark.parametrize(("mapper", "kind"), CHOSEN_KINDS)
@pytest.mark.parametrize("choice", sorted(CHOSEN_WITH_PARAMETER))
def test_a_gate_chosen_with_a_parameter_is_one(choice: str, mapper: str, kind: str):
    # The parameter was taken as an activation that is no gate: the product gave its elements' relevance in part to
    # it, which passes it to nothing (0.12-0.50 off, relative L2, under AttnLRP and CP-LRP; weights 0.31 under AttnLRP).
    torch.manual_seed(1)
    model, oracle = ChosenWithParameter(choice, kind).double(), ChosenWithParameter(choice, kind, apart=True).double()
    check_like_oracle(model, oracle, randn(3, 4), MAPPERS[mapper])
