"""Straight-through estimators in a forward pass: ``x + (y - x).detach()``, whose value is ``y`` and gradient ``x``'s.

A vector-quantised codebook (``x + (q - x).detach()``), a discrete latent
(``p + (onehot - p).detach()``) or a hard Gumbel sample
(``y_hard - y_soft.detach() + y_soft``) adds back to an activation ``x`` a
detached difference that cancels it in value: the next layers read ``y``, but
the gradient, and with it the relevance, passes through ``x`` alone. The
relevance that comes back is then that of ``x``, not of the value the model
computed with (a sum off the explained output's with no error).
:class:`StraightThrough` follows the calls of one watched forward pass (see
:class:`~tdhook.attribution._nonlinear_calls.NonlinearCalls`): it marks each
tensor that holds ``±x`` among its terms (a difference of ``x``, a detached
``x``, their negations and detached copies) and finds the sums that add such a
detached tensor back to ``x`` itself. A detached branch added as a constant
(``h + f(h).detach()``, a bias) or statistics detached for a norm hold no
``-h`` and are not found.

Examples:
    >>> import torch
    >>> x = torch.randn(3, requires_grad=True) * 1
    >>> onehot = (x == x.max()).to(x.dtype)
    >>> found = StraightThrough()
    >>> difference = torch.Tensor.__sub__(onehot, x)
    >>> found.note(torch.Tensor.__sub__, (onehot, x), difference)
    False
    >>> detached = difference.detach()
    >>> found.note(torch.Tensor.detach, (difference,), detached)
    False
    >>> found.note(torch.Tensor.__add__, (x, detached), x + detached)  # x + (onehot - x).detach(): its value is onehot
    True
    >>> found.note(torch.Tensor.__add__, (x, x.detach()), 2 * x)  # a detached copy added as a constant: not one
    False
    >>> found.forget()  # the end of the watched call: the marks come off
    >>> detached.__dict__
    {}
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["STRAIGHT_THROUGH", "StraightThrough"]

#: the name under which a module's straight-through sums are counted (see :class:`~tdhook.attribution.coverage`)
STRAIGHT_THROUGH = "a straight-through estimator (x + (y - x).detach())"

# On a tensor: the (tensor, sign) pairs of the activations it holds with that sign among its terms.
_TERMS = "_tdhook_terms"

# The most terms a tensor is marked with.
_MOST_TERMS = 4

_T = torch.Tensor
_DETACHES = frozenset({_T.detach, torch.detach})
_NEGATIONS = frozenset({torch.neg, torch.negative, _T.neg, _T.negative, _T.__neg__})
# a - b, with the arguments (a, b)
_SUBTRACTIONS = frozenset({torch.sub, torch.subtract, _T.sub, _T.subtract, _T.__sub__, _T.sub_, _T.__isub__})
_ADDITIONS = frozenset({torch.add, _T.add, _T.__add__, _T.__radd__, _T.add_, _T.__iadd__})
_WATCHED = _DETACHES | _NEGATIONS | _SUBTRACTIONS | _ADDITIONS


def _terms(value: Any) -> list[tuple[torch.Tensor, int]]:
    """The ``(activation, sign)`` terms ``value`` holds: its marks, and itself where it has a gradient."""
    if not isinstance(value, torch.Tensor):
        return []
    own = [(value, 1)] if value.requires_grad else []
    return own + getattr(value, _TERMS, [])


def _cancels(x: Any, constant: Any, sign: int) -> bool:
    """Whether ``x + sign * constant`` adds back to ``x`` a detached tensor that holds ``-x``: a value other than
    ``x``'s, with ``x``'s gradient."""
    if not isinstance(x, torch.Tensor) or not x.requires_grad:
        return False
    if not isinstance(constant, torch.Tensor) or constant.requires_grad:
        return False
    return any(term is x and term_sign * sign == -1 for term, term_sign in getattr(constant, _TERMS, ()))


class StraightThrough:
    """Finds, among the calls it is told of, the sums that add back to an activation a detached difference of it.

    The marks it puts on tensors last until :meth:`forget` (the end of the watched call): no tensor the model returns
    keeps them, nor the activations they refer to.
    """

    def __init__(self) -> None:
        self._marked: list[weakref.ref] = []

    def _mark(self, result: Any, terms: list[tuple[torch.Tensor, int]]) -> None:
        """Mark ``result`` with the first few ``terms`` (a chain of differences keeps a short list), but itself (in
        place: no tensor that refers to itself)."""
        terms = [(t, s) for t, s in terms if t is not result][:_MOST_TERMS]
        if terms and isinstance(result, torch.Tensor):
            setattr(result, _TERMS, terms)
            self._marked.append(weakref.ref(result))

    def forget(self) -> None:
        """Take the marks off the tensors that are still alive."""
        for ref in self._marked:
            tensor = ref()
            if tensor is not None:
                tensor.__dict__.pop(_TERMS, None)
        self._marked.clear()

    def note(self, func: Any, args: tuple, result: Any, kwargs: dict | None = None) -> bool:
        """Mark ``result`` with the terms it holds; whether the call adds a detached ``y - x`` back to ``x``."""
        if func not in _WATCHED or not args or kwargs:  # ``alpha=``: another sum, not followed
            return False
        if func in _DETACHES:
            self._mark(result, _terms(args[0]))
            return False
        if func in _NEGATIONS:
            self._mark(result, [(t, -s) for t, s in _terms(args[0])])
            return False
        if len(args) != 2:
            return False
        a, b = args
        if func in _SUBTRACTIONS:
            if _cancels(a, b, -1):
                return True
            self._mark(result, _terms(a) + [(t, -s) for t, s in _terms(b)])
            return False
        return _cancels(a, b, 1) or _cancels(b, a, 1)
