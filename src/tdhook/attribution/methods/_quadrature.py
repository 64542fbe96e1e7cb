"""Quadrature rules on [0, 1] for path integrals: the points along the path and their weights, in float64.

Examples:
    >>> nodes, weights = quadrature("gausslegendre", 3)
    >>> bool(abs(weights.sum() - 1) < 1e-15), bool(((nodes > 0) & (nodes < 1)).all())
    (True, True)
    >>> quadrature("riemann_trapezoid", 3)
    (tensor([0.0000, 0.5000, 1.0000], dtype=torch.float64), tensor([0.1667, 0.3333, 0.1667], dtype=torch.float64))
"""

from __future__ import annotations

import math

import torch

__all__ = ["METHODS", "quadrature"]

METHODS = ("gausslegendre", "riemann_trapezoid", "riemann_left", "riemann_right", "riemann_middle")


def _gauss_legendre(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gauss–Legendre nodes and weights on [-1, 1] by Newton's iteration on the Legendre polynomial."""
    k = torch.arange(1, n + 1, dtype=torch.float64, device="cpu")
    x = torch.cos(math.pi * (k - 0.25) / (n + 0.5))  # Tricomi's initial guesses, in decreasing order
    for _ in range(100):
        p0, p1 = torch.ones_like(x), x.clone()
        for j in range(2, n + 1):  # P_j = ((2j - 1) x P_{j-1} - (j - 1) P_{j-2}) / j
            p0, p1 = p1, ((2 * j - 1) * x * p1 - (j - 1) * p0) / j
        derivative = n * (x * p1 - p0) / (x * x - 1)
        step = p1 / derivative
        x = x - step
        if step.abs().max() < 1e-16:
            break
    p0, p1 = torch.ones_like(x), x.clone()
    for j in range(2, n + 1):
        p0, p1 = p1, ((2 * j - 1) * x * p1 - (j - 1) * p0) / j
    derivative = n * (x * p1 - p0) / (x * x - 1)
    weights = 2 / ((1 - x * x) * derivative * derivative)
    return x.flip(0), weights.flip(0)


def quadrature(method: str, n_steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The points ``α`` in [0, 1] and weights ``w`` with ``∫₀¹ f ≈ Σ w f(α)``, in float64.

    Args:
        method: ``"gausslegendre"`` (exact for polynomials of degree < 2n),
            ``"riemann_left"`` (α = k/n), ``"riemann_right"`` (α = (k+1)/n),
            ``"riemann_middle"`` (α = (k+½)/n), all with w = 1/n, or
            ``"riemann_trapezoid"`` (α = k/(n−1), w = 1/n with the first and
            last weights halved: captum's weights, which sum to (n−1)/n, not 1,
            so that integrated gradients sum to (n−1)/n of ``F(x) − F(b)``).
        n_steps: the number of points (at least 2 for the trapezoid).

    Returns:
        ``(alphas, weights)``, each of ``n_steps`` float64 values, alphas increasing.

    Raises:
        ValueError: an unknown method or too few steps.

    Examples:
        >>> alphas, weights = quadrature("riemann_middle", 4)
        >>> alphas.tolist(), weights.tolist()
        ([0.125, 0.375, 0.625, 0.875], [0.25, 0.25, 0.25, 0.25])
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if (
        isinstance(n_steps, bool)
        or not isinstance(n_steps, int)
        or n_steps < (2 if method == "riemann_trapezoid" else 1)
    ):
        raise ValueError(
            f"n_steps must be an int of at least {2 if method == 'riemann_trapezoid' else 1}, got {n_steps!r}"
        )
    if method == "gausslegendre":
        nodes, weights = _gauss_legendre(n_steps)
        return (nodes + 1) / 2, weights / 2
    k = torch.arange(n_steps, dtype=torch.float64, device="cpu")
    weights = torch.full((n_steps,), 1.0 / n_steps, dtype=torch.float64, device="cpu")
    if method == "riemann_trapezoid":
        weights[0] /= 2
        weights[-1] /= 2
        return k / (n_steps - 1), weights
    offset = {"riemann_left": 0.0, "riemann_right": 1.0, "riemann_middle": 0.5}[method]
    return (k + offset) / n_steps, weights
