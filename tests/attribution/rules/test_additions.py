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


def _summands(x: torch.Tensor, vec: torch.Tensor, build: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two activations ``h1``, ``h2`` of ``x`` and a sum built from them in place or not (``build``): the sum of
    ``h1`` and ``h2`` accumulated into zeros (``accumulated``), the weight ``2 * vec`` plus ``h1`` plus ``h2``
    (``weight``), or the weight plus ``h2`` where the weight overwrites the activation ``h1`` (``overwritten``)."""
    h1, h2 = x * 2.0, x * x
    weight = (2.0 * vec).expand_as(h1)
    if build.startswith("accumulated"):
        total = torch.zeros_like(x.detach())
        if build.endswith("in place"):
            total += h1
            total += h2
            return h1, h2, total
        return h1, h2, (total + h1) + h2
    if build.startswith("weight"):
        if build.endswith("in place"):
            total = weight.clone()
            total += h1
            total.add_(h2)
            return h1, h2, total
        return h1, h2, (weight + h1) + h2
    if build.endswith("in place"):
        total = h1 * 1.0
        total.copy_(weight)
        total += h2
        return h1, h2, total
    return h1, h2, weight + h2


@pytest.mark.parametrize("build", ["accumulated", "weight", "overwritten"])
@pytest.mark.parametrize("in_place", [False, True])
def test_sums_built_in_place_are_stabilised_as_out_of_place(build: str, in_place: bool):
    """A sum is stabilised where both of its terms are activations before the call: ``acc += h1`` into zeros (or a
    weight's values) is no sum of two activations, as ``acc + h1`` is none; a weight an activation was added to in
    place is an activation, as the sum out of place is; an activation overwritten with a weight's values is that
    weight. The sum judged after the call (a constant given autograd history by the write itself), or by the marks
    of the tensor written into before the write, was stabilised where the same sum out of place is not, or not
    where it is. Closed form: the ε-rule
    on the one sum of two activations, ``R_i = h_i · R / stabilize(h1 + h2 [+ w])``, the plain split elsewhere."""
    epsilon = 0.5
    x = torch.randn(4, 5, dtype=torch.float64).abs().add(0.1).requires_grad_(True)
    vec = nn.Parameter(torch.randn(5, dtype=torch.float64))
    with StabilizedAdditions(epsilon=epsilon):
        h1, h2, total = _summands(x, vec, f"{build}, {'in place' if in_place else 'out of place'}")
    grads = torch.autograd.grad(total.sum(), [h1, h2], allow_unused=True)  # h1 overwritten out of place: unused
    grad_h1, grad_h2 = (torch.zeros_like(x) if grad is None else grad for grad in grads)
    scale = (total / stabilize(total, epsilon)).detach()
    if build == "accumulated":  # zeros + h1 is no sum of two activations, (zeros + h1) + h2 is
        expected_h1 = expected_h2 = scale
    elif build == "weight":  # w + h1 is a bias added, (w + h1) + h2 a sum of two activations
        expected_h1 = expected_h2 = scale
    else:  # w + h2: a bias added; h1 overwritten passes nothing
        expected_h1, expected_h2 = torch.zeros_like(scale), torch.ones_like(scale)
    assert (scale - 1).abs().max() > 1e-2  # the stabilizer changes something
    torch.testing.assert_close(grad_h1, expected_h1, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_h2, expected_h2, rtol=1e-12, atol=1e-14)
