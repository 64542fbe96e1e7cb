"""The factors of a product, a division's divisor, or a function's input, given by keyword, put in their places.

The function rules read a product's factors by position (``a * b``, ``torch.bmm(a, b)``) and a function's input as
its first argument; a call may give them by keyword: Hugging Face's Bloom scores its attention with
``alibi.baddbmm(batch1=query, batch2=key, ...)``. Read by position alone, such a product of two activations kept its
plain gradient under AttnLRP, and so did ``F.gelu(input=h)``, with no warning. :func:`positional_factors` moves them
to their positions, for the function modes and the coverage watch alike.

Examples:
    >>> import torch
    >>> a, b = torch.ones(2), torch.ones(2)
    >>> args, kwargs = positional_factors(torch.mul, (a,), {"other": b})
    >>> len(args), kwargs
    (2, {})
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["FACTOR_KEYWORDS", "positional_factors"]

_FUNCTIONS = {
    "other": ("mul", "multiply", "matmul", "div", "divide", "true_divide"),
    "mat2": ("mm", "bmm"),
}
#: function → the names of its arguments, in their order, up to the last factor (a method's first is ``self``)
FACTOR_KEYWORDS: dict[Callable, tuple[str, ...]] = {
    getattr(owner, name): (first, keyword)
    for keyword, names in _FUNCTIONS.items()
    for name in names
    for owner, first in ((torch, "input"), (torch.Tensor, "self"))
}
FACTOR_KEYWORDS |= {torch.baddbmm: ("input", "batch1", "batch2"), torch.Tensor.baddbmm: ("self", "batch1", "batch2")}
# ``F.cosine_similarity(x1=a, x2=b)``: a product of its two normalised inputs.
FACTOR_KEYWORDS[torch.cosine_similarity] = ("x1", "x2")
# Any other function: its input alone (the first argument of the functions the rules cover).
_INPUT = ("input",)


def positional_factors(func: Callable, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``args`` and ``kwargs`` of a call of ``func`` with the factors of a product of :data:`FACTOR_KEYWORDS` given
    by keyword moved to their positions, and for any other function an ``input`` given by keyword; as they are where
    none is given by keyword. A caller that calls ``func`` with them keeps to functions whose first argument is
    ``input`` (not ``torch.where``, whose first is ``condition``).

    Examples:
        >>> import torch
        >>> alibi, q, k = torch.zeros(1, 2, 2), torch.ones(1, 2, 3), torch.ones(1, 3, 2)
        >>> args, kwargs = positional_factors(torch.Tensor.baddbmm, (alibi,), {"batch1": q, "batch2": k, "beta": 1})
        >>> [a.shape[-1] for a in args], kwargs
        ([2, 3, 2], {'beta': 1})
    """
    names = FACTOR_KEYWORDS.get(func, _INPUT)
    if len(args) >= len(names) or names[len(args)] not in kwargs:
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    for name in names[len(args) :]:
        if name not in kwargs:
            break
        args.append(kwargs.pop(name))
    return tuple(args), kwargs
