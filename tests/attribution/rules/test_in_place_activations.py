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
    # In-place functions and methods: they kept their plain gradient (16-109 % off) with a warning.
    "Tensor.sigmoid_": (torch.sigmoid, lambda h: h.sigmoid_()),
    "torch.sigmoid_": (torch.sigmoid, torch.sigmoid_),
    "Tensor.tanh_": (torch.tanh, lambda h: h.tanh_()),
    "torch.tanh_": (torch.tanh, torch.tanh_),
    "F.elu_": (F.elu, F.elu_),
    "F.elu_ alpha": (lambda h: F.elu(h, 0.5), lambda h: F.elu_(h, alpha=0.5)),
    "torch.selu_": (F.selu, torch.selu_),
    "torch.celu_ alpha": (lambda h: F.celu(h, 0.7), lambda h: torch.celu_(h, 0.7)),
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


class GatedInPlace(nn.Module):
    """``head(gate(a(x)) · f(b(x)[:, :3]) …)`` with no biases: a gate and an activation of a view, both in place
    (``in_place=True``) or out of place."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.a, self.b, self.head = (nn.Linear(4, 6, bias=False), nn.Linear(4, 6, bias=False), nn.Linear(6, 3))
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, signal = self.a(x) * 1, self.b(x) * 2
        if self.in_place:
            gate.sigmoid_()
            signal[:, :3].tanh_()
            signal = F.elu_(signal)
        else:
            gate = torch.sigmoid(gate)
            signal = F.elu(torch.cat([torch.tanh(signal[:, :3]), signal[:, 3:]], -1))
        return self.head(gate * signal)


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP], ids=["AttnLRP", "CPLRP"])
def test_in_place_gates_and_views_match_the_model_written_out_of_place_and_conserve(preset):
    torch.manual_seed(1)
    in_place, out_of_place = GatedInPlace(True).double(), GatedInPlace(False).double()
    with torch.no_grad():
        in_place.head.bias.zero_()
    out_of_place.load_state_dict(in_place.state_dict())
    x = torch.randn(5, 4, dtype=F64)
    results = []
    for model in (in_place, out_of_place):
        lrp = LRP(model, preset(stabilizer=1e-15), in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with lrp:
                results.append([lrp(TensorDict(x=x.clone(), batch_size=[5])) for _ in range(2)])
    expected = results[1][0]
    for td in results[0]:
        torch.testing.assert_close(td["y"], expected["y"], rtol=1e-12, atol=1e-12)
        assert relative_error(td["relevance", "x"], expected["relevance", "x"]) <= 1e-10
        # The gate is held and the identity rule passes the rest whole: the relevance sums to the target logit.
        logit = td["y"].max(-1).values
        torch.testing.assert_close(td["relevance", "x"].sum(-1), logit, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP], ids=["AttnLRP", "CPLRP"])
def test_an_in_place_operator_with_no_rule_keeps_its_warning(preset):
    model = Activated(lambda h: torch.ops.aten.silu_(h)).double()
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"])
    with pytest.warns(UserWarning, match="aten.silu_"):
        lrp(TensorDict(x=torch.randn(2, 4, dtype=F64), batch_size=[2]))
