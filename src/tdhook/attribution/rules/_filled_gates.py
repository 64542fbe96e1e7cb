"""A gate, or a softmax's weights, with constants written into some elements: a gate, or weights, still.

Gated models mask their padding (``g.masked_fill(pad, 0.0)``, ``torch.where(keep, g, 0.0)``,
``torch.where(pad, 1.0, g)``) before the product. Each element of the result is a value of the gate or a constant,
and constants joined with gates already count as gates (``torch.cat([ones, g], 1)``, see
:mod:`~tdhook.attribution.rules._joined_gates`): held or not, they pass no gradient. The result was no gate: a
product with it shared its relevance with the gate (1.7-6.5 off, relative L2, under AttnLRP and CP-LRP, 0.04-0.22
under EpsilonPlus; a softmax's weights 0.50-0.54 under AttnLRP; against the same product with the filled gate
detached). :func:`filled_pieces` tells the tensors whose values such a call keeps, for
:func:`~tdhook.attribution.rules.gates.keep_gate_mark` to mark the result as they are, and :func:`filled_mask` the
same call made on a mask of one of them (true where the constants go), for a join of gates and other activations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tdhook.attribution.rules._aten_operators import aten_operators as _aten
from tdhook.attribution.rules._autograd import is_activation

__all__ = ["FILLS", "WHERES", "filled_mask", "filled_pieces", "is_constant", "where_arguments"]


_MASKED_FILLS = frozenset({torch.masked_fill, torch.Tensor.masked_fill}) | _aten("masked_fill")
#: The ``where`` calls: each element of one of two tensors (or numbers), as a condition chooses.
WHERES = frozenset({torch.where, torch.Tensor.where}) | _aten("where")
#: The calls that write constants into some elements of a tensor, out of place: ``masked_fill``, ``where``.
FILLS = _MASKED_FILLS | WHERES
# The names of a ``where`` call's arguments, in their order (``aten.where.self(condition, self, other)``).
_WHERE_NAMES = {torch.Tensor.where: ("self", "condition", "other"), torch.where: ("condition", "input", "other")}
_WHERE_NAMES |= {op: ("condition", "self", "other") for op in _aten("where")}


def is_constant(value: Any) -> bool:
    """Whether ``value`` is a number, or a tensor no gradient reaches: held or not, it passes no gradient.

    Examples:
        >>> is_constant(0.0), is_constant(torch.zeros(2)), is_constant(torch.zeros(2, requires_grad=True))
        (True, True, False)
        >>> is_constant(None)
        False
    """
    if isinstance(value, torch.Tensor):
        with torch._C.DisableTorchFunction():  # (a property read is a call of another mode)
            return not value.requires_grad
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def filled_pieces(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
    """The tensors whose values ``func(*args, **kwargs)`` (one of :data:`FILLS`) keeps where it writes no constant:
    ``g`` of ``g.masked_fill(m, 0.0)`` with a constant value, ``torch.where(c, g, 0.0)``, ``torch.where(c, 1.0, g)``,
    ``torch.where(c, g, h)``; ``None`` where it writes values a gradient reaches, or keeps none.

    Examples:
        >>> g = torch.ones(3, requires_grad=True) * 0.5
        >>> mask = torch.tensor([True, False, False])
        >>> filled_pieces(torch.Tensor.masked_fill, (g, mask, 0.0), {}) == [g]
        True
        >>> filled_pieces(torch.where, (mask, 1.0, g), {}) == [g], filled_pieces(torch.where, (mask,), {})
        (True, None)
        >>> filled_pieces(torch.Tensor.where, (g, mask, 0.0), {}) == [g]  # ``g.where(mask, 0.0)``
        True
    """
    if func in _MASKED_FILLS:
        value = args[2] if len(args) > 2 else kwargs.get("value")
        source = args[0] if args else kwargs.get("input")
        if not isinstance(source, torch.Tensor) or not is_constant(value):
            return None
        return [source]
    args = where_arguments(func, args, kwargs)
    if len(args) != 3:  # (``torch.where(c)``: the indices of the true elements)
        return None
    pieces = [piece for piece in args[1:] if not _chosen_constant(piece)]
    return [piece for piece in pieces if isinstance(piece, torch.Tensor)] or None


def _chosen_constant(piece: Any) -> bool:
    """Whether ``piece``, one of the two a ``where`` chooses from, is a constant to the rules: a number, a tensor no
    gradient reaches, or no activation (a parameter, ``torch.where(c, g, p)``; a tensor a rule holds), as a join's
    pieces are (see :mod:`~tdhook.attribution.rules._joined_gates`). A parameter was taken as an activation that is
    no gate: a product with the choice gave its elements' relevance in part to the parameter, which passes it to
    nothing (0.12 off, relative L2, under AttnLRP and CP-LRP; a softmax's weights chosen with a parameter 0.31)."""
    if is_constant(piece):
        return True
    with torch._C.DisableTorchFunction():  # (a property read is a call of another mode)
        return isinstance(piece, torch.Tensor) and not is_activation(piece)


def filled_mask(func: Any, args: tuple, kwargs: dict, piece: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """The call ``func(*args, **kwargs)`` (one of :data:`FILLS`, its pieces told by :func:`filled_pieces`) made on a
    mask of ``piece``'s shape instead: the mask where ``piece``'s values go, true where a constant does (a constant
    counts as a gate).

    Examples:
        >>> g = torch.ones(3, requires_grad=True) * 0.5
        >>> made = filled_mask(torch.where, (torch.tensor([True, False, True]), g, 0.0), {}, g)
        >>> made(torch.tensor([False, True, True])).tolist()
        [False, True, True]
    """
    if func in _MASKED_FILLS:
        where = args[1] if len(args) > 1 else kwargs["mask"]
        return lambda mask: mask.masked_fill(where, True)
    condition, first, second = where_arguments(func, args, kwargs)
    if first is piece:
        return lambda mask: torch.where(condition, mask, _chosen_constant(second))
    return lambda mask: torch.where(condition, _chosen_constant(first), mask)


def where_arguments(func: Any, args: tuple, kwargs: dict) -> tuple:
    """A ``where`` call's arguments in ``torch.where``'s order (``g.where(c, 0.0)``: ``torch.where(c, g, 0.0)``), those
    given by keyword too (``torch.where(c, g, other=0.0)``: read by position alone, no gate was kept, 1.2 off,
    relative L2, under AttnLRP and CP-LRP, 0.76 under EpsilonPlus).

    Examples:
        >>> c, g = torch.tensor([True, False]), torch.ones(2)
        >>> where_arguments(torch.where, (c,), {"input": g, "other": 0.0}) == (c, g, 0.0)
        True
        >>> where_arguments(torch.Tensor.where, (g,), {"condition": c, "other": 0.0}) == (c, g, 0.0)
        True
    """
    names = _WHERE_NAMES.get(func, _WHERE_NAMES[torch.where])
    for name in names[len(args) :] if kwargs else ():
        if name not in kwargs:
            break
        args = (*args, kwargs[name])
    return (args[1], args[0], *args[2:]) if func is torch.Tensor.where and len(args) > 1 else args
