"""The opt-in ε-rule on residual additions against zennit's Sum module under Norm and its closed form."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from zennit.layer import Sum
from zennit.rules import Norm

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.additions import StabilizedAdditions
from tdhook.attribution.lrp_helpers.rules import BaseRuleMapper, stabilize
from tests.conftest import relative_error, zennit_relevance


def _add(style: str, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` written in one of the ways model code adds tensors."""
    a, b = a * 1, b * 1  # activations (with autograd history), not leaves
    if style == "operator":
        return a + b
    if style == "inplace":
        a += b
        return a
    if style == "method_inplace":
        a.add_(b)  # the return value is ignored: the tensor itself must carry the rule
        return a
    return torch.add(a, b)


@pytest.mark.parametrize("style", ["operator", "inplace", "method_inplace", "function"])
def test_sum_gradient_matches_zennit_sum_under_norm(style: str):
    left, right = torch.randn(5, 3, dtype=torch.float64).relu(), torch.randn(5, 3, dtype=torch.float64)
    relevance_out = torch.randn(5, 3, dtype=torch.float64)
    stacked = torch.stack([left, right], dim=-1)
    expected = zennit_relevance(Norm(stabilizer=0.1), Sum(), stacked, relevance_out)

    leaves = [left.clone().requires_grad_(True), right.clone().requires_grad_(True)]
    with StabilizedAdditions(epsilon=0.1):
        out = _add(style, *leaves)
    total = left + right
    torch.testing.assert_close(out.detach(), total, rtol=0, atol=0)
    grads = torch.autograd.grad(out, leaves, relevance_out / total)
    ours = torch.stack([left * grads[0], right * grads[1]], dim=-1)
    assert relative_error(ours, expected) <= 1e-12
    # Closed form: each summand's share of R / stabilize(a + b).
    closed = stacked * (relevance_out / stabilize(total, 0.1)).unsqueeze(-1)
    assert relative_error(ours, closed) <= 1e-12
    assert relative_error(ours.sum(-1), relevance_out) > 1e-6  # the stabilizer absorbed something


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3, dtype=torch.float64)
        self.b = nn.Linear(4, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.a(x)
        out += self.b(x)
        return out


def test_only_additions_of_two_activations_are_changed():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    weight = nn.Parameter(torch.randn(4, dtype=torch.float64))
    with StabilizedAdditions(epsilon=10.0):
        outputs = [
            x * 2 + weight,  # a parameter: a bias, not a residual sum
            x * 2 + 1.0,  # a constant
            (x * 2) + (x * 3)[:1],  # a broadcast
            torch.add(x * 2, x * 3, alpha=2),  # a scaled sum
            (x * 2) - (x * 3),  # not an addition
        ]
    exact = [
        torch.full_like(x, 2.0),
        torch.full_like(x, 2.0),
        torch.full_like(x, 2.0).index_add(0, torch.tensor([0]), torch.full((1, 4), 9.0, dtype=x.dtype)),
        torch.full_like(x, 8.0),
        torch.full_like(x, -1.0),
    ]
    for out, expected in zip(outputs, exact, strict=True):
        (grad,) = torch.autograd.grad(out.sum(), x)
        torch.testing.assert_close(grad, expected)


def test_lrp_applies_the_rule_only_when_the_mapper_asks():
    model = Residual()
    for linear in (model.a, model.b):
        nn.init.zeros_(linear.bias)
    x = torch.randn(6, 4, dtype=torch.float64)

    def total_relevance(stabilize_additions: bool) -> torch.Tensor:
        mapper = BaseRuleMapper(stabilizer=0.5, stabilize_additions=stabilize_additions)
        lrp = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"])
        td = lrp(TensorDict(x=x.clone(), batch_size=[6]))
        return td["relevance", "x"].sum(-1), td["y"].gather(1, td["y"].argmax(1, keepdim=True)).squeeze(1)

    exact, logit = total_relevance(False)
    torch.testing.assert_close(exact, logit)  # zero biases: conservation through the exact split
    absorbed, logit = total_relevance(True)
    torch.testing.assert_close(absorbed, logit * logit / stabilize(logit, 0.5))
