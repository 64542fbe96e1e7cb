"""Linear layers written as a broadcast product and a sum: ``(x.unsqueeze(-2) * self.W).sum(-1)``.

A Linear layer's map is a matrix product, and :mod:`~tdhook.attribution._unmapped_layers` watches the matrix
products by a module's own weight. The same map written element-wise (the activation broadcast against the weight
along the output dimension, then summed over the input dimension) calls ``mul`` and ``sum``, two piecewise-linear
calls that no watch named: a first layer so written kept LRP-0 where ``EpsilonPlusFlat`` gives a Linear Flat.
:class:`BroadcastProducts` follows the calls of one watched forward pass (see
:class:`~tdhook.attribution._nonlinear_calls.NonlinearCalls`): it notes the products of one activation by a weight
that broadcast the activation along a dimension of the weight, and finds the sums (or means) of such a product over a
dimension that the activation and the weight share (the input dimension) but not over every dimension the
activation was broadcast along (the outputs). A layer scale (``x * gamma``) broadcasts no activation, and a product
of two activations has no weight: neither is noted.

Examples:
    >>> from torch import nn
    >>> x, weight = torch.randn(2, 3, requires_grad=True) * 1, nn.Parameter(torch.randn(4, 3))
    >>> found = BroadcastProducts()
    >>> product = x.unsqueeze(-2) * weight
    >>> found.note("mul", (x.unsqueeze(-2), weight), product)
    >>> found.layer("sum", (product, -1), {}) is not None, found.layer("sum", (product, -2), {})
    (True, None)
    >>> scaled = x * weight[0]
    >>> found.note("mul", (x, weight[0]), scaled)
    >>> found.layer("sum", (scaled,), {"dim": -1})  # a layer scale, summed: no broadcast output
    >>> found.forget()  # the end of the watched call
    >>> found.layer("sum", (product, -1), {})
"""

from __future__ import annotations

from typing import Any

import torch

from tdhook.attribution._unmapped_layers import is_weight
from tdhook.attribution.rules._autograd import is_activation

__all__ = ["BROADCAST_PRODUCT", "BroadcastProducts"]

#: the name under which such a layer's calls are counted (a Linear layer's, see :func:`layer_of`)
BROADCAST_PRODUCT = "sum of a broadcast product"

_PRODUCTS = frozenset({"mul", "rmul", "multiply"})
_SUMS = frozenset({"sum", "nansum", "mean"})  # a mean: a sum scaled by a number


class BroadcastProducts:
    """The broadcast products of an activation by a weight in one watched forward pass, and the sums of them that
    compute a Linear layer's map."""

    def __init__(self) -> None:
        # The product's autograd node → its activation, and the dimensions (counted from the end) the activation was
        # broadcast along and those it shares with the weight.
        self._products: dict[Any, tuple[torch.Tensor, frozenset[int], frozenset[int]]] = {}

    def note(self, name: str, args: tuple, result: Any) -> None:
        """Note the call ``name(*args)`` that returned ``result`` where it is such a product."""
        if name not in _PRODUCTS or len(args) != 2 or not isinstance(result, torch.Tensor) or result.grad_fn is None:
            return
        if not all(isinstance(arg, torch.Tensor) for arg in args):
            return
        activations = [arg for arg in args if is_activation(arg)]
        weights = [arg for arg in args if is_weight(arg)]
        if len(activations) != 1 or len(weights) != 1:
            return
        activation, weight = activations[0], weights[0]
        broadcast, shared = set(), set()
        for dim in range(1, result.dim() + 1):
            size = activation.shape[-dim] if dim <= activation.dim() else 1
            weight_size = weight.shape[-dim] if dim <= weight.dim() else 1
            if size == 1 and weight_size > 1:
                broadcast.add(dim)
            elif size > 1 and weight_size > 1:
                shared.add(dim)
        if broadcast and shared:
            self._products[result.grad_fn] = (activation, frozenset(broadcast), frozenset(shared))

    def layer(self, name: str, args: tuple, kwargs: dict | None) -> torch.Tensor | None:
        """The activation of the product that the call ``name(*args, **kwargs)`` sums into a Linear layer's map
        (over an input dimension, keeping an output one), else ``None``."""
        if name not in _SUMS or not args or not isinstance(args[0], torch.Tensor):
            return None
        noted = self._products.get(args[0].grad_fn)
        if noted is None:
            return None
        activation, broadcast, shared = noted
        dims = (kwargs or {}).get("dim", args[1] if len(args) > 1 else None)
        ndim = args[0].dim()
        if dims is None or (isinstance(dims, (tuple, list)) and not dims):
            return None  # a sum over everything: a scalar, no layer's outputs
        dims = (dims,) if isinstance(dims, int) else tuple(dims)
        if not all(isinstance(d, int) for d in dims):
            return None  # named dimensions
        summed = {ndim - (d % ndim) for d in dims}
        return activation if summed & shared and broadcast - summed else None

    def forget(self) -> None:
        """Forget the noted products (the end of the watched call)."""
        self._products.clear()
