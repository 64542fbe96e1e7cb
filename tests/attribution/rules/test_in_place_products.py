"""Products of two activations written in place (``a.mul_(b)``, ``a *= b``) under AttnLRP and CP-LRP (float64).

Out of place, ``a * b`` gets the uniform rule (each factor half of the product's relevance), or holds a gate or a
norm's scale constant. Written in place, the product kept its plain gradient, with a warning (1.22 off the
out-of-place relevance, max abs, on sums near 1.5 here). Oracle: the same model written out of place, bit for bit
(the same kernels), in the calls of one context (the first in the function mode, the later ones on the recorded
graph or in the mode again) and with ``create_graph=True`` (the derivative of the relevance too).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP

F64 = torch.float64


def _into_a_view(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a[:, :3].mul_(b[:, :3])
    return a


def _into_a_view_by_assignment(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    view = a[:, :3]
    view *= b[:, :3]
    return a


def _multiplied_by_assignment(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    a *= b
    return a


def _scale(a: torch.Tensor) -> torch.Tensor:
    return torch.rsqrt(a.pow(2).mean(-1, keepdim=True) + 1e-6)


# Each product written in place, with the same product written out of place. ``a`` and ``b`` are two Linear layers'
# outputs.
FORMS = {
    "a.mul_(b)": (lambda a, b: a.mul_(b), lambda a, b: a * b),
    "a *= b": (_multiplied_by_assignment, lambda a, b: a * b),
    "a.multiply_(b)": (lambda a, b: a.multiply_(b), lambda a, b: torch.multiply(a, b)),
    "a.multiply_(sigmoid(b)), a gate": (
        lambda a, b: a.multiply_(torch.sigmoid(b)),
        lambda a, b: a.multiply(torch.sigmoid(b)),
    ),
    "b.mul_(a)": (lambda a, b: b.mul_(a), lambda a, b: b * a),
    "a[:, :3].mul_(b[:, :3])": (_into_a_view, lambda a, b: torch.cat([a[:, :3] * b[:, :3], a[:, 3:]], 1)),
    "a[:, :3] *= b[:, :3]": (_into_a_view_by_assignment, lambda a, b: torch.cat([a[:, :3] * b[:, :3], a[:, 3:]], 1)),
    "a.mul_(sigmoid(b)), a gate": (lambda a, b: a.mul_(torch.sigmoid(b)), lambda a, b: a * torch.sigmoid(b)),
    "silu(b).mul_(a), a gate written into": (lambda a, b: F.silu(b).mul_(a), lambda a, b: F.silu(b) * a),
    "a.mul_(silu(b))": (lambda a, b: a.mul_(F.silu(b)), lambda a, b: a * F.silu(b)),
    "b.mul_(rsqrt(mean(a²) + ε)), a norm's scale": (lambda a, b: b.mul_(_scale(a)), lambda a, b: b * _scale(a)),
}


class Product(nn.Module):
    """``out(form(p(x), q(x)))``."""

    def __init__(self, form) -> None:
        super().__init__()
        self.p, self.q, self.out = nn.Linear(4, 6), nn.Linear(4, 6), nn.Linear(6, 3)
        self.form = form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.form(self.p(x), self.q(x)))


def _explained(form, preset, create_graph: bool = False) -> tuple[list, list, list, list]:
    """Three calls of one context: the relevances, the derivatives of their squares with respect to the input and the
    first layer's weight (with ``create_graph``), the warnings and the calls ``coverage()`` lists."""
    torch.manual_seed(0)
    model = Product(form).to(F64)
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"], create_graph=create_graph)
    relevances, derivatives, messages = [], [], []
    with lrp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(3):
            torch.manual_seed(seed + 1)
            x = torch.randn(5, 4, dtype=F64, requires_grad=create_graph)
            relevance = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
            relevances.append(relevance.detach())
            if create_graph:
                derivatives.append(torch.autograd.grad(relevance.pow(2).sum(), [x, model.p.weight]))
        messages = [str(w.message) for w in caught]
    return relevances, derivatives, messages, [c.function for c in lrp.coverage().plain_gradient]


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP], ids=lambda p: p.__name__)
@pytest.mark.parametrize("name", sorted(FORMS))
def test_a_product_written_in_place_gets_the_rule_of_the_product_out_of_place(name: str, preset):
    in_place, out_of_place = FORMS[name]
    relevances, _, messages, calls = _explained(in_place, preset)
    expected, _, expected_messages, expected_calls = _explained(out_of_place, preset)
    assert (messages, calls) == (expected_messages, expected_calls) == ([], [])
    for relevance, oracle in zip(relevances, expected, strict=True):
        torch.testing.assert_close(relevance, oracle, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("preset", [AttnLRP, CPLRP], ids=lambda p: p.__name__)
@pytest.mark.parametrize(
    "name",
    ["a.mul_(b)", "a[:, :3].mul_(b[:, :3])", "silu(b).mul_(a), a gate written into", "a.mul_(sigmoid(b)), a gate"],
)
def test_a_product_written_in_place_keeps_the_derivative_of_the_product_out_of_place(name: str, preset):
    """With ``create_graph=True`` the relevance and its derivative with respect to the input and a layer's weight
    equal those of the product out of place."""
    in_place, out_of_place = FORMS[name]
    relevances, derivatives, _, _ = _explained(in_place, preset, create_graph=True)
    expected, expected_derivatives, _, _ = _explained(out_of_place, preset, create_graph=True)
    torch.testing.assert_close(relevances, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(derivatives, expected_derivatives, rtol=1e-12, atol=1e-12)


def test_the_uniform_rule_in_place_conserves_the_relevance():
    """With biases zeroed, ``a`` and ``b`` linear in the input each pass on half of the product's relevance: the input
    relevance sums to the explained logit (the plain gradient of the bilinear product gave twice the logit)."""
    torch.manual_seed(0)
    model = Product(FORMS["a.mul_(b)"][0]).to(F64)
    for layer in (model.p, model.q, model.out):
        nn.init.zeros_(layer.bias)
    x = torch.randn(5, 4, dtype=F64)
    explained = LRP(model, AttnLRP(), in_keys=["x"], out_keys=["y"], target=0)(TensorDict(x=x, batch_size=[5]))
    logit = Product(lambda a, b: a * b).to(F64)
    logit.load_state_dict(model.state_dict())
    torch.testing.assert_close(explained["relevance", "x"].sum(-1), logit(x)[:, 0], rtol=1e-10, atol=1e-12)
