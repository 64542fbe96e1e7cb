"""Activation functions called in place under AttnLRP and CP-LRP: the identity rule of the call made out of place.

``F.elu(h, inplace=True)`` writes ``elu(h)`` over ``h`` before the identity rule reads its input: the rule then took
``elu(h) / elu(h)`` for its ratio, and the relevance was 11 % (``F.elu``, ``F.celu``) to 24 % (``F.hardswish``) off
the same call made out of place, with no warning. The oracle is the identity rule's closed form: for
``head(f(W x))`` with no biases, the head's relevance of each activation output ``R = f(h) · w_target`` reaches
``h`` whole, and ``R_x = x ⊙ Wᵀ (R / h)``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP
from tests.conftest import relative_error

F64 = torch.float64
# (the function out of place, the same call in place), ``inplace`` given by keyword and by position.
IN_PLACE = {
    "elu": (F.elu, lambda h: F.elu(h, inplace=True)),
    "elu positional": (lambda h: F.elu(h, 0.5), lambda h: F.elu(h, 0.5, True)),
    "celu": (F.celu, lambda h: F.celu(h, inplace=True)),
    "selu": (F.selu, lambda h: F.selu(h, True)),
    "silu": (F.silu, lambda h: F.silu(h, inplace=True)),
    "mish": (F.mish, lambda h: F.mish(h, inplace=True)),
    "hardswish": (F.hardswish, lambda h: F.hardswish(h, True)),
    "hardsigmoid": (F.hardsigmoid, lambda h: F.hardsigmoid(h, inplace=True)),
    "leaky_relu": (lambda h: F.leaky_relu(h, 0.2), lambda h: F.leaky_relu(h, 0.2, True)),
}


class Activated(nn.Module):
    """``head(f(4 · inp(x)))``, no biases; the activation's input is a product's output, which it may overwrite."""

    def __init__(self, activation) -> None:
        super().__init__()
        self.inp, self.head = nn.Linear(4, 6, bias=False), nn.Linear(6, 3, bias=False)
        self.activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.activation(self.inp(x) * 4))


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP], ids=["AttnLRP", "CPLRP"])
@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_an_activation_in_place_gets_the_identity_rule_of_the_call_out_of_place(name: str, preset):
    out_of_place, in_place = IN_PLACE[name]
    torch.manual_seed(0)
    model = Activated(in_place).double()
    x = torch.randn(6, 4, dtype=F64)
    lrp = LRP(model, preset(stabilizer=1e-15), in_keys=["x"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with lrp:
            first, second = (lrp(TensorDict(x=x.clone(), batch_size=[6])) for _ in range(2))
    with torch.no_grad():
        h = model.inp(x) * 4
        y = model.head(out_of_place(h))
        torch.testing.assert_close(first["y"], y, rtol=0, atol=0)
        weight = model.head.weight[y.argmax(-1)]
        expected = x * ((out_of_place(h) * weight / h * 4) @ model.inp.weight)
    for td in (first, second):
        assert relative_error(td["relevance", "x"], expected) <= 1e-8  # the stabilizer, at h near 0
