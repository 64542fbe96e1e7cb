"""Constants beside an activation kept through a padding, a negation, a sum or a product with a constant.

A tensor with constants in some elements and an activation in the others (a join of them, a fill, an in-place write:
see :mod:`~tdhook.attribution.rules._constant_elements`) keeps its constants where a call leaves a constant element a
constant: ``-c``, ``c + 1.0``, ``c - w`` (``w`` a weight), ``c * -2.0``, ``c * cos``, ``F.pad(c, (1, 1))``; a padding
adds the constants it pads with, beside an activation that had none (``F.pad(h, (1, 0), value=1.0)``, a unit for a
bias, as ``torch.cat([ones, h], 1)``). The result had no mask: a product with it gave its constant elements half of its
relevance, passed on to nothing, or took a sigmoid gate times it for two gates alike (0.08-1.1 off, relative L2,
float64, under AttnLRP, CP-LRP and EpsilonPlus, against the products taken apart). :func:`keep_constants` notes
them, as the join does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tdhook.attribution.rules._autograd import is_activation
from tdhook.attribution.rules._constant_elements import (
    CONSTANT_MASKS_MADE,
    CONSTANTS_JOINED,
    constants_shown,
    note_constant_gates,
)
from tdhook.attribution.rules._storage_masks import count_mask, laid_over_storage

__all__ = ["CONSTANTS_KEPT", "NEGATIONS", "PADS", "SUMS", "keep_constants", "padded_mask"]

#: Paddings: a constant's (or, reflected, replicated, circular, a copy of the values').
PADS = frozenset({F.pad, torch.constant_pad_nd})
#: Negations: a constant where the operand is one.
NEGATIONS = frozenset({torch.neg, torch.negative, torch.Tensor.neg, torch.Tensor.negative, torch.Tensor.__neg__})
#: Sums and differences of two tensors, or of a tensor and a number: a constant where both are.
SUMS = frozenset({torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__})
SUMS |= {torch.sub, torch.subtract, torch.Tensor.sub, torch.Tensor.subtract, torch.Tensor.__sub__}
SUMS |= {torch.Tensor.__rsub__, torch.rsub}
# A product or a quotient by a constant of any sign (``c * -2.0``, ``k * cos``, a rotary embedding's): a constant where
# both operands are (a negative scaling, or one by a tensor, dropped the constants: 0.07-0.52 off, relative L2).
_PRODUCTS = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.multiply})
_PRODUCTS |= {torch.Tensor.multiply, torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.__rtruediv__}
_PRODUCTS |= {torch.true_divide, torch.Tensor.true_divide, torch.divide, torch.Tensor.divide}
#: The calls :func:`keep_constants` follows.
CONSTANTS_KEPT = PADS | NEGATIONS | SUMS | _PRODUCTS


def padded_mask(func: Any, args: tuple, kwargs: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """The call ``F.pad(*args, **kwargs)`` (or ``torch.constant_pad_nd``) made on a mask of the padded tensor's
    shape: true where the constants padded with go, and copied where its values are (reflected, replicated,
    circular).

    Examples:
        >>> padded_mask(F.pad, (torch.ones(1, 2), (1, 0)), {})(torch.tensor([[False, True]])).tolist()
        [[True, False, True]]
    """
    pad = args[1] if len(args) > 1 else kwargs["pad"]
    if _mode(func, args, kwargs) == "constant":
        return lambda mask: torch.constant_pad_nd(mask, pad, True)
    mode = _mode(func, args, kwargs)
    return lambda mask: F.pad(mask.to(torch.float32), pad, mode=mode) > 0.5  # (no such padding of booleans)


def keep_constants(func: Any, args: tuple, kwargs: dict, result: Any) -> None:
    """Note on ``result``, the output of ``func(*args, **kwargs)`` (one of :data:`CONSTANTS_KEPT`), where it holds
    constants beside an activation (see the module's docstring).

    Examples:
        >>> h = torch.ones(2, 2, requires_grad=True) * 2  # an activation
        >>> padded = F.pad(h, (1, 0), value=1.0)
        >>> keep_constants(F.pad, (h, (1, 0)), {"value": 1.0}, padded)
        >>> constants_shown(padded).tolist()
        [[True, False, False], [True, False, False]]
        >>> shifted = padded + 3.0
        >>> keep_constants(torch.Tensor.__add__, (padded, 3.0), {}, shifted)
        >>> constants_shown(shifted).tolist()
        [[True, False, False], [True, False, False]]
    """
    if not isinstance(result, torch.Tensor) or result._base is not None or not args:
        return
    if func in PADS:
        region, value = _padded_constants(func, args, kwargs)
    elif CONSTANT_MASKS_MADE:
        region, value = _elementwise_constants(args), None
    else:
        return
    if region is None or not is_activation(result):
        return
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        try:
            region = torch.broadcast_to(region, result.shape)
        except RuntimeError:  # (a call that changed the shape otherwise: nothing noted)
            return
        every = bool(region.all())
        mask = None if every or not bool(region.any()) else laid_over_storage(result, region)
    if mask is None:
        return
    setattr(result, CONSTANTS_JOINED, (mask, result._version))
    count_mask(result, CONSTANT_MASKS_MADE)
    note_constant_gates(result, region, value)


def _mode(func: Any, args: tuple, kwargs: dict) -> str:
    return "constant" if func is not F.pad else args[2] if len(args) > 2 else kwargs.get("mode", "constant")


def _padded_constants(func: Any, args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, Any]:
    """Where a padding's output holds constants: a mask of its shape (``None``: none beside an activation), and the
    constant padded with."""
    source = args[0]
    if not isinstance(source, torch.Tensor):
        return None, None
    shown = constants_shown(source)
    value = args[3] if len(args) > 3 else kwargs.get("value")
    if func is torch.constant_pad_nd:
        value = args[2] if len(args) > 2 else kwargs.get("value", 0)
    constant = _mode(func, args, kwargs) == "constant"
    if shown is None and (not constant or not value):  # copies of the values, or zeros: nothing to note
        return None, None
    with torch._C.DisableTorchFunction(), torch.no_grad():
        before = torch.zeros(source.shape, dtype=torch.bool, device=source.device) if shown is None else shown
        try:
            return padded_mask(func, args, kwargs)(before), value
        except (RuntimeError, TypeError, NotImplementedError):  # a call a mask cannot take: nothing noted
            return None, None


def _elementwise_constants(args: tuple) -> torch.Tensor | None:
    """Where a negation's, a sum's, a difference's, a product's or a quotient's output (of ``args``, its operands)
    holds constants: a mask that broadcasts to its shape; ``None`` where no operand shows constants, or one is an
    activation that shows none."""
    masks = []
    for operand in args[:2]:
        shown = constants_shown(operand)
        if shown is not None:
            masks.append(shown)
        elif is_activation(operand):  # an activation in every element: nothing constant beside it
            return None
    if not masks:
        return None
    with torch._C.DisableTorchFunction():
        return masks[0] if len(masks) == 1 else masks[0] & masks[1]
