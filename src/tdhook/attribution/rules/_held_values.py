"""Values computed from the factors that products hold, and from constants alone: held in products as well.

An element-wise product holds a softmax's weights (AttnLRP, CP-LRP) and a gate (sigmoid-like under AttnLRP; any
under CP-LRP and the CNN presets) constant, and the other factor takes all of its relevance. A value computed from
such factors and constants alone is held as they are:

* weights negated, or shifted by a constant (``-w``, ``1 - w``, ``w + 0.5``), as weights scaled by a constant of
  either sign are (``w * -1.0``); their sums and means (``w.sum(-1, keepdim=True)``), and weights divided by them (a
  mixture's routing weights renormalised out of place, ``w / w.sum(-1, keepdim=True)``, as ``w /= ...`` keeps them),
  by a norm (``w / w.norm(p=1, dim=-1, keepdim=True)``, ``F.normalize(w, p=1)``: a statistic held constant), or by a
  sum clipped at a number (``w.sum(-1, keepdim=True).clamp(min=1e-9)``);
* the product of two factors a product holds (``w * sigmoid(g)``, ``sigmoid(a) * sigmoid(b)``, ``w * w``): weights
  where one is weights, else a gate, sigmoid-like where both are; in place too (``s.mul_(g)``, ``w.add_(0.5)``,
  ``w.neg_()``).

They were none: ``(w * s) * h`` took the uniform rule where ``w * (s * h)`` gives ``h`` all of the relevance (0.44
off, relative L2, under AttnLRP, 0.86 under CP-LRP), ``(-w) * h`` where ``(w * -1.0) * h`` holds the weights (0.61),
``(s1 * s2) * h`` where ``s1 * (s2 * h)`` holds both gates (0.61 under AttnLRP and CP-LRP, 0.51 under EpsilonPlus),
``(w / w.sum(-1, keepdim=True)) * h`` (0.39, AttnLRP; by a norm or a clipped sum 0.40-0.47).

Examples:
    >>> import torch
    >>> x = torch.ones(2, 3, requires_grad=True)
    >>> w = torch.softmax(x * 1, -1)
    >>> w.__dict__[WEIGHTS_MARK] = True
    >>> keeps_weights(torch.Tensor.__rsub__, (w, 1.0)), keeps_weights(torch.Tensor.__add__, (w, x * 2))
    (True, False)
"""

from __future__ import annotations

from typing import Any

import torch

from tdhook.attribution.rules._autograd import is_activation
from tdhook.attribution.rules._gate_writes import GATE_MASKS_MADE
from tdhook.attribution.rules._in_place_writes import GATE_MARKS, gate_marks_of
from tdhook.attribution.rules._joined_weights import WEIGHTS_MARK
from tdhook.attribution.rules._kept_constants import NEGATIONS, SUMS

__all__ = ["WEIGHTS_KEPT", "held_product_kind", "keeps_weights", "weights_kept"]

# Sums and means of a tensor's elements.
_REDUCTIONS = frozenset({torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean})
#: Calls that negate weights, add a constant to them, or sum them: weights still (see :func:`keeps_weights`).
WEIGHTS_KEPT = NEGATIONS | SUMS | _REDUCTIONS
_GATE_MARK, _SIGMOID_MARK = GATE_MARKS


def _weights(value: Any) -> bool:
    return bool(getattr(value, WEIGHTS_MARK, False))


def keeps_weights(func: Any, args: tuple, kwargs: dict | None = None) -> bool:
    """Whether ``func(*args, **kwargs)`` (one of :data:`WEIGHTS_KEPT`) computes weights from a softmax's weights and
    constants alone: ``-w``, ``w + c``, ``c - w``, ``w1 + w2``, ``w.sum(-1)`` (``input`` given by position, see
    :func:`~tdhook.attribution.rules._keyword_factors.positional_factors`)."""
    if len(args) == 1 and kwargs and "other" in kwargs:  # ``torch.add(w, other=1.0)``
        args = (args[0], kwargs["other"])
    if func in NEGATIONS or func in _REDUCTIONS:
        return bool(args) and _weights(args[0]) and (func in _REDUCTIONS or len(args) == 1)
    if len(args) != 2 or not (_weights(args[0]) or _weights(args[1])):
        return False
    return all(_weights(value) or not is_activation(value) for value in args)


def held_product_kind(args: tuple, any_gate: bool) -> tuple[str, Any] | None:
    """What the element-wise product of ``args`` is where a product holds both factors (``any_gate``: any gate, not
    the sigmoid-like ones alone): ``("weights", None)`` where one is a softmax's weights, ``("sigmoid", source)`` or
    ``("gate", source)`` where both are gates (``source``: the first one's, see
    :func:`~tdhook.attribution.rules.gates.mark_gate`); ``None`` where a factor is neither."""
    if len(args) != 2:
        return None
    kinds, sources = [], []
    for value in args:
        if _weights(value):
            kinds.append("weights")
            continue
        marks = gate_marks_of(value) if GATE_MASKS_MADE else getattr(value, "__dict__", {})
        if marks.get(_SIGMOID_MARK, False):
            kinds.append("sigmoid")
        elif any_gate and marks.get(_GATE_MARK) is not None:
            kinds.append("gate")
        else:
            return None
        sources.append(marks[_GATE_MARK])
    if "weights" in kinds:
        return "weights", None
    return ("sigmoid" if kinds == ["sigmoid", "sigmoid"] else "gate"), sources[0]


def weights_kept(args: tuple, bounds: Any, result: Any) -> Any:
    """``result``, marked a softmax's weights where ``args[0]`` is weights and ``bounds`` (of a clip) are no
    activations: weights clipped at numbers (``w.sum(-1, keepdim=True).clamp(min=1e-9)``), or divided by a statistic
    the rules hold constant (``w / w.norm(p=1, dim=-1, keepdim=True)``)."""
    if args and _weights(args[0]) and isinstance(result, torch.Tensor):
        if not any(is_activation(bound) for bound in bounds):
            result.__dict__[WEIGHTS_MARK] = True
    return result
