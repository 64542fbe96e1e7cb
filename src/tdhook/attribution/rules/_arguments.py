"""Checking the numbers rules and presets are built with, so that a wrong one fails at construction.

A negative ε or stabilizer flips the sign of the denominators it should keep
away from zero, a negative γ makes the γ-rule favour negative contributions,
and bounds with ``low ≥ high`` describe no input at all. Each check raises a
``ValueError`` naming the owner (the rule or preset), the parameter and what
was expected.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

__all__ = ["finite_number", "nonnegative", "bounds"]


def finite_number(owner: str, name: str, value: object) -> float:
    """``value`` as a float, when it is a finite real number (or a one-element tensor holding one).

    Examples:
        >>> finite_number("EpsilonRule", "epsilon", torch.tensor(0.5))
        0.5
        >>> finite_number("EpsilonRule", "epsilon", float("nan"))
        Traceback (most recent call last):
        ...
        ValueError: EpsilonRule: epsilon must be a finite number, got nan
    """
    number: float | None = None
    if isinstance(value, torch.Tensor):
        if value.numel() == 1 and not value.is_complex() and value.dtype != torch.bool:
            number = float(value.item())
    elif isinstance(value, Real) and not isinstance(value, bool):
        number = float(value)
    if number is None or not math.isfinite(number):
        raise ValueError(f"{owner}: {name} must be a finite number, got {value!r}")
    return number


def nonnegative(owner: str, name: str, value: object) -> None:
    """Raise unless ``value`` is a finite number ``≥ 0`` (zero included: ε = 0 is LRP-0).

    Examples:
        >>> nonnegative("GammaRule", "gamma", 0.0)
        >>> nonnegative("GammaRule", "gamma", -0.5)
        Traceback (most recent call last):
        ...
        ValueError: GammaRule: gamma must be a finite number >= 0, got -0.5
    """
    number = finite_number(owner, name, value)
    if number < 0:
        raise ValueError(f"{owner}: {name} must be a finite number >= 0, got {value!r}")


def bounds(owner: str, low: float | torch.Tensor, high: float | torch.Tensor) -> None:
    """Raise unless ``low < high`` everywhere: numbers, or tensors broadcastable to each other.

    Examples:
        >>> bounds("ZBoxRule", torch.tensor([-1.0, 0.0]), 1.0)
        >>> bounds("ZBoxRule", 1.0, 0.0)
        Traceback (most recent call last):
        ...
        ValueError: ZBoxRule: low must be below high everywhere, got low=1.0, high=0.0
    """
    tensors = []
    for name, value in (("low", low), ("high", high)):
        if isinstance(value, torch.Tensor):
            if value.is_complex() or value.dtype == torch.bool:
                raise ValueError(f"{owner}: {name} must hold real numbers, got a {value.dtype} tensor")
            tensors.append(value.detach())
        else:
            tensors.append(torch.as_tensor(finite_number(owner, name, value), dtype=torch.float64, device="cpu"))
    low_t, high_t = tensors
    try:
        torch.broadcast_shapes(low_t.shape, high_t.shape)
    except RuntimeError:
        raise ValueError(
            f"{owner}: low and high must broadcast to one shape, got shapes {tuple(low_t.shape)} and "
            f"{tuple(high_t.shape)}"
        ) from None
    common = torch.promote_types(low_t.dtype, high_t.dtype)
    low_t, high_t = low_t.to("cpu", common), high_t.to("cpu", common)
    if not (bool(torch.isfinite(low_t).all()) and bool(torch.isfinite(high_t).all())):
        raise ValueError(f"{owner}: low and high must be finite, got low={low!r}, high={high!r}")
    if not bool((low_t < high_t).all()):
        raise ValueError(f"{owner}: low must be below high everywhere, got low={low!r}, high={high!r}")
