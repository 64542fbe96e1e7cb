"""The opt-in ε-rule on residual additions against zennit's Sum module under Norm and its closed form."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from zennit.layer import Sum
from zennit.rules import Norm

from tdhook.attribution.rules._numerics import stabilize
from tdhook.attribution.rules.additions import StabilizedAdditions
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


def test_an_expanded_parameter_added_to_an_activation_keeps_the_exact_split():
    # A position embedding sliced or expanded to the activation's shape is a parameter, not a residual branch.
    position = torch.nn.Parameter(torch.randn(1, 4, dtype=torch.float64))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    with StabilizedAdditions(epsilon=0.5):
        y = (x * 1) + position.expand(3, 4)
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, torch.ones_like(x))


def test_a_negative_epsilon_is_refused_at_construction():
    with pytest.raises(ValueError, match="StabilizedAdditions: epsilon must be a finite number >= 0, got -1"):
        StabilizedAdditions(epsilon=-1)
    assert StabilizedAdditions(epsilon=0.0).epsilon == 0.0
