"""The CNN presets' gate mode (HeldGates) with a weight built in place from parameters (float64).

A weight written into a constant from parameters (``w = zeros(); w[rows] = vec; w.add_(1)``, as peft's OFT builds its
rotation) is a weight, not an activation: its product with a sigmoid gate is a weight times an activation, and the
gate is not held. Taken for an activation, the gate was held and the relevance through it lost (0.26 off here).
Oracles: the same model with the weight built out of place and with it stored as a parameter, and gradient × input
for LRP-0.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.mappers.presets import EpsilonAlpha2Beta1, EpsilonPlus

F64 = torch.float64


class GatedByBuiltWeight(nn.Module):
    """``lin2(relu(lin0(x)) + w * sigmoid(lin1(x)))`` with ``w`` built from ``vec``: in place (``in place``, a scalar
    or a tensor added in place), out of place, or stored whole as a parameter (``stored``)."""

    def __init__(self, build: str) -> None:
        super().__init__()
        self.lin0, self.lin1, self.lin2 = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.vec = nn.Parameter(torch.randn(3))
        self.stored = nn.Parameter(torch.zeros(6))
        self.register_buffer("rows", torch.arange(0, 6, 2))
        self.build = build

    def weight(self, x: torch.Tensor) -> torch.Tensor:
        if self.build == "stored":
            return self.stored
        if self.build == "out of place":
            return torch.zeros(6, dtype=x.dtype).index_put((self.rows,), self.vec) + 1.0
        w = torch.zeros(6, dtype=x.dtype)
        w[self.rows] = self.vec
        return w.add_(1.0) if self.build == "in place" else w.add_(torch.ones(6, dtype=x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin0(x)) + self.weight(x) * torch.sigmoid(self.lin1(x)))


def model(build: str) -> nn.Module:
    torch.manual_seed(0)
    net = GatedByBuiltWeight(build).to(F64)
    with torch.no_grad():
        net.stored.copy_(torch.ones(6, dtype=F64).index_put((net.rows,), net.vec + 1.0))
    return net


def relevance(net: nn.Module, mapper, x: torch.Tensor, calls: int = 2) -> torch.Tensor:
    lrp = LRP(net, rule_mapper=mapper, in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings(), lrp:
        warnings.simplefilter("ignore")  # the sigmoid that gates no signal keeps its plain gradient, as said
        for _ in range(calls):  # the first call finds the gates, later ones follow it
            result = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]
    return result


MAPPERS = {
    "EpsilonPlus": EpsilonPlus,
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
    "LRP-0": lambda: BaseRuleMapper(stabilizer=0.0),
}


@pytest.mark.parametrize("mapper", list(MAPPERS))
@pytest.mark.parametrize("build", ["in place", "in place, tensor added"])
def test_a_weight_built_in_place_is_a_weight(build, mapper):
    x = torch.randn(5, 4, dtype=F64)
    expected = relevance(model("out of place"), MAPPERS[mapper](), x)
    torch.testing.assert_close(relevance(model("stored"), MAPPERS[mapper](), x), expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(relevance(model(build), MAPPERS[mapper](), x), expected, rtol=1e-10, atol=1e-12)


def test_lrp0_through_a_weight_built_in_place_is_gradient_times_input():
    x = torch.randn(5, 4, dtype=F64)
    net = model("in place")
    leaf = x.clone().requires_grad_(True)
    out = net(leaf)
    (grad,) = torch.autograd.grad(out.gather(1, out.argmax(1, keepdim=True)).sum(), leaf)
    ours = relevance(net, BaseRuleMapper(stabilizer=0.0), x)
    torch.testing.assert_close(ours, x * grad, rtol=1e-10, atol=1e-12)
