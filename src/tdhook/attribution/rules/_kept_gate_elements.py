"""A copy or a positive scaling of a tensor that is a gate in some of its elements only: its gate elements kept.

A join of sigmoid-like gates and other activations (``m = torch.cat([sigmoid(a), tanh(b)], 1)``) notes where its
gates went (see :mod:`~tdhook.attribution.rules._joined_gates`), and its views read the note. A new tensor with its
values at the same places, a copy (``m.clone()``, ``m.t().contiguous()``, ``m.transpose(0, 1).clone()``, a cast) or
a scaling by a positive constant (``m * 2``, ``m / 2``, ``m * torch.tensor(2.0)``: a gate scaled so is one, see
:func:`~tdhook.attribution.rules.gates.keep_gate_mark`), or its values rearranged into a new tensor (a reshape that
copies, ``m.t().reshape(-1)``; ``flip``, ``roll``, ``repeat``, an advanced index), had no note: a product with it
took it as no gate (0.14-0.39 off, relative L2, under AttnLRP, 0.14-0.52 under CP-LRP, 0.10-0.27 under the CNN
presets, against the same product written per piece). :func:`keep_gate_elements` notes the same elements on it, and
where the join's gates of another kind are. (A negation or a negative scaling keeps none, as a gate's mark.)

A call that writes constants over the elements that were no gate (``torch.where(c, g, h).masked_fill(~c, 0.0)``, a
gate taken in some rows, the others filled) leaves a gate in every element, which a mask true everywhere does not
tell (such a mask is read as no note, the tensor's own marks telling): the result was taken as no gate (0.40-1.04
off, relative L2, float64, under AttnLRP and CP-LRP, 0.076-0.20 under EpsilonPlus). It is marked a gate whole.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tdhook.attribution.rules._gate_writes import GATE_MASKS_MADE, note_gate_written
from tdhook.attribution.rules._in_place_writes import GATE_MARKS
from tdhook.attribution.rules._joined_gates import OTHER_MASKS_MADE, note_other_gates, other_gates_shown
from tdhook.attribution.rules._mixed_gate_products import gate_elements
from tdhook.attribution.rules._storage_masks import count_mask, rearranged_mask

__all__ = ["keep_gate_elements"]

_GATE, _SIGMOID = GATE_MARKS


def keep_gate_elements(
    source: torch.Tensor, result: torch.Tensor, rearranged: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> None:
    """Note on ``result``, a new tensor whose elements are ``source``'s at the same places (a copy, a positive
    scaling), the gate elements ``source`` shows where it is a sigmoid-like gate in some of its elements only (see
    :func:`~tdhook.attribution.rules._mixed_gate_products.gate_elements`), and where it is a gate of any kind;
    ``rearranged``: the call that made ``result`` from ``source`` (``m.t().reshape(-1)``, ``m.flip(1)``), made on a
    mask of ``source``'s shape instead (``None``: the same places).

    Examples:
        >>> from tdhook.attribution.rules._joined_gates import mark_joined_gate
        >>> x = torch.ones(2, 2, requires_grad=True)
        >>> pieces = [torch.sigmoid(x * 1), x * 2]  # a gate beside an activation
        >>> pieces[0].__dict__.update(_tdhook_activation_of=x, _tdhook_sigmoid_gate=True)
        >>> mixed = torch.cat(pieces, 1)
        >>> mark_joined_gate(torch.cat, (pieces, 1), {}, mixed)
        >>> copy = mixed.t().contiguous()
        >>> keep_gate_elements(mixed.t(), copy)
        >>> gate_elements(copy)[0].tolist()
        [[True, True], [True, True], [False, False], [False, False]]
    """
    if result is source or result._base is not None:  # (a view reads its tensor's note)
        return
    shown = gate_elements(source) if GATE_MASKS_MADE else None
    if shown is None:  # (gates of another kind alone in part, ``c[:, :2] = tanh(a)``: where they are)
        if OTHER_MASKS_MADE or GATE_MASKS_MADE:  # (a join's mask of them is counted only where no gate tells)
            _keep_other_gates(source, result, rearranged)
        return
    other = other_gates_shown(source)
    region = shown[0]
    if rearranged is not None:
        with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
            try:
                region = rearranged(region)
                other = rearranged(other) if isinstance(other, torch.Tensor) else other
            except (RuntimeError, TypeError, NotImplementedError):  # a call a mask cannot take: nothing noted
                return
    if not isinstance(region, torch.Tensor) or region.shape != result.shape:
        return
    if _everywhere(region):  # a gate's or a constant's values in every element: a gate whole, as its marks tell
        result.__dict__.update({_GATE: shown[1], _SIGMOID: True})
        return
    note_gate_written(result, region, {_GATE: shown[1], _SIGMOID: True})
    if other is not None:  # (``False``: not known, as it was)
        note_other_gates(result, other)


def _keep_other_gates(
    source: torch.Tensor, result: torch.Tensor, rearranged: Callable[[torch.Tensor], torch.Tensor] | None
) -> None:
    """Note on ``result`` where ``source`` (a tensor with gates of another kind in some elements only, or a view of
    one) is a gate of any kind: a copy of it lost them (0.35-0.65 off, relative L2, under CP-LRP, against the
    products taken apart)."""
    other = other_gates_shown(source)
    if not isinstance(other, torch.Tensor):
        return
    other = rearranged_mask(other, rearranged, result.shape)
    if other is not None:  # (``None``: a call a mask cannot take, nothing noted)
        note_other_gates(result, other)
        count_mask(result, OTHER_MASKS_MADE)


def _everywhere(region: torch.Tensor) -> bool:
    """Whether the mask ``region`` is true in every element (a mask so is read as no note: the marks tell)."""
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        try:
            return bool(region.all())
        except (RuntimeError, NotImplementedError):  # a mask on the meta device: no values to read
            return False
