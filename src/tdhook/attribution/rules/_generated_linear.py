"""``F.linear`` by a weight computed from activations (a hypernetwork's): the matrix product of two activations it is.

A Linear layer's map ``x Wᵀ + b`` multiplies an activation by a weight computed from parameters, and gets its
layer's rule. A hypernetwork (Ha et al.) computes ``W`` from another input: ``F.linear(x, W)`` then multiplies two
activations, as ``x @ W.T`` does, and AttnLRP's and CP-LRP's rule for a product of two activations (the uniform
rule: half of the relevance to each factor) applies to it as to the product written out. Under those presets the
call is computed as that product, ``x @ W.T + b``, in their function mode, so it gets the same rule and the same
relevance; a bias is a summand, whose share the plain gradient gives. The CNN presets have no rule for a product of
two activations and keep naming the call.

Examples:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> x = torch.randn(2, 3, requires_grad=True) * 1
    >>> weight = torch.randn(4, 3, requires_grad=True) * 1
    >>> generated_linear(F.linear, (x, weight), {}), generated_linear(F.linear, (x, torch.randn(4, 3)), {})
    (True, False)
    >>> torch.allclose(linear_as_product(x, weight), F.linear(x, weight))
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tdhook.attribution.rules._autograd import call_argument, is_activation

__all__ = ["generated_linear", "linear_as_product"]


def generated_linear(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether this call is ``F.linear`` of an activation by a weight that is an activation too."""
    if func is not F.linear or not args or not is_activation(args[0]):
        return False
    return is_activation(call_argument(args, kwargs, 1, "weight"))


def linear_as_product(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:  # noqa: A002
    """``F.linear(input, weight, bias)`` written out, ``input @ weight.T + bias``: in a function mode, the product
    and the sum get the mode's rules."""
    product = torch.matmul(input, weight.transpose(-1, -2) if weight.dim() > 1 else weight)
    return product if bias is None else product + bias
