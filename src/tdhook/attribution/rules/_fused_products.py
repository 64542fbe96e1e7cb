"""Products fused with a sum: ``torch.addcmul(h, a, b, value=v)`` (``h + v·a·b``) and ``torch.lerp(s, e, w)``
(``s + w·(e − s)``), with the rule of the product they compute.

A gated update written with them (``torch.lerp(h, n, z)``, a GRU's ``(1 − z)·h + z·n`` with a sigmoid gate ``z``;
``h.addcmul_(g, n)``, a gated residual) kept its plain gradient, with a warning naming the call: the gate took part of
the relevance (0.56-0.87 off, relative L2, float64, under AttnLRP and CP-LRP, 0.09-0.18 under EpsilonPlus, against
the same update written with ``*``, whose gate is held). Now a sigmoid-like gate among the factors (under CP-LRP, a
gate of any kind) is held, as in ``g * n``; under AttnLRP and CP-LRP, ``addcmul`` of two activations that are no gates
gets the uniform rule, as ``a * b`` does. A ``lerp`` whose weight is an activation but no gate keeps its plain gradient
and its warning (its product has no rule written out here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tdhook.attribution.rules._autograd import call_argument, hold, is_activation, scale_gradient

__all__ = ["FUSED_PRODUCTS", "fused_factors", "fused_product"]

_ADDCMULS = frozenset({torch.addcmul, torch.Tensor.addcmul, torch.Tensor.addcmul_})
_LERPS = frozenset({torch.lerp, torch.Tensor.lerp, torch.Tensor.lerp_})
#: The products fused with a sum that :func:`fused_product` gives a rule.
FUSED_PRODUCTS = _ADDCMULS | _LERPS


def fused_factors(func: Any, args: tuple, kwargs: dict, held: Callable[[tuple], list[bool] | None]) -> Any:
    """Which factors of the product ``func(*args, **kwargs)`` (one of :data:`FUSED_PRODUCTS`) computes to hold:
    ``held((a, b))`` of ``addcmul``'s two factors, or ``[True, False]`` for a ``lerp`` whose weight ``held`` takes
    for a gate (beside an activation); ``None`` where the product has no rule (a factor a constant: a linear map of
    the other; a ``lerp``'s weight no gate).

    Examples:
        >>> x = torch.ones(2, requires_grad=True)
        >>> h = x * 2
        >>> fused_factors(torch.addcmul, (h, h, torch.ones(2)), {}, lambda f: [False, False])  # times a constant
        >>> fused_factors(torch.lerp, (h, h * 3, 0.5), {}, lambda f: [True, False])  # a number's weight
    """
    if func in _ADDCMULS:
        factors = (call_argument(args, kwargs, 1, "tensor1"), call_argument(args, kwargs, 2, "tensor2"))
        return held(factors) if all(map(is_activation, factors)) else None
    weight = call_argument(args, kwargs, 2, "weight")
    ends = (args[0] if args else kwargs.get("input"), call_argument(args, kwargs, 1, "end"))
    if not (is_activation(weight) and any(map(is_activation, ends))):
        return None
    gates = held((weight, ends[0] if is_activation(ends[0]) else ends[1]))
    return gates if gates == [True, False] else None


def fused_product(func: Any, args: tuple, kwargs: dict, gates: list[bool], uniform: bool) -> torch.Tensor:
    """``func(*args, **kwargs)``, a product fused with a sum (see :func:`fused_factors`), with the factors ``gates``
    held constant, or (none held and ``uniform``) each with half of the product's relevance. The values are the
    call's own.

    Examples:
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> h, z = x * 1, torch.sigmoid(x)
        >>> y = fused_product(torch.lerp, (h, 3 * h, z), {}, [True, False], uniform=False)
        >>> torch.equal(y, torch.lerp(h, 3 * h, z))
        True
        >>> grad = torch.autograd.grad(y.sum(), x)[0]  # the gate held: 1 + 2z, no gradient through z
        >>> torch.allclose(grad, 1 + 2 * z.detach())
        True
    """
    if func in _LERPS:
        weight = call_argument(args, kwargs, 2, "weight")
        rest = {k: v for k, v in kwargs.items() if k != "weight"}
        if len(args) > 2:
            return func(*args[:2], hold(weight), *args[3:], **rest)
        return func(*args, **rest, weight=hold(weight))
    factors = [call_argument(args, kwargs, 1, "tensor1"), call_argument(args, kwargs, 2, "tensor2")]
    if any(gates):
        factors = [hold(f) if gate else f for f, gate in zip(factors, gates, strict=True)]
    elif uniform:
        factors = [scale_gradient(f, 0.5) for f in factors]  # (AttnLRP's uniform rule, as for ``a * b``)
    rest = {k: v for k, v in kwargs.items() if k not in ("tensor1", "tensor2")}
    return func(args[0] if args else rest.pop("input"), *factors, *args[3:], **rest)
