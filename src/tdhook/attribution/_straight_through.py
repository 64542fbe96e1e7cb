"""Detached terms that part a sum's value from its gradient: straight-through estimators and gradient scaling.

A vector-quantised codebook (``x + (q - x).detach()``), a discrete latent
(``p + (onehot - p).detach()``) or a hard Gumbel sample
(``y_hard - y_soft.detach() + y_soft``) adds back to an activation ``x`` a
detached difference that cancels it in value: the next layers read ``y``, but
the gradient, and with it the relevance, passes through ``x`` alone. The
relevance that comes back is then that of ``x``, not of the value the model
computed with (a sum off the explained output's with no error). MuZero's
``scale_gradient`` (``x * s + x.detach() * (1 - s)``, in a world model's
dynamics) keeps ``x``'s value and scales its gradient by ``s``: the relevance of
what it reads is ``s`` times the model's without it.
:class:`StraightThrough` follows the calls of one watched forward pass (see
:class:`~tdhook.attribution._nonlinear_calls.NonlinearCalls`): it marks each
tensor that holds an activation ``x`` among its terms with two coefficients,
of ``x`` in its value and in its gradient (through differences, negations,
products by a number, copies and detached copies; a write in place that it does not follow takes a tensor's marks
off), and finds the sums where ``x``
keeps a gradient but leaves the value (a straight-through estimator) or keeps
its value but not its gradient (a gradient scaling). A detached branch added
as a constant (``h + f(h).detach()``, ``h + h.detach()``, a bias) or
statistics detached for a norm are neither, and are not found.

Examples:
    >>> import torch
    >>> x = torch.randn(3, requires_grad=True) * 1
    >>> onehot = (x == x.max()).to(x.dtype)
    >>> found = StraightThrough()
    >>> difference = torch.Tensor.__sub__(onehot, x)
    >>> found.note(torch.Tensor.__sub__, (onehot, x), difference)
    >>> detached = difference.detach()
    >>> found.note(torch.Tensor.detach, (difference,), detached)
    >>> found.note(torch.Tensor.__add__, (x, detached), x + detached)  # x + (onehot - x).detach(): its value is onehot
    'a straight-through estimator (x + (y - x).detach())'
    >>> found.note(torch.Tensor.__add__, (x, x.detach()), 2 * x)  # a detached copy added as a constant: not one
    >>> copy = x.detach()
    >>> found.note(torch.Tensor.detach, (x,), copy)
    >>> scaled, rest = x * 0.25, copy * 0.75
    >>> found.note(torch.Tensor.__mul__, (x, 0.25), scaled), found.note(torch.Tensor.__mul__, (copy, 0.75), rest)
    (None, None)
    >>> found.note(torch.Tensor.__add__, (scaled, rest), scaled + rest)  # the value x, a quarter of its gradient
    'a gradient scaling (x * s + x.detach() * (1 - s))'
    >>> found.forget()  # the end of the watched call: the marks come off
    >>> detached.__dict__
    {}
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch

from tdhook.attribution.rules._in_place_writes import WRITES_IN_PLACE

__all__ = ["GRADIENT_SCALING", "STRAIGHT_THROUGH", "SUMS", "StraightThrough", "held_activations"]

#: the name under which a module's straight-through sums are counted (see :class:`~tdhook.attribution.coverage`)
STRAIGHT_THROUGH = "a straight-through estimator (x + (y - x).detach())"
#: the name under which a module's gradient scalings are counted
GRADIENT_SCALING = "a gradient scaling (x * s + x.detach() * (1 - s))"

# On a tensor: the (activation, value coefficient, gradient coefficient) terms it holds.
_TERMS = "_tdhook_terms"

# The most terms a tensor is marked with.
_MOST_TERMS = 4

_T = torch.Tensor
_DETACHES = frozenset({_T.detach, torch.detach})
_NEGATIONS = frozenset({torch.neg, torch.negative, _T.neg, _T.negative, _T.__neg__})
# a - b, with the arguments (a, b)
_SUBTRACTIONS = frozenset({torch.sub, torch.subtract, _T.sub, _T.subtract, _T.__sub__, _T.sub_, _T.__isub__})
_ADDITIONS = frozenset({torch.add, _T.add, _T.__add__, _T.__radd__, _T.add_, _T.__iadd__})
_PRODUCTS = frozenset({torch.mul, torch.multiply, _T.mul, _T.multiply, _T.__mul__, _T.__rmul__, _T.mul_, _T.__imul__})
# a / b, with the arguments (a, b)
_DIVISIONS = frozenset({torch.div, torch.divide, torch.true_divide, _T.div, _T.divide, _T.__truediv__, _T.div_})
_DIVISIONS |= {_T.__itruediv__}
# A copy holds what its source holds: ``y = x.clone(); y += (q - x).detach()`` is ``x + (q - x).detach()``.
_COPIES = frozenset({torch.clone, _T.clone})
#: sums and differences of two tensors, out of place and in place
SUMS = _ADDITIONS | _SUBTRACTIONS
_WATCHED = _DETACHES | _NEGATIONS | _SUBTRACTIONS | _ADDITIONS | _PRODUCTS | _DIVISIONS | _COPIES

Terms = list[tuple[torch.Tensor, float, float]]


def _terms(value: Any) -> Terms:
    """The ``(activation, value coefficient, gradient coefficient)`` terms ``value`` holds: its marks, and itself
    where it has a gradient."""
    if not isinstance(value, torch.Tensor):
        return []
    own = [(value, 1.0, 1.0)] if value.requires_grad else []
    return own + getattr(value, _TERMS, [])


def held_activations(value: Any) -> set[int]:
    """The ids of the activations ``value`` holds among its terms (itself where it has a gradient, and those of the
    differences, products by a number and detached copies it was computed by)."""
    return {id(t) for t, _, _ in _terms(value)}


def _scaled(terms: Terms, value: float, gradient: float | None = None) -> Terms:
    gradient = value if gradient is None else gradient
    return [(t, v * value, g * gradient) for t, v, g in terms]


def _number(value: Any) -> float | None:
    """``value`` as a number, where it is one (a Python number, or a one-element tensor without gradient)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, torch.Tensor) and not value.requires_grad and value.numel() == 1 and not value.is_complex():
        return float(value)
    return None


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def _kind(terms: Terms) -> str | None:
    """What a sum holding ``terms`` is: an activation with a gradient but none of its value (a straight-through
    estimator), or with its value but another gradient (a gradient scaling); ``None`` for neither."""
    totals: dict[int, list[float]] = {}
    for t, v, g in terms:
        total = totals.setdefault(id(t), [0.0, 0.0])
        total[0] += v
        total[1] += g
    for v, g in totals.values():
        if _close(g, 0.0):
            continue
        if _close(v, 0.0):
            return STRAIGHT_THROUGH
        if _close(v, 1.0) and not _close(g, 1.0):
            return GRADIENT_SCALING
    return None


class StraightThrough:
    """Finds, among the calls it is told of, the sums whose value and gradient part in an activation through a
    detached term: straight-through estimators and gradient scalings.

    The marks it puts on tensors last until :meth:`forget` (the end of the watched call): no tensor the model returns
    keeps them, nor the activations they refer to.
    """

    def __init__(self) -> None:
        self._marked: list[weakref.ref] = []

    def _mark(self, result: Any, terms: Terms) -> None:
        """Mark ``result`` with the first few ``terms`` (a chain of differences keeps a short list), but itself (in
        place: no tensor that refers to itself)."""
        terms = [term for term in terms if term[0] is not result][:_MOST_TERMS]
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

    def note(self, func: Any, args: tuple, result: Any, kwargs: dict | None = None) -> str | None:
        """Mark ``result`` with the terms it holds; :data:`STRAIGHT_THROUGH` or :data:`GRADIENT_SCALING` where the
        call is such a sum, else ``None``. A write in place whose result is not marked anew (``y.relu_()``,
        ``y.mul_(g)``) takes the written tensor's marks off: they hold what it was before the write."""
        written = args[0] if func in WRITES_IN_PLACE and args and isinstance(args[0], torch.Tensor) else None
        marks = getattr(written, _TERMS, None)
        kind = self._note(func, args, result, kwargs)
        if marks is not None and getattr(written, _TERMS, None) is marks:
            written.__dict__.pop(_TERMS, None)
        return kind

    def _note(self, func: Any, args: tuple, result: Any, kwargs: dict | None) -> str | None:
        if func in _COPIES and args and set(kwargs or ()) <= {"memory_format"}:
            self._mark(result, _terms(args[0]))
            return None
        if func not in _WATCHED or not args or kwargs:  # ``alpha=``: another sum, not followed
            return None
        if func in _DETACHES:
            self._mark(result, _scaled(_terms(args[0]), 1.0, 0.0))
            return None
        if func in _NEGATIONS:
            self._mark(result, _scaled(_terms(args[0]), -1.0))
            return None
        if len(args) != 2:
            return None
        a, b = args
        if func in _PRODUCTS or func in _DIVISIONS:
            number, other = (_number(b), a) if func in _DIVISIONS or _number(b) is not None else (_number(a), b)
            if number is not None and (func in _PRODUCTS or number != 0.0):
                self._mark(result, _scaled(_terms(other), number if func in _PRODUCTS else 1.0 / number))
            return None
        terms = _terms(a) + (_scaled(_terms(b), -1.0) if func in _SUBTRACTIONS else _terms(b))
        if not isinstance(result, torch.Tensor) or not result.requires_grad:
            self._mark(result, terms)
            return None
        kind = _kind(terms)
        if kind is None:
            self._mark(result, terms)
        return kind
