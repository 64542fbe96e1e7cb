"""A gate's values written into part of another tensor, in place or chosen by ``where``, then times a signal (float64).

``c = base(h) * 1; c[:, :3] = gate(a)[:, :3]`` (or ``c[:, :3].copy_(...)``, or ``torch.where(first_three, gate(a),
base(h))``) is the gate in its first three columns and the base activation in the others; each is a ReLU's output,
a tanh (a gate of another kind, held by CP-LRP and the CNN presets) or a sigmoid (a sigmoid-like gate, held by every
preset). Oracle, from the definition of the rules on a product: each column's product taken apart, ``torch.cat([gate
* s, base * s])`` on the same columns. The written tensor was one kind in every element, or none (0.09-2.6 off,
relative L2, under AttnLRP and CP-LRP, up to 0.80 under EpsilonPlus).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tdhook.attribution.rules._joined_gates import other_gates_shown
from tdhook.attribution.rules._mixed_gate_products import gate_elements
from tdhook.attribution.rules.functional import FunctionalRules
from tdhook.attribution.rules.gates import mark_gate
from tdhook.attribution.rules.transformer import PseudoIdentityRule, SoftmaxEpsilonRule
from tests.attribution.rules.test_filled_constants import MAPPERS, assert_like_apart

F64 = torch.float64
KINDS = {"relu": torch.relu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}
FIRST_THREE = torch.arange(6) < 3


class Written(nn.Module):
    """``out(c * signal)``, ``c`` the gate over the base activation's first three columns (``form``); ``apart``: the
    products taken per column (the oracle)."""

    def __init__(self, form: str, gate: str, base: str, signal: str, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.h, self.a, self.s, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.form, self.gate, self.base, self.signal, self.apart = form, gate, base, signal, apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, g, s = KINDS[self.base](self.h(x)), KINDS[self.gate](self.a(x)), KINDS[self.signal](self.s(x))
        if self.apart:
            return self.out(torch.cat([g[:, :3] * s[:, :3], h[:, 3:] * s[:, 3:]], 1))
        if self.form == "where":
            return self.out(torch.where(FIRST_THREE, g, h) * s)
        c = h * 1
        if self.form == "c[:, :3] = g[:, :3]":
            c[:, :3] = g[:, :3]
        else:
            c[:, :3].copy_(g[:, :3])
        return self.out(c * s)


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("signal", sorted(KINDS))
@pytest.mark.parametrize(("gate", "base"), [(g, b) for g in sorted(KINDS) for b in sorted(KINDS) if g != b])
@pytest.mark.parametrize("form", ["c[:, :3] = g[:, :3]", "c[:, :3].copy_(g[:, :3])", "where"])
def test_a_gate_written_over_part_of_another_kind_keeps_each_elements_rule(
    form: str, gate: str, base: str, signal: str, mapper: str
):
    model, oracle = Written(form, gate, base, signal).double(), Written(form, gate, base, signal, apart=True).double()
    assert_like_apart(model, oracle, mapper)


def test_the_kinds_written_are_noted_apart():
    # A tanh over part of a sigmoid gate: the sigmoid-like gates where the sigmoid's values stay, gates of any kind in
    # every element; a ReLU's values over part of the tanh's then: gates of any kind where the sigmoid's and the
    # tanh's values are.
    x = torch.randn(2, 6, dtype=F64, requires_grad=True)
    with FunctionalRules(SoftmaxEpsilonRule(), PseudoIdentityRule(), hold_gates=True):
        c = mark_gate(torch.sigmoid(x), x, sigmoid=True) * 1
        c[:, :2] = mark_gate(torch.tanh(x[:, :2]), x)
        sigmoid, other = gate_elements(c)[0].clone(), other_gates_shown(c).clone()
        c[:, 1:2] = torch.relu(x[:, 1:2])
        after = other_gates_shown(c)
    assert sigmoid[0].tolist() == [False, False, True, True, True, True]
    assert other[0].tolist() == [True] * 6
    assert after[0].tolist() == [True, False, True, True, True, True]


class ActivatedInPart(nn.Module):
    """``out(c * signal)``, ``c = base(h) * 1`` with a tanh or a sigmoid computed in place on its first three columns
    (``c[:, :3].tanh_()``, an LSTM cell's gates activated in place); ``apart``: each column's product taken apart."""

    def __init__(self, activation: str, base: str, signal: str, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.h, self.s, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.activation, self.base, self.signal, self.apart = activation, base, signal, apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z, s = self.h(x), KINDS[self.signal](self.s(x))
        if self.apart:
            first = KINDS[self.activation](KINDS[self.base](z[:, :3]))
            return self.out(torch.cat([first * s[:, :3], KINDS[self.base](z[:, 3:]) * s[:, 3:]], 1))
        c = KINDS[self.base](z) * 1
        if self.activation == "tanh":
            c[:, :3].tanh_()
        else:
            c[:, :3].sigmoid_()
        return self.out(c * s)


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("signal", sorted(KINDS))
@pytest.mark.parametrize("base", sorted(KINDS))
@pytest.mark.parametrize("activation", ["sigmoid", "tanh"])
def test_a_gate_computed_in_place_on_part_of_a_tensor_is_its_gate_there(
    activation: str, base: str, signal: str, mapper: str
):
    # The tanh's elements were no gate to CP-LRP, and a sigmoid's over part of a gate left the tensor no gate, or
    # the other kind's (0.03-1.5 off, relative L2, under AttnLRP and CP-LRP, 0.27-0.83 under EpsilonPlus).
    model = ActivatedInPart(activation, base, signal).double()
    assert_like_apart(model, ActivatedInPart(activation, base, signal, apart=True).double(), mapper)


WEIGHED = {**KINDS, "softmax": lambda z: torch.softmax(z, -1)}


class Chosen(nn.Module):
    """``out(torch.where(first_three, first(a), second(h)) * signal)``, each a ReLU's, a tanh's, a sigmoid's output or
    a softmax's weights; ``apart``: each column's product taken apart."""

    def __init__(self, first: str, second: str, signal: str, apart: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.h, self.s, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.kinds, self.apart = (first, second, signal), apart

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first, second, signal = (
            WEIGHED[kind](layer(x)) for kind, layer in zip(self.kinds, (self.a, self.h, self.s), strict=True)
        )
        if self.apart:
            return self.out(torch.cat([first[:, :3] * signal[:, :3], second[:, 3:] * signal[:, 3:]], 1))
        return self.out(torch.where(FIRST_THREE, first, second) * signal)


@pytest.mark.parametrize("mapper", sorted(MAPPERS))
@pytest.mark.parametrize("signal", sorted(WEIGHED))
@pytest.mark.parametrize(("first", "second"), [(f, s) for f in sorted(WEIGHED) for s in sorted(WEIGHED) if f != s])
def test_a_choice_of_two_kinds_keeps_each_elements_rule(first: str, second: str, signal: str, mapper: str):
    # A tanh chosen beside an activation was no gate to CP-LRP (0.09-2.1 off, relative L2); times a softmax's weights,
    # the elements of a sigmoid gate chosen in part that were none took the uniform rule (0.18-0.55 off, AttnLRP).
    assert_like_apart(
        Chosen(first, second, signal).double(), Chosen(first, second, signal, apart=True).double(), mapper
    )
