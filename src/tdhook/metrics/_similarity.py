"""Pearson and Spearman correlation along the last dimension, batched.

Examples:
    >>> import torch
    >>> a = torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 2.0, 0.0]], dtype=torch.float64)
    >>> b = torch.tensor([[2.0, 4.0, 6.0, 8.0], [3.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    >>> pearson(a, b)
    tensor([1.0000, 0.2075], dtype=torch.float64)
    >>> spearman(a, b)
    tensor([1.0000, 0.3333], dtype=torch.float64)
"""

from __future__ import annotations

import torch

__all__ = ["average_ranks", "pearson", "spearman"]


def pearson(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The Pearson correlation of ``a`` and ``b`` along the last dimension (NaN where one is constant).

    A constant row is found by comparing its entries, not from its spread: the mean of equal floats can differ
    from them in the last bit, which would leave a spread of rounding and a correlation of noise. Half-precision
    rows are correlated in float32 (their norms overflow float16 past 65504) and the result rounded to their dtype.

    Examples:
        >>> pearson(torch.full((1, 50), 0.1), torch.linspace(0.0, 1.0, 50).unsqueeze(0))
        tensor([nan])
    """
    constant = _constant(a) | _constant(b)
    dtype = torch.result_type(a, b)
    wide = torch.promote_types(dtype, torch.float32)
    a = a.to(wide)
    b = b.to(wide)
    a = a - a.mean(-1, keepdim=True)
    b = b - b.mean(-1, keepdim=True)
    r = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
    return r.masked_fill(constant, float("nan")).to(dtype)


def _constant(values: torch.Tensor) -> torch.Tensor:
    """Whether all entries along the last dimension are equal."""
    return (values == values[..., :1]).all(-1)


def average_ranks(values: torch.Tensor) -> torch.Tensor:
    """Ranks from 1 along the last dimension, tied entries sharing the mean of their ranks.

    They are float32 for half-precision values (bfloat16 holds integers up to 256 only, float16 up to 2048), float64
    for integer ones, in the values' dtype otherwise.

    Examples:
        >>> average_ranks(torch.tensor([3.0, 1.0, 3.0, 2.0]))
        tensor([3.5000, 1.0000, 3.5000, 2.0000])
    """
    ordered = values.sort(dim=-1).values.contiguous()
    query = values.contiguous()
    below = torch.searchsorted(ordered, query, side="left")
    up_to = torch.searchsorted(ordered, query, side="right")
    dtype = torch.promote_types(values.dtype, torch.float32) if values.is_floating_point() else torch.float64
    return (below + up_to + 1).to(dtype) / 2


def spearman(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The Spearman rank correlation of ``a`` and ``b`` along the last dimension (ties get average ranks; NaN where
    one holds NaN, which has no rank, as scipy's ``spearmanr``).

    Examples:
        >>> spearman(torch.tensor([1.0, float("nan"), 3.0]), torch.tensor([1.0, 2.0, 3.0]))
        tensor(nan)
    """
    r = pearson(average_ranks(a), average_ranks(b))
    r = r.masked_fill(_holds_nan(a) | _holds_nan(b), float("nan"))
    return r.to(torch.result_type(a, b)) if a.is_floating_point() or b.is_floating_point() else r


def _holds_nan(values: torch.Tensor) -> torch.Tensor:
    return values.isnan().any(-1) if values.is_floating_point() else torch.zeros(values.shape[:-1], dtype=torch.bool)
