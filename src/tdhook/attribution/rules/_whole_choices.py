"""A ``where`` of two activations that takes one of them in every element: marked as that one is.

``torch.where(c, g, h)`` of a gate ``g`` and another activation ``h`` is a gate where it took ``g``'s elements (see
:mod:`~tdhook.attribution.rules._chosen_gates`). A condition that takes ``g`` in every element (a padding mask or a
done mask with nothing masked) left a result with no gate, in any element: a product with it shared its relevance with
the gate (1.05 off, relative L2, float64, under AttnLRP and CP-LRP, 0.20 under EpsilonPlus, against the same model
with the gate multiplied apart). One that takes ``h`` in every element, ``h`` a sigmoid and ``g`` a gate of another
kind (``torch.where(c, tanh(a), sigmoid(a))``), left the result marked a gate of the other kind, which AttnLRP does
not hold. :func:`keep_whole_choice` marks the result as the piece it took is: a gate of its kind, weights, or a gate
(or weights) in the elements that piece shows them.

Which elements of such a choice are gates follows the condition's values, which a wrapper's later calls do not
follow: a plan recorded on a call that took the gate everywhere (or nowhere) would replay its rules on a call that
takes it in some elements only (see :mod:`~tdhook.attribution._function_rule_plan`), and a first call that held no
gate would leave later calls without the gates' mode (see :mod:`~tdhook.attribution._function_gates`).
:func:`choice_follows_values` tells such a call, for the recording call to keep the mode for later calls.
"""

from __future__ import annotations

from typing import Any

import torch

from tdhook.attribution.rules._filled_gates import filled_pieces
from tdhook.attribution.rules._in_place_writes import GATE_MARKS, gate_marks_of
from tdhook.attribution.rules._joined_weights import WEIGHTS_MARK, keep_weights_elements, weights_shown
from tdhook.attribution.rules._kept_gate_elements import keep_gate_elements
from tdhook.attribution.rules._mixed_gate_products import gate_elements

__all__ = ["choice_follows_values", "keep_whole_choice"]

_GATE, _SIGMOID = GATE_MARKS


def keep_whole_choice(condition: torch.Tensor, pieces: tuple, result: torch.Tensor) -> bool:
    """Where ``condition`` takes one of ``pieces`` in every element of ``result`` (``torch.where(condition,
    *pieces)``), mark ``result`` as that piece is marked (a gate of its kind, weights, or a gate or weights in the
    elements it shows them) and say so; ``False`` where it takes each in some elements (or cannot be read).

    Examples:
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> gate, other = torch.sigmoid(x * 1), x * 2
        >>> gate.__dict__.update(_tdhook_activation_of=x, _tdhook_sigmoid_gate=True)
        >>> chosen = torch.where(torch.ones(3, dtype=torch.bool), gate, other)
        >>> keep_whole_choice(torch.ones(3, dtype=torch.bool), (gate, other), chosen), gate_marks_of(chosen) != {}
        (True, True)
        >>> keep_whole_choice(torch.tensor([True, False, True]), (gate, other), chosen)
        False
    """
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        try:
            taken = condition.to(dtype=torch.bool)
            piece = pieces[0] if bool(taken.all()) else pieces[1] if not bool(taken.any()) else None
        except (RuntimeError, NotImplementedError):  # a condition with no values to read (the meta device)
            return False
        if piece is None:
            return False
        for mark in (*GATE_MARKS, WEIGHTS_MARK):  # (as a join of the two marked it: see keep_gate_mark)
            result.__dict__.pop(mark, None)
        result.__dict__.update(gate_marks_of(piece))
        if getattr(piece, WEIGHTS_MARK, False):
            setattr(result, WEIGHTS_MARK, True)
        spread = _spread_to(result.shape)
        keep_gate_elements(piece, result, spread)  # (a gate in some elements only: those, spread as the values are)
        keep_weights_elements(piece, result, spread)
    return True


def choice_follows_values(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)``, a ``where`` call, chooses between two activations of different kinds (a
    gate and no gate, gates of two kinds, weights and others, or one that is a gate or weights in some elements
    only): which elements of its result are gates then follows the condition's values.

    Examples:
        >>> x = torch.ones(3, requires_grad=True)
        >>> gate, other, c = torch.sigmoid(x * 1), x * 2, torch.tensor([True, False, True])
        >>> gate.__dict__.update(_tdhook_activation_of=x, _tdhook_sigmoid_gate=True)
        >>> choice_follows_values(torch.where, (c, gate, other), {})
        True
        >>> choice_follows_values(torch.where, (c, gate, 0.0), {})  # a gate still, whatever it takes
        False
        >>> choice_follows_values(torch.where, (c, x * 3, other), {})  # two activations no gate
        False
    """
    pieces = filled_pieces(func, args, kwargs)
    if pieces is None or len(pieces) != 2:  # (a constant beside the piece: a gate with it, whatever it takes)
        return False
    kinds = [_kind(piece) for piece in pieces]
    return kinds[0] is None or kinds[0] != kinds[1]


def _kind(piece: torch.Tensor) -> tuple[bool, bool, bool] | None:
    """What ``piece`` is in every element: a gate, a sigmoid-like one, weights; ``None`` where it is a gate or
    weights in some elements only."""
    if gate_elements(piece) is not None or weights_shown(piece) is not None:
        return None
    marks = gate_marks_of(piece)
    return _GATE in marks, bool(marks.get(_SIGMOID, False)), bool(getattr(piece, WEIGHTS_MARK, False))


def _spread_to(shape: torch.Size) -> Any:
    """The mask of a piece's shape spread over ``shape``, as ``where`` broadcasts the piece's values."""
    return lambda mask: mask.expand(shape).clone()
