"""Constants filled into part of an activation out of place: where they are, for the products that take the result.

``torch.where(pad, 1.0, h)``, ``h.masked_fill(pad, 2.0)``, ``torch.where(c, w, h)`` (``w`` a weight) and
``h.where(keep, 3.0)`` make a tensor with constants in some elements and an activation in the others, as the same
values written in place do (``h.masked_fill_(pad, 2.0)``, see :mod:`~tdhook.attribution.rules._constant_elements`).
In a product, a constant element takes none of the relevance, as it does multiplied apart. The result was an
activation in every element: the uniform rule gave its constant elements half of the product's relevance, passed on
to nothing, and a sigmoid gate times it was held against a constant (0.02-0.44 off, relative L2, float64, under
AttnLRP and CP-LRP times a ReLU's output, 0.73-0.96 times a sigmoid gate; 0.12-0.81 under EpsilonPlus times a
sigmoid gate; against the products taken per element before the choice; a sigmoid-like or a tanh gate filled so
times a sigmoid gate 0.46-0.93). :func:`keep_filled_elements` notes where the constants went, as the in-place write
notes them: a mask (``CONSTANTS_JOINED`` of :mod:`~tdhook.attribution.rules._constant_elements`) and, as a join
does, the constant elements as a sigmoid-like gate's (a gate filled with constants stays a gate in its other
elements, see :mod:`~tdhook.attribution.rules._filled_gates`).

Which elements are constants follows the condition's (or the mask's) values, which a wrapper's later calls, planned
from a recording call, do not follow (see :mod:`~tdhook.attribution._function_rule_plan`): the mask is noted whatever
it holds, constants in every element or in none, for a product with the result to run in the rules' mode in every
call (a first call that filled no element planned the uniform rule for later calls that filled some: 0.18-1.0 off,
relative L2, under AttnLRP and CP-LRP). A fill of zeros (``h.masked_fill(pad, 0.0)``, ``torch.where(keep, h,
0.0)``) notes nothing: zero in a product, held or not, they take nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from tdhook.attribution.rules._chosen_gates import keep_chosen_elements
from tdhook.attribution.rules._constant_elements import (
    CACHED,
    CONSTANT_MASKS_MADE,
    CONSTANTS_JOINED,
    constants_shown,
    note_constant_gates,
)
from tdhook.attribution.rules._filled_gates import WHERES, where_arguments
from tdhook.attribution.rules._storage_masks import count_mask, laid_over_storage

__all__ = ["keep_filled_elements"]


def keep_filled_elements(func: Any, args: tuple, kwargs: dict, pieces: list, result: torch.Tensor) -> None:
    """Note on ``result``, ``func(*args, **kwargs)`` (a ``where`` or a ``masked_fill`` out of place) that keeps the
    values of the activations ``pieces`` in some elements, the elements it took from a gate (a ``where`` of two
    activations, see :mod:`~tdhook.attribution.rules._chosen_gates`) and those it filled with constants (see the
    module's docstring).

    Examples:
        >>> from tdhook.attribution.rules._mixed_gate_products import gate_elements
        >>> h = torch.ones(2, 3, requires_grad=True) * 2  # an activation
        >>> pad = torch.tensor([True, False, False])
        >>> filled = torch.where(pad, 1.0, h)
        >>> keep_filled_elements(torch.where, (pad, 1.0, h), {}, [h], filled)
        >>> constants_shown(filled).tolist(), gate_elements(filled)[0].tolist()
        ([[True, False, False], [True, False, False]], [[True, False, False], [True, False, False]])
        >>> zeros = h.masked_fill(pad, 0.0)
        >>> keep_filled_elements(torch.Tensor.masked_fill, (h, pad, 0.0), {}, [h], zeros)
        >>> constants_shown(zeros) is None
        True
    """
    if len(pieces) == 2:  # ``torch.where(c, g, h)``: a gate where it took g's elements
        keep_chosen_elements(where_arguments(func, args, kwargs)[0], tuple(pieces), result)
    if result._base is not None or CACHED in result.__dict__:
        return
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        try:
            region, value = _constants_region(func, args, kwargs, pieces)
            if region is None:
                return
            region = region.expand(result.shape)
        except (RuntimeError, NotImplementedError):  # a mask on the meta device: no values to read
            return
        mask = laid_over_storage(result, region)
        if mask is None:
            return
        setattr(result, CONSTANTS_JOINED, (mask, result._version))
        count_mask(result, CONSTANT_MASKS_MADE)
    note_constant_gates(result, region, value)


def _constants_region(func: Any, args: tuple, kwargs: dict, pieces: list) -> tuple[torch.Tensor | None, Any]:
    """Where the result of ``func(*args, **kwargs)`` holds a constant (a mask that broadcasts to its shape; ``None``
    where it holds none that counts), and a constant it holds (for the gate's marks)."""
    if func in WHERES:
        condition, first, second = where_arguments(func, args, kwargs)
        flags = [_constants_of(first, pieces), _constants_of(second, pieces)]
        if flags[0] is False and flags[1] is False:
            return None, None
        constant = second if flags[1] is True else first
        return torch.where(condition.to(torch.bool), *flags), constant
    value = args[2] if len(args) > 2 else kwargs.get("value")
    mask = args[1] if len(args) > 1 else kwargs["mask"]
    if isinstance(value, (int, float)) and value == 0:  # zeros: nothing to note
        return None, None
    shown = constants_shown(pieces[0])
    before = torch.zeros((), dtype=torch.bool, device=mask.device) if shown is None else shown
    return torch.where(mask.to(torch.bool), True, before), value


def _constants_of(piece: Any, pieces: list) -> torch.Tensor | bool:
    """Where ``piece``, one of a ``where``'s two, is a constant: ``True`` for a constant (a number but 0, a tensor
    no gradient reaches, a parameter: see :func:`~tdhook.attribution.rules._filled_gates.filled_pieces`), the mask
    of its constants for an activation with constants beside it, else ``False``."""
    if not any(piece is kept for kept in pieces):
        return not (isinstance(piece, (int, float)) and piece == 0)
    shown = constants_shown(piece)
    return False if shown is None else shown
