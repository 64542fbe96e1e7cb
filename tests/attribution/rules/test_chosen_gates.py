"""A ``where`` of two activations, one a gate or a softmax's weights (``torch.where(c, g, h)``), is a gate (or weights)
where it took the gate's elements, and what the other is elsewhere: a product with it holds, element by element.

The oracle: the same model with the product taken per element before the choice (``where(c, g * s, h * s)``, the
products of each piece whole, which the gate tests check). Each model is explained twice in one open context: the
first call records the rules, the second may apply them without the function modes.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tdhook.attribution.mappers.presets import EpsilonPlus
from tdhook.attribution.mappers.transformer import CPLRP, AttnLRP
from tdhook.attribution.rules._chosen_gates import keep_chosen_elements
from tdhook.attribution.rules._joined_weights import weights_shown
from tdhook.attribution.rules._mixed_gate_products import gate_elements
from tdhook.attribution.rules.gates import is_gate, mark_gate, mark_weights
from tests.attribution.rules._helpers import randn
from tests.attribution.rules._oracle_calls import check_like_oracle

MAPPERS = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, "EpsilonPlus": EpsilonPlus}
_C = torch.tensor([True, False, True, False, False, True])


def _mixed(g: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    return torch.cat([g[:, :3], h[:, 3:]], 1)


#: (the product with the choice, the oracle's per element) of a gate ``g``, a signal ``s`` and an activation ``h``.
FORMS = {
    "where(c, g, h) * s": (
        lambda g, s, h: torch.where(_C, g, h) * s,
        lambda g, s, h: torch.where(_C, g * s, h * s),
    ),
    "s * where(c, h, g)": (
        lambda g, s, h: s * torch.where(_C, h, g),
        lambda g, s, h: torch.where(_C, s * h, s * g),
    ),
    "g.where(c, h) * s": (
        lambda g, s, h: g.where(_C, h) * s,
        lambda g, s, h: torch.where(_C, g * s, h * s),
    ),
    "where(condition=c, input=g, other=h) * s": (
        lambda g, s, h: torch.where(condition=_C, input=g, other=h) * s,
        lambda g, s, h: torch.where(_C, g * s, h * s),
    ),
    "where(c, g, s) * h": (  # the signal chosen where the gate is not: the product's relevance its, there
        lambda g, s, h: torch.where(_C, g, s) * h,
        lambda g, s, h: torch.where(_C, g * h, s * h),
    ),
    "where(c, g, h).t().contiguous() * s.t()": (
        lambda g, s, h: (torch.where(_C, g, h).t().contiguous() * s.t()).t(),
        lambda g, s, h: torch.where(_C, g * s, h * s),
    ),
    "where(c, cat([g, h]), h) * s": (  # a join of a gate and an activation chosen from
        lambda g, s, h: torch.where(_C, _mixed(g, h), h) * s,
        lambda g, s, h: torch.where(_C, _mixed(g * s, h * s), h * s),
    ),
}


class Chosen(nn.Module):
    """A sigmoid's gate or a softmax's weights over 6 units (``kind``) chosen with an activation as ``form`` says,
    times a signal; ``apart``: the products taken per element before the choice (the oracle)."""

    def __init__(self, form: str, kind: str, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.h, self.s, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.product, self.kind, self.apart = FORMS[form][1 if apart else 0], kind, apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.softmax(self.a(x), -1) if self.kind == "softmax" else torch.sigmoid(self.a(x))
        return self.out(self.product(g.detach() if self.apart else g, torch.relu(self.s(x)), torch.relu(self.h(x))))


def _check(form: str, kind: str, mapper: str) -> None:
    torch.manual_seed(1)
    model, oracle = Chosen(form, kind).double(), Chosen(form, kind, apart=True).double()
    check_like_oracle(model, oracle, randn(3, 4), MAPPERS[mapper])


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_gate_chosen_with_an_activation_is_one_where_it_was_chosen(form: str, mapper: str):
    # It was none: the product shared the gate elements' relevance with the gate (0.73-1.3 off, relative L2, under
    # AttnLRP and CP-LRP, 0.05-0.30 under EpsilonPlus).
    _check(form, "sigmoid", mapper)


@pytest.mark.parametrize("form", ["where(c, g, h) * s", "s * where(c, h, g)", "where(c, g, s) * h"])
def test_weights_chosen_with_an_activation_are_weights_where_they_were_chosen(form: str):
    # They were none: AttnLRP shared their elements' relevance with them.
    _check(form, "softmax", "AttnLRP")


def test_the_elements_chosen_are_noted_as_their_pieces_are():
    x = randn(2, 6).requires_grad_(True)
    gate, other = mark_gate(torch.sigmoid(x * 1), x, sigmoid=True), x * 2
    chosen = torch.where(_C, gate, other)
    keep_chosen_elements(_C, (gate, other), chosen)
    assert not is_gate(chosen) and torch.equal(gate_elements(chosen)[0], _C.expand(2, 6))
    weights = mark_weights(torch.softmax(x * 1, -1))
    chosen = torch.where(_C, other, weights)
    keep_chosen_elements(_C, (other, weights), chosen)
    assert torch.equal(weights_shown(chosen), ~_C.expand(2, 6))
    plain = torch.where(_C, other, x * 3)  # no gate, no weights: nothing noted
    keep_chosen_elements(_C, (other, x * 3), plain)
    assert gate_elements(plain) is None and weights_shown(plain) is None


class Cell(nn.Module):
    """Two steps of an LSTM cell (hidden size 3) written out, its activations computed whole and chosen by ``where``
    (``torch.where(is_cell, gates.tanh(), gates.sigmoid())``) or, ``apart``, per chunk (the oracle)."""

    def __init__(self, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.x2h, self.h2h, self.out, self.apart = (
            nn.Linear(4, 12),
            nn.Linear(3, 12, bias=False),
            nn.Linear(3, 2),
            apart,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = c = torch.zeros(x.shape[0], 3, dtype=x.dtype)
        is_cell = torch.arange(12) // 3 == 2
        for t in range(x.shape[1]):
            gates = self.x2h(x[:, t]) + self.h2h(h)
            if self.apart:
                i, f, g, o = gates.chunk(4, 1)
                i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
            else:
                i, f, g, o = torch.where(is_cell, gates.tanh(), gates.sigmoid()).chunk(4, 1)
            c = f * c + i * g
            h = o * torch.tanh(c)
        return self.out(h)


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
def test_an_lstm_cell_with_its_activations_chosen_by_where_is_the_cell_apart(mapper: str):
    # A where of a tanh and a sigmoid was a gate of another kind whole, and its chunks too: AttnLRP shared the
    # products' relevance with the sigmoid gates (477 off, relative L2, under AttnLRP and CP-LRP, 0.71 under
    # EpsilonPlus).
    torch.manual_seed(1)
    check_like_oracle(Cell().double(), Cell(apart=True).double(), randn(3, 2, 4), MAPPERS[mapper])
