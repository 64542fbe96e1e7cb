"""How torch functions are classed by name: the in-place, reflected and method forms of one function alike, and the
kinds where the plain gradient is exact LRP-0 checked against the gradient's own behaviour."""

from __future__ import annotations

import pytest
import torch

from tdhook.attribution._function_kinds import PIECEWISE_CONSTANT, function_kind
from tdhook.attribution._nonlinear_calls import function_kind as watched_kind


@pytest.mark.parametrize(
    ("forms", "expected"),
    [
        ((torch.add, torch.Tensor.add, torch.Tensor.add_, torch.Tensor.__iadd__, torch.Tensor.__radd__), "linear"),
        ((torch.mul, torch.Tensor.mul_, torch.Tensor.__imul__, torch.Tensor.__rmul__), "product"),
        # ``mul``'s aliases: were classed nonlinear, so that ``torch.multiply(h, gamma)`` was named uncovered
        ((torch.multiply, torch.Tensor.multiply, torch.Tensor.multiply_), "product"),
        ((torch.floor, torch.Tensor.floor_, torch.sign), "constant"),
        ((torch.sin, torch.Tensor.sin_, torch.exp), "nonlinear"),
        ((torch.div, torch.Tensor.__itruediv__), "division"),
        ((torch.Tensor.__rtruediv__,), "reflected division"),
    ],
)
def test_every_form_of_a_function_is_classed_alike(forms, expected):
    assert {function_kind(form)[1] for form in forms} == {expected}
    assert all(watched_kind(form) == function_kind(form) for form in forms)  # the watch classes by the same table


@pytest.mark.parametrize("name", sorted(PIECEWISE_CONSTANT - {"fix", "sgn", "heaviside"}))
def test_a_piecewise_constant_function_has_a_zero_gradient(name):
    x = (torch.randn(16, dtype=torch.float64) * 3).requires_grad_(True)
    (grad,) = torch.autograd.grad(getattr(torch, name)(x).sum(), x)
    assert function_kind(getattr(torch, name)) == (name, "constant")
    assert torch.equal(grad, torch.zeros_like(x))


@pytest.mark.parametrize("func", [torch.relu, torch.abs, torch.flip, torch.cumsum])
def test_a_piecewise_linear_function_is_its_gradient_times_its_input(func):
    # Piecewise linear and through the origin: f(x) = J(x) x, which is why its plain gradient is exact LRP-0.
    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    args = (0,) if func is torch.cumsum else ((0,),) if func is torch.flip else ()
    jacobian = torch.autograd.functional.jacobian(lambda t: func(t, *args), x)
    assert function_kind(func)[1] == "linear"
    torch.testing.assert_close(func(x, *args), jacobian @ x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "join",
    [torch.cat, torch.concat, torch.concatenate, torch.stack, torch.hstack, torch.vstack, torch.row_stack]
    + [torch.dstack, torch.column_stack],
)
def test_every_join_is_linear(join):
    # ``column_stack`` and ``row_stack`` were classed nonlinear, and named uncovered in the model's forward.
    pieces = [torch.randn(2, 3, dtype=torch.float64) for _ in range(2)]
    jacobian = torch.autograd.functional.jacobian(lambda a, b: join([a, b]), tuple(pieces))
    flat = torch.cat([part.reshape(join(pieces).numel(), -1) for part in jacobian], 1)
    assert function_kind(join)[1] == "linear" and watched_kind(join)[1] == "linear"
    torch.testing.assert_close(join(pieces).flatten(), flat @ torch.cat([p.flatten() for p in pieces]))
