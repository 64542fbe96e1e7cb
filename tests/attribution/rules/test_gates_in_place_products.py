"""The CNN presets' gate mode (HeldGates) with a signal multiplied in place by a sigmoid gate (float64).

A squeeze-excite block written ``h.mul_(g)`` or ``h *= g`` computes ``h * g``: the gate is held constant and the
signal takes all of the product's relevance, as in the block written out of place. In place, the product kept its
plain gradient (with a warning), which passes part of the relevance through the gate's own input (0.04-0.07 off,
max abs, on relevance sums near 0.7 here). Oracles: the block written out of place, and the relevance of the held
product in closed form (the signal's relevance is the product's: ``h * g * grad``).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.mappers.presets import EpsilonAlpha2Beta1, EpsilonPlus
from tdhook.attribution.rules.gates import HeldGates

F64 = torch.float64


class Excited(nn.Module):
    """``lin2(relu(lin0(x) * gate(lin1(x))))``, the product in place (``mul_``, ``*=``) or not."""

    def __init__(self, form: str, gate) -> None:
        super().__init__()
        self.lin0, self.lin1, self.lin2 = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.form, self.gate = form, gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, g = self.lin0(x), self.gate(self.lin1(x))
        if self.form == "mul_":
            h = h.mul_(g)
        elif self.form == "*=":
            h *= g
        else:
            h = h * g
        return self.lin2(torch.relu(h))


def relevance(form: str, gate, mapper, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    torch.manual_seed(0)
    lrp = LRP(Excited(form, gate).to(F64), rule_mapper=mapper, in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(record=True) as caught, lrp:
        warnings.simplefilter("always")
        for _ in range(2):  # the first call finds the gate, later ones hold it as well
            result = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]
    return result, [str(w.message) for w in caught if "no rule covers" in str(w.message)]


MAPPERS = {"EpsilonPlus": EpsilonPlus, "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1, "LRP-0": BaseRuleMapper}


@pytest.mark.parametrize("gate", [torch.sigmoid, F.hardsigmoid], ids=["sigmoid", "hardsigmoid"])
@pytest.mark.parametrize("mapper", list(MAPPERS))
@pytest.mark.parametrize("form", ["mul_", "*="])
def test_a_signal_multiplied_in_place_by_a_gate_holds_the_gate(form: str, mapper: str, gate):
    x = torch.randn(5, 4, dtype=F64)
    expected, expected_warnings = relevance("out of place", gate, MAPPERS[mapper](), x)
    ours, warned = relevance(form, gate, MAPPERS[mapper](), x)
    assert warned == expected_warnings == []
    torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("form", ["mul_", "*="])
def test_the_held_product_in_place_gives_the_signal_all_of_the_relevance(form: str):
    x = torch.randn(3, 5, dtype=F64, requires_grad=True)
    upstream = torch.randn(3, 5, dtype=F64)
    with HeldGates():
        h, g = x * 2.0, torch.sigmoid(x * -1.0)
        product = h * g  # the value, for the closed form
        if form == "mul_":
            h.mul_(g)
        else:
            h *= g
    (grad,) = torch.autograd.grad(h, x, upstream)
    # The gate held: the gradient reaches x through h alone, 2 * g * upstream; relevance x * grad = h * g * upstream.
    torch.testing.assert_close(x.detach() * grad, product.detach() * upstream, rtol=1e-12, atol=1e-14)
