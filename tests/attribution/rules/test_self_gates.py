"""Activations written out as a signal times a gate computed from it, in a gated MLP, against closed forms (float64).

CP-LRP's oracle: with LRP-0 on the Linear layers, the relevance of a gated MLP ``down(act(g) * up)`` is gradient ×
input of the model with ``act(g)`` detached (the gate held: the ``up`` path takes all of the unit's relevance).
AttnLRP's: the same model with ``F.silu`` (or ``F.gelu``) in place of the written-out activation.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.transformer import CPLRP, AttnLRP
from tdhook.attribution.rules._self_gates import mark_self_gated
from tdhook.attribution.rules.gates import is_gate, mark_gate
from tests.attribution.rules._helpers import randn
from tests.conftest import relative_error

WRITTEN_OUT = {  # the activation written out, and the function it computes
    "g * sigmoid(g)": (lambda g: g * torch.sigmoid(g), F.silu),
    "sigmoid(g) * g": (lambda g: torch.sigmoid(g) * g, F.silu),
    "0.5 * g * (1 + tanh(...))": (
        lambda g: 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))),
        lambda g: F.gelu(g, approximate="tanh"),
    ),
    "g * sigmoid(1.702 * g)": (lambda g: g * torch.sigmoid(1.702 * g), None),
}


class GatedUnit(nn.Module):
    """``down(act(gate(x)) * up(x))``, the activation given as a function; ``held`` detaches its output."""

    def __init__(self, activation, held: bool = False) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(6, 8, bias=False), nn.Linear(6, 8, bias=False)
        self.down = nn.Linear(8, 3, bias=False)
        self.activation, self.held = activation, held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        unit = self.activation(self.gate(x))
        return self.down((unit.detach() if self.held else unit) * self.up(x))


def relevances(model: nn.Module, x: torch.Tensor, mapper, calls: int = 2) -> list[torch.Tensor]:
    """The input relevance of output 0, from ``calls`` calls in one context (later ones may run without the mode)."""
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"], target=0)
    with lrp:
        return [lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"] for _ in range(calls)]


def gradient_times_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(x)[..., 0].sum(), x)
    return x.detach() * grad


@pytest.mark.parametrize("form", sorted(WRITTEN_OUT))
def test_cplrp_holds_a_written_out_activation_in_a_gated_unit(form: str):
    # Only the sigmoid inside the written-out activation was held: the outer product split the unit's relevance
    # between both paths (10.8 % relative L2 for SiLU, 15 % for the GELUs), conserving, with no warning.
    torch.manual_seed(0)
    model = GatedUnit(WRITTEN_OUT[form][0]).double()
    held = GatedUnit(WRITTEN_OUT[form][0], held=True).double()
    held.load_state_dict(model.state_dict())
    x = randn(2, 5, 6)
    expected = gradient_times_input(held, x)
    for relevance in relevances(model, x, CPLRP()):
        assert relative_error(relevance, expected) <= 1e-12


@pytest.mark.parametrize("form", [form for form in sorted(WRITTEN_OUT) if WRITTEN_OUT[form][1] is not None])
def test_attnlrp_explains_a_written_out_activation_as_the_function(form: str):
    torch.manual_seed(0)
    model, function = GatedUnit(WRITTEN_OUT[form][0]).double(), GatedUnit(WRITTEN_OUT[form][1]).double()
    function.load_state_dict(model.state_dict())
    x = randn(2, 5, 6)
    (expected,) = relevances(function, x, AttnLRP(), calls=1)
    for relevance in relevances(model, x, AttnLRP()):
        assert relative_error(relevance, expected) <= 1e-8  # the pass rule's stabiliser against the held gate's


def test_a_gate_of_other_values_makes_no_activation():
    """A GLU's gate (the other half of a ``chunk``), a squeeze-excite gate (of the signal's mean) and a gate of two
    values the signal sums are computed from other values than the signal: their products are no activation's
    output; a Swish with a learned slope per unit is one."""
    h = randn(2, 8).requires_grad_(True) * 1
    signal, other = h.chunk(2, -1)
    glu_gate = mark_gate(torch.sigmoid(other), other, sigmoid=True)
    pooled = signal.mean(-1, keepdim=True).expand_as(signal)
    excite_gate = mark_gate(torch.sigmoid(pooled), pooled, sigmoid=True)
    difference = signal - other
    both_gate = mark_gate(torch.sigmoid(difference), difference, sigmoid=True)
    for value, gate in [(signal, glu_gate), (signal, excite_gate), (signal + other, both_gate)]:
        product = value * gate
        mark_self_gated((value, gate), product)
        assert not is_gate(product)
    scaled = signal * nn.Parameter(randn(4))
    gate = mark_gate(torch.sigmoid(scaled), scaled, sigmoid=True)
    swish = signal * gate
    mark_self_gated((signal, gate), swish)
    assert is_gate(swish)
