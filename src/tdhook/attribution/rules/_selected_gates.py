"""Elements of a gate, or of a softmax's weights, selected by index or by mask: a gate, or weights, still.

A call that picks elements of a tensor into a new one (``g.repeat_interleave(2, -1)``, ``g.gather(-1, idx)``,
``g.index_select(1, idx)``, ``torch.take_along_dim(g, idx, -1)``, ``g.masked_select(m)``, ``g.take(idx)``) gives
values that are each a value of its input: a sigmoid-like gate's, in ``[0, 1]``; a softmax's weights'. Grouped-query
attention repeats its keys', values' or weights' heads (``repeat_interleave``), a mixture of experts picks the
routing weights of its top-k experts (``probs.gather(-1, topk_idx)``), a pointer network its attention's weights.
The selection was no gate: a product with it shared its relevance with the gate or the weights (0.52-1.2 off,
relative L2, under AttnLRP and CP-LRP, 0.22-0.31 under EpsilonPlus, for a sigmoid's gate; a softmax's weights
0.32-0.54 under AttnLRP; against the same products taken before the selection). :data:`SELECTIONS` joins the calls
through which a gate's mark is kept (see :func:`~tdhook.attribution.rules.gates.keep_gate_mark`); a join of gates
(or weights) and other activations keeps the elements it shows, the same selection made on their mask.

Windows of a gate's elements (``g.unfold(1, 2, 1)``, a view; ``F.unfold(g, 2, padding=1)``, copies and the zeros
padded with, constants that count as gates) are a gate too (they were none: 0.84-1.1 off, relative L2, under AttnLRP
and CP-LRP, 0.09-0.18 under EpsilonPlus; weights 0.35-0.52 under AttnLRP; a join of a gate and an activation through
``F.unfold`` 6.5 off under AttnLRP). :func:`on_mask` makes the call on a mask, for a join's elements.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tdhook.attribution.rules._aten_operators import aten_operators as _aten
from tdhook.attribution.rules._constant_elements import keep_constant_elements
from tdhook.attribution.rules._in_place_writes import _root_of
from tdhook.attribution.rules._joined_weights import keep_weights_elements
from tdhook.attribution.rules._kept_gate_elements import keep_gate_elements

__all__ = ["SELECTIONS", "keep_selected_elements", "on_mask"]

_NAMES = ("repeat_interleave", "gather", "index_select", "take_along_dim", "masked_select", "take")
_ATEN_NAMES = (*_NAMES, "index")


#: The calls that select elements of their first argument into a new tensor, through ``torch``, ``torch.Tensor``
#: and ``torch.ops.aten`` (``aten.index``: an advanced index, ``g[idx]``).
SELECTIONS = frozenset(
    {getattr(torch, name) for name in _NAMES} | {getattr(torch.Tensor, name) for name in _NAMES} | _aten(*_ATEN_NAMES)
)
# Windows of the elements: ``g.unfold(1, 2, 1)``, ``F.unfold(g, 2)`` (with the zeros padded with).
SELECTIONS |= {torch.Tensor.unfold, F.unfold} | _aten("unfold", "im2col")
_PADDED_WINDOWS = frozenset({F.unfold}) | _aten("im2col")


def on_mask(func: Any, args: tuple, kwargs: dict) -> Callable[[torch.Tensor], torch.Tensor]:
    """The call ``func(*args, **kwargs)`` (one of :data:`SELECTIONS`, or another that rearranges ``args[0]``'s
    values) made on a mask of ``args[0]``'s shape instead, true where the mask is or a constant is padded with.

    Examples:
        >>> made = on_mask(F.unfold, (torch.ones(1, 1, 1, 2), (1, 2)), {"padding": (0, 1)})
        >>> made(torch.tensor([[[[True, False]]]])).tolist()  # windows of 2 over [0, True, False, 0], 0 a constant
        [[[True, True, False], [True, False, True]]]
    """
    if func in _PADDED_WINDOWS:  # (no such call on booleans: the complement, padded with zeros, in floats)
        return lambda mask: func((~mask).to(torch.float32), *args[1:], **kwargs) < 0.5
    return lambda mask: func(mask, *args[1:], **kwargs)


def keep_selected_elements(func: Any, args: tuple, kwargs: dict, result: torch.Tensor) -> None:
    """Note, where ``result`` (``func(*args, **kwargs)``, one of :data:`SELECTIONS`) is a view of a new tensor
    (``m.repeat_interleave(2, 1)``: a view of a copy of ``m``'s values), on that tensor the elements ``result`` shows
    that ``args[0]`` shows as gates (or weights, or constants) in some elements only: the same selection made on
    their mask. (A selection that is no view is noted as any rearranged copy is, see
    :func:`~tdhook.attribution.rules.gates.keep_gate_mark`.)

    Examples:
        >>> from tdhook.attribution.rules._joined_gates import mark_joined_gate
        >>> from tdhook.attribution.rules._mixed_gate_products import gate_elements
        >>> x = torch.ones(1, 2, requires_grad=True)
        >>> pieces = [torch.sigmoid(x[:, :1] * 1), x[:, 1:] * 2]  # a gate beside an activation
        >>> pieces[0].__dict__.update(_tdhook_activation_of=x, _tdhook_sigmoid_gate=True)
        >>> mixed = torch.cat(pieces, 1)
        >>> mark_joined_gate(torch.cat, (pieces, 1), {}, mixed)
        >>> repeated = mixed.repeat_interleave(2, 1)
        >>> keep_selected_elements(torch.Tensor.repeat_interleave, (mixed, 2, 1), {}, repeated)
        >>> gate_elements(repeated)[0].tolist()
        [[True, True, False, False]]
    """
    root = result._base
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if root is None or source is None or root is _root_of(source):
        return  # (no view, or a view of ``args[0]``'s tensor: it reads its note)

    def onto_root(mask: torch.Tensor) -> torch.Tensor:
        selected = on_mask(func, args, kwargs)(mask)
        whole = torch.zeros_like(root, dtype=torch.bool)
        offset = result.storage_offset() - root.storage_offset()
        whole.as_strided(result.shape, result.stride(), offset).copy_(selected)
        return whole

    keep_gate_elements(args[0], root, onto_root)
    keep_weights_elements(args[0], root, onto_root)
    keep_constant_elements(args[0], root, onto_root)  # (constants beside an activation, as a copy keeps them)
