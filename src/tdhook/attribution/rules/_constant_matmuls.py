"""Matrix products with a factor that holds constants beside an activation: the constants' part a linear map.

A key cache joined onto a constant (``keys = torch.cat([past_k, k], 1)`` with ``past_k`` detached, or computed from
parameters alone) times the queries (``q @ keys.transpose(1, 2)``) is a product of two activations, but each of its
elements is a query times a past key (a constant: a linear map of the query, which takes all of its relevance) or
times a new key (the uniform rule of two activations). The join notes where its constants went (see
:mod:`~tdhook.attribution.rules._constant_elements`), which element-wise products alone read: the uniform rule gave
the past keys' columns half of their relevance, passed on to nothing (0.28 off, relative L2, float64, under AttnLRP
and CP-LRP, against the products taken apart; 0.72 for cached queries, 0.20 for a constant feature).

:func:`constant_matmul` gives each element of such a product the rule it gets apart, where a factor's constants fill
whole rows of it along the contraction (a whole key, a whole query); where they do not (constants among the
features each element sums over), the product is taken as the sum of its parts, the constants' a linear map and the
rest under the uniform rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tdhook.attribution.rules._autograd import hold, redirect
from tdhook.attribution.rules._constant_elements import CONSTANT_MASKS_MADE, constants_shown

__all__ = ["MATMULS", "constant_baddbmm", "constant_einsum", "constant_matmul", "plain_values", "shows_constants"]

#: The matrix products of two tensors.
MATMULS = frozenset(
    {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm, torch.mm, torch.Tensor.mm}
)


def constant_matmul(
    func: Callable, args: tuple, kwargs: dict, uniform: Callable[[tuple], torch.Tensor]
) -> torch.Tensor | None:
    """``func(*args, **kwargs)``, a matrix product of two activations one of which at least holds constants beside
    an activation (see the module's docstring), with the rule each element gets apart: ``uniform(factors)`` is the
    product under the rule of two activations; ``None`` where neither factor holds such constants.

    Examples:
        >>> from tdhook.attribution.rules._constant_elements import CONSTANT_MASKS_MADE, CONSTANTS_JOINED
        >>> from tdhook.attribution.rules._storage_masks import count_mask
        >>> q = torch.ones(1, 2, requires_grad=True)
        >>> keys = torch.cat([torch.full((1, 2), 3.0), q * 2], 0)  # a constant key, then an activation's
        >>> keys.__dict__[CONSTANTS_JOINED] = (torch.tensor([True, True, False, False]), keys._version)
        >>> count_mask(keys, CONSTANT_MASKS_MADE)
        >>> half = lambda factors: torch.matmul(*factors) * 0.5 + (torch.matmul(*factors) * 0.5).detach()
        >>> scores = constant_matmul(torch.matmul, (q, keys.t()), {}, half)
        >>> scores.tolist()
        [[6.0, 4.0]]
        >>> torch.autograd.grad(scores.sum(), q)[0].tolist()  # the constant key's column whole, half the other's
        [[5.0, 5.0]]
    """
    if len(args) != 2 or kwargs or not all(isinstance(a, torch.Tensor) for a in args):
        return None
    a, b = args
    masks = constants_shown(a), constants_shown(b)
    if masks[0] is None and masks[1] is None:
        return None
    if a.dim() < 2 or b.dim() < 2:  # a vector: its elements are summed over, the constants' a part of the sum
        return _summed(func, a, b, masks, uniform)
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        rows = None if masks[0] is None else masks[0].all(-1, keepdim=True)  # a's rows constant whole
        columns = None if masks[1] is None else masks[1].all(-2, keepdim=True)  # b's columns constant whole
        whole = (rows is None or torch.equal(rows, masks[0].any(-1, keepdim=True))) and (
            columns is None or torch.equal(columns, masks[1].any(-2, keepdim=True))
        )
    if not whole:
        return _summed(func, a, b, masks, uniform)
    product = uniform((a, b))
    if columns is not None:  # b's constants: a linear map of a there
        product = torch.where(columns, func(a, hold(b)), product)
    if rows is not None:  # a's constants: a linear map of b there
        product = torch.where(rows, func(hold(a), b), product)
    return product


def constant_einsum(
    equation: str, operands: tuple, kwargs: dict, uniform: Callable[[tuple], torch.Tensor]
) -> torch.Tensor | None:
    """``torch.einsum(equation, *operands, **kwargs)`` of two activations one of which at least holds constants
    beside an activation (a key cache joined onto detached past keys, contracted by an ``einsum``), as the sum of its
    parts (each factor's constants a linear map of the other, the rest ``uniform(factors)``); ``None`` where neither
    factor holds such constants. An ``einsum`` is bilinear in its two operands, as a matrix product is.

    Examples:
        >>> from tdhook.attribution.rules._constant_elements import CONSTANTS_JOINED
        >>> from tdhook.attribution.rules._storage_masks import count_mask
        >>> q = torch.ones(1, 2, requires_grad=True)
        >>> keys = torch.cat([torch.full((1, 2), 3.0), q * 2], 0)  # a constant key, then an activation's
        >>> keys.__dict__[CONSTANTS_JOINED] = (torch.tensor([True, True, False, False]), keys._version)
        >>> count_mask(keys, CONSTANT_MASKS_MADE)
        >>> half = lambda f: torch.einsum("qd,kd->qk", *f) * 0.5 + (torch.einsum("qd,kd->qk", *f) * 0.5).detach()
        >>> scores = constant_einsum("qd,kd->qk", (q, keys), {}, half)
        >>> scores.tolist(), torch.autograd.grad(scores.sum(), q)[0].tolist()
        ([[6.0, 4.0]], [[5.0, 5.0]])
    """
    if len(operands) != 2 or not all(isinstance(a, torch.Tensor) for a in operands):
        return None
    masks = constants_shown(operands[0]), constants_shown(operands[1])
    if masks[0] is None and masks[1] is None:
        return None

    def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.einsum(equation, a, b, **kwargs)

    return _summed(product, *operands, masks, uniform)


def constant_baddbmm(
    func: Callable, args: tuple, kwargs: dict, uniform: Callable[[tuple], torch.Tensor]
) -> torch.Tensor | None:
    """``func(*args, **kwargs)``, a ``torch.baddbmm`` (``beta · input + alpha · batch1 @ batch2``) whose two batches
    are activations one of which at least holds constants beside an activation, with the product's elements ruled as
    :func:`constant_matmul` rules them (``uniform(factors)``, the rule of two activations); the input a summand.
    ``None`` where neither batch holds such constants, or the call takes what this does not read (``out=``).

    Examples:
        >>> from tdhook.attribution.rules._constant_elements import CONSTANTS_JOINED
        >>> from tdhook.attribution.rules._storage_masks import count_mask
        >>> q = torch.ones(1, 1, 2, requires_grad=True)
        >>> keys = torch.cat([torch.full((1, 1, 2), 3.0), q * 2], 1)
        >>> keys.__dict__[CONSTANTS_JOINED] = (torch.tensor([True, True, False, False]), keys._version)
        >>> count_mask(keys, CONSTANT_MASKS_MADE)
        >>> half = lambda f: torch.bmm(*f) * 0.5 + (torch.bmm(*f) * 0.5).detach()
        >>> scores = constant_baddbmm(torch.baddbmm, (torch.ones(1, 1, 2), q, keys.transpose(1, 2)), {}, half)
        >>> scores.tolist(), torch.autograd.grad(scores.sum(), q)[0].tolist()
        ([[[7.0, 5.0]]], [[[5.0, 5.0]]])
    """
    if len(args) != 3 or set(kwargs) - {"beta", "alpha"}:
        return None
    product = constant_matmul(torch.bmm, args[1:], {}, uniform)
    if product is None:
        return None
    beta, alpha = kwargs.get("beta", 1), kwargs.get("alpha", 1)
    if alpha != 1:
        product = product * alpha
    if beta != 0:  # (with beta 0, the input is not read, NaN in it included, as torch.baddbmm does)
        product = product + (args[0] if beta == 1 else args[0] * beta)
    return plain_values(torch.baddbmm(*args, **kwargs), product)  # the fused call rounds once


def shows_constants(*values: object) -> bool:
    """Whether one of ``values`` holds constants beside an activation (see :func:`constants_shown`).

    Examples:
        >>> shows_constants(torch.ones(2), None)
        False
    """
    return bool(CONSTANT_MASKS_MADE) and any(constants_shown(value) is not None for value in values)


def _summed(
    func: Callable,
    a: torch.Tensor,
    b: torch.Tensor,
    masks: tuple[torch.Tensor | None, torch.Tensor | None],
    uniform: Callable[[tuple], torch.Tensor],
) -> torch.Tensor:
    """``func(a, b)`` with the gradient of the sum of its parts: each factor's constants (``masks``) times the other,
    a linear map of it, and the rest under ``uniform``. Its values are the plain product's, bit for bit: the parts,
    summed, round otherwise (PEGASUS-X's attention over a padded block, off by an ulp)."""
    plain = func(a, b)
    parts = []
    if masks[0] is not None:
        parts.append(func(hold(a * masks[0]), b))
        a = a * ~masks[0]
    if masks[1] is not None:
        parts.append(func(a, hold(b * masks[1])))
        b = b * ~masks[1]
    return plain_values(plain, sum(parts, uniform((a, b))))


def plain_values(plain: torch.Tensor, ruled: torch.Tensor) -> torch.Tensor:
    """``plain``'s values with ``ruled``'s gradient: a rule computed in other steps than the model's (a product as
    the sum of its parts) changes none of the forward pass's numbers.

    Examples:
        >>> x = torch.tensor([0.1, 0.2], requires_grad=True)
        >>> y = plain_values(x * 0.3, x * 0.1 + x * 0.2)  # the second rounds otherwise
        >>> torch.equal(y, x.detach() * 0.3), torch.autograd.grad(y.sum(), x)[0].tolist()
        (True, [0.30000001192092896, 0.30000001192092896])
    """
    return redirect(plain, [ruled], _identity)


def _identity(grad: torch.Tensor) -> list[torch.Tensor]:
    return [grad]
