"""A ``where`` of two activations, one a gate (or a softmax's weights): a gate where it chose the gate's elements.

``torch.where(c, g, h)`` takes each element from ``g`` where ``c`` is true and from ``h`` elsewhere: a gate's element
(a sigmoid's, in ``[0, 1]``) where it took ``g``'s, and what ``h``'s is elsewhere, as a join of a gate and another
activation is (see :mod:`~tdhook.attribution.rules._joined_gates`). The result was no gate, in any element: a
product with it shared its gate elements' relevance with the gate (0.76-1.3 off, relative L2, under AttnLRP and
CP-LRP, 0.05-0.30 under EpsilonPlus, against the same product taken per element before the choice).
:func:`keep_chosen_elements` notes on the result, as a mask of its elements, where it is a sigmoid-like gate, a gate
of any kind (held by CP-LRP) and a softmax's weights, for the products with it to hold element by element (see
:mod:`~tdhook.attribution.rules._mixed_gate_products` and :mod:`~tdhook.attribution.rules._joined_weights`).
"""

from __future__ import annotations

from typing import Any

import torch

from tdhook.attribution.rules._gate_writes import GATE_MASKS_MADE, note_gate_written
from tdhook.attribution.rules._in_place_writes import GATE_MARKS, gate_marks_of
from tdhook.attribution.rules._joined_gates import OTHER_MASKS_MADE, note_other_gates, other_gates_shown
from tdhook.attribution.rules._joined_weights import WEIGHTS_MARK, WEIGHTS_MASKS_MADE, _note_weights, weights_shown
from tdhook.attribution.rules._mixed_gate_products import gate_elements
from tdhook.attribution.rules._storage_masks import count_mask
from tdhook.attribution.rules._whole_choices import keep_whole_choice

__all__ = ["keep_chosen_elements"]

_GATE, _SIGMOID = GATE_MARKS


def keep_chosen_elements(condition: Any, pieces: tuple, result: torch.Tensor) -> None:
    """Note on ``result``, ``torch.where(condition, *pieces)`` of two activations, the elements it took from a
    sigmoid-like gate (and from a gate of any kind, a softmax's weights), where it is one in some elements only (a
    gate in every element, or weights, is marked so as a constant written into one is: see
    :func:`~tdhook.attribution.rules.gates.keep_gate_mark`).

    Examples:
        >>> from tdhook.attribution.rules.gates import mark_gate
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> gate, other = mark_gate(torch.sigmoid(x * 1), x, sigmoid=True), x * 2
        >>> condition = torch.tensor([True, False, True])
        >>> chosen = torch.where(condition, gate, other)
        >>> keep_chosen_elements(condition, (gate, other), chosen)
        >>> gate_elements(chosen)[0].tolist()
        [[True, False, True], [True, False, True]]
    """
    first, second = pieces
    if not (GATE_MASKS_MADE or WEIGHTS_MASKS_MADE or _marked(first) or _marked(second)):
        return  # (the common path: a choice of two activations no gate, a Hugging Face mask's)
    if result._base is not None or not isinstance(condition, torch.Tensor):
        return
    if keep_whole_choice(condition, pieces, result):  # one piece taken in every element: marked as it is
        return
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        condition = condition.to(device=result.device, dtype=torch.bool)
        sigmoid = _chosen(condition, [_sigmoid_gates(p) for p in pieces], result)
        if sigmoid is not None and sigmoid[0] is not None:
            # A gate in every element, of two kinds (``torch.where(c, tanh(a), sigmoid(a))``): no gate whole, as a
            # join of the two is none (a split of it marked each piece a gate of another kind, which AttnLRP does not
            # hold: 1.2 off, relative L2), but its sigmoid-like gates noted, and its gates of any kind.
            for mark in GATE_MARKS:
                result.__dict__.pop(mark, None)
            note_gate_written(result, sigmoid[0], {_GATE: sigmoid[1], _SIGMOID: True})
            others = [_other_gates(p) for p in pieces]
            if all(isinstance(part, (bool, torch.Tensor)) for part in others):
                note_other_gates(result, _where(condition, others, result))
            else:  # (not known: a product that would hold them raises)
                note_other_gates(result, False)
        elif sigmoid is None and any(_GATE in gate_marks_of(p) for p in pieces):
            # A gate of another kind beside an activation (``torch.where(c, tanh(a), h)``): where it went, for a rule
            # that holds gates of any kind (CP-LRP), as a join of them notes it (it was no gate, in any element: 0.09
            # and 2.1 off, relative L2, times a ReLU's output, against the products taken per element).
            others = [_other_gates(p) for p in pieces]
            if all(isinstance(part, (bool, torch.Tensor)) for part in others):
                region = _where(condition, others, result)
                if bool(region.any()) and not bool(region.all()):
                    note_other_gates(result, region)
                    count_mask(result, OTHER_MASKS_MADE)
        weights = [True if WEIGHTS_MARK in p.__dict__ else weights_shown(p) for p in pieces]
        if any(part is False for part in weights):  # a join of weights written into since: not known
            _note_weights(result, False)
        elif any(part is not None for part in weights):
            region = _where(condition, [False if part is None else part for part in weights], result)
            if bool(region.any()) and not bool(region.all()):
                _note_weights(result, region)


def _marked(piece: torch.Tensor) -> bool:
    """Whether ``piece`` is marked a gate or a softmax's weights, in every element."""
    return _GATE in piece.__dict__ or WEIGHTS_MARK in piece.__dict__


def _sigmoid_gates(piece: torch.Tensor) -> tuple[torch.Tensor | bool, Any]:
    """Where ``piece`` is a sigmoid-like gate (a mask, or one answer for every element), and the gate's source."""
    shown = gate_elements(piece)
    if shown is not None:
        return shown
    marks = gate_marks_of(piece)
    return bool(marks.get(_SIGMOID, False)), marks.get(_GATE)


def _other_gates(piece: torch.Tensor) -> torch.Tensor | bool | None:
    """Where ``piece`` is a gate of any kind (a mask, or one answer for every element); ``None``: not known."""
    if gate_elements(piece) is None:
        return bool(gate_marks_of(piece))
    other = other_gates_shown(piece)
    if other is None:  # (gates written in place: its sigmoid-like gates tell, as a product reads them)
        return gate_elements(piece)[0]
    return None if other is False else other


def _chosen(condition: torch.Tensor, parts: list, result: torch.Tensor) -> tuple[torch.Tensor | None, Any] | None:
    """The sigmoid-like gate elements of ``result`` from those of its two pieces (``parts``), and a gate's source;
    ``(None, ...)`` where it is a gate in every element or none (its marks tell), ``None`` where no piece is one."""
    sources = [source for (part, source) in parts if source is not None and part is not False]
    if not sources:
        return None
    region = _where(condition, [part for (part, _) in parts], result)
    if bool(region.all()) or not bool(region.any()):
        return None, sources[0]
    return region, sources[0]


def _where(condition: torch.Tensor, parts: list, result: torch.Tensor) -> torch.Tensor:
    """``torch.where(condition, *parts)`` of two masks (or answers for every element), of ``result``'s shape."""
    masks = [torch.as_tensor(part, device=result.device) for part in parts]
    return torch.where(condition, *masks).expand(result.shape).clone()
