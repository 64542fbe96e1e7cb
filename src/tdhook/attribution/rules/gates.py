"""Gates: a signal times a sigmoid-like gate keeps all of the product's relevance, and the gate gets none.

Squeeze-excite blocks (``x * sigmoid(fc(pool(x)))`` in MobileNetV3, EfficientNet,
RegNetY) and recurrent cells multiply a signal by a gate in ``[0, 1]``. Under
the plain gradient both factors receive the product's whole relevance, so
relevance is created, here by factors of 46 to 3,430 on real models. LRP for
LSTMs (Arras et al., 2017) holds the gate constant instead, "signal-take-all":
for ``z = x · gate``, ``R_x = R_z`` and ``R_gate = 0``. The same mechanism holds
CP-LRP's gates constant in :class:`~tdhook.attribution.rules.functional.FunctionalRules`.

A gate is the output of a sigmoid-like module under :class:`GateRule` or of a
sigmoid function seen by :class:`HeldGates`; it is marked, and a product of a
marked gate with an activation detaches the gate. A gated linear unit
(``F.glu``, ``nn.GLU``: ``a · sigmoid(b)`` of its input's halves) holds its gate
in the same way (see :func:`held_glu`). A sigmoid whose output is not
multiplied by an activation (a last layer, an activation in an MLP) passes
relevance on as any activation does.

The router of a mixture of experts is a gate too: its routing weights (a softmax
or sigmoid of router logits, at the top-k experts) multiply the experts'
outputs. :class:`RouterRule` holds them constant, so the relevance of the
mixture flows through the experts alone, and is conserved through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tdhook.attribution.rules._aten_operators import aten_operators as _aten
from tdhook.attribution.rules._autograd import (
    call_argument,
    hold,
    is_activation,
    mark_parameter_derived,
    raise_for_transformed_call,
)
from tdhook.attribution.rules._clips import (
    BOUNDS,
    CLIPS,
    CLIPS_IN_PLACE,
    bound_passing,
    bounded_signal,
    clip_passing,
    clips_a_signal,
    is_clipped,
)
from tdhook.attribution.rules._constant_elements import CONSTANT_MASKS_MADE, keep_constant_elements
from tdhook.attribution.rules._copied_gates import COPIES_IN_PLACE, keep_copied_marks
from tdhook.attribution.rules._filled_constants import keep_filled_elements
from tdhook.attribution.rules._filled_gates import FILLS, WHERES, filled_mask, filled_pieces
from tdhook.attribution.rules._fused_products import FUSED_PRODUCTS, fused_factors, fused_product
from tdhook.attribution.rules._gate_values import raise_for_values_outside_a_gate
from tdhook.attribution.rules._gate_writes import GATE_MASKS_MADE, GATE_WRITTEN
from tdhook.attribution.rules._held_glu import held_glu
from tdhook.attribution.rules._held_norm_calls import NORMALIZING_CALLS, HeldNormCalls, normalized_inputs
from tdhook.attribution.rules._held_values import WEIGHTS_KEPT, held_product_kind, keeps_weights
from tdhook.attribution.rules._in_place_writes import (
    WRITES_IN_PLACE,
    _root_of,
    gate_marks_of,
    mark_written_in_place,
    note_gate_views,
)
from tdhook.attribution.rules._joined_gates import GATE_JOINS, OTHER_MASKS_MADE, mark_joined_gate
from tdhook.attribution.rules._joined_weights import (
    WEIGHTS_MARK,
    WEIGHTS_MASKS_MADE,
    keep_weights_elements,
    mark_joined_weights,
)
from tdhook.attribution.rules._kept_constants import CONSTANTS_KEPT, PADS, keep_constants, padded_mask
from tdhook.attribution.rules._kept_gate_elements import keep_gate_elements
from tdhook.attribution.rules._keyword_factors import positional_factors
from tdhook.attribution.rules._layers import GATES
from tdhook.attribution.rules._means_apart import STATISTICS_AND_MEANS, mean_apart
from tdhook.attribution.rules._mixed_gate_products import mixed_gate_in_place, mixed_gate_product
from tdhook.attribution.rules._odd_unit_gates import ODD_UNIT_OFFSETS, odd_unit_offset
from tdhook.attribution.rules._recomputed import in_checkpoint, raise_for_checkpoint
from tdhook.attribution.rules._selected_gates import SELECTIONS, keep_selected_elements, on_mask
from tdhook.attribution.rules._unrecorded_writes import NOT_READ, UNRECORDED, note_out_write, read_unrecorded
from tdhook.attribution.rules._whole_choices import choice_follows_values
from tdhook.attribution.rules._written_copies import WRITES_INTO_COPIES, write_into_copy, writes_into_copy
from tdhook.attribution.rules._written_norms import WRITTEN_NORM_CALLS, statistic_place
from tdhook.attribution.rules.basic import PassRule
from tdhook.attribution.rules.routers import RouterRule, is_router, is_router_layer

__all__ = [
    "GateRule",
    "HeldGates",
    "give_back_norms_entering",
    "RouterRule",
    "is_router",
    "is_router_layer",
    "mark_gate",
    "is_gate",
    "keep_gate_mark",
    "keep_held_product_mark",
    "mark_held_kind",
    "held_gate_product",
    "held_factors",
    "held_glu",
    "ELEMENTWISE_PRODUCTS",
    "SAME_VALUES",
    "GATE_COMPLEMENTS",
    "GATE_PRESERVING",
    "GATE_RESIZES",
    "GATE_SPLITS",
    "GATE_SCALINGS",
    "GATE_MULTIPLICATIONS",
    "GATE_JOINS",
    "GATE_PADS",
    "GATE_FUNCTIONS",
    "mark_weights",
    "weighing_factors",
]

# The attribute that marks a gate, holding the tensor it was computed from (shared with PseudoIdentityRule).
GATE_MARK = "_tdhook_activation_of"
# The attribute that marks a sigmoid-like gate, a value in [0, 1]: held first where both factors are marked.
SIGMOID_MARK = "_tdhook_sigmoid_gate"
GATE_FUNCTIONS = frozenset({torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid, F.hardsigmoid})
# The sigmoid computed in place (``h.sigmoid_()``): a gate as well, held where a product takes it.
_GATES_IN_PLACE = frozenset({torch.sigmoid_, torch.Tensor.sigmoid_})
# Operations that rearrange, copy or cast values: a gate stays a gate through them.
SAME_VALUES = frozenset(
    {torch.Tensor.view, torch.Tensor.view_as, torch.Tensor.reshape, torch.reshape, torch.Tensor.expand}
    | {torch.Tensor.expand_as, torch.Tensor.unsqueeze, torch.unsqueeze, torch.Tensor.squeeze, torch.squeeze}
    | {torch.Tensor.permute, torch.permute, torch.Tensor.transpose, torch.transpose, torch.Tensor.flatten}
    | {torch.flatten, torch.Tensor.contiguous, torch.Tensor.clone, torch.Tensor.to, torch.Tensor.__getitem__}
    | {torch.Tensor.reshape_as, torch.Tensor.type_as, torch.Tensor.float, torch.Tensor.double, torch.Tensor.half}
    | {torch.Tensor.bfloat16}
)
# Transposes, reorders and other views and copies of a gate's values (``g.T * h.T``, ``g.unflatten(1, (3, 2))``,
# ``g.movedim(1, -1)``, ``g.repeat(1, 2)``, ``g.flip(1)``): a gate too (it was none: the product of a gate
# transposed with its signal got AttnLRP's uniform rule, 5.7 off, relative L2, against the product out of place).
SAME_VALUES |= {torch.Tensor.T.__get__, torch.Tensor.mT.__get__, torch.Tensor.t, torch.t, torch.Tensor.adjoint}
SAME_VALUES |= {torch.adjoint, torch.Tensor.unflatten, torch.unflatten, torch.Tensor.movedim, torch.movedim}
SAME_VALUES |= {torch.Tensor.moveaxis, torch.moveaxis, torch.Tensor.swapaxes, torch.swapaxes, torch.Tensor.swapdims}
SAME_VALUES |= {torch.swapdims, torch.Tensor.narrow, torch.narrow, torch.Tensor.select, torch.select}
SAME_VALUES |= {torch.Tensor.broadcast_to, torch.broadcast_to, torch.Tensor.repeat, torch.Tensor.tile, torch.tile}
SAME_VALUES |= {torch.Tensor.flip, torch.flip, torch.Tensor.roll, torch.roll}
# ``torch.clone(gate)``, the function: a copy, as ``gate.clone()`` (it was none: a product with it shared its relevance
# with the gate, 0.43 off, relative L2, under AttnLRP and CP-LRP, 0.33 under EpsilonPlus).
SAME_VALUES |= {torch.clone}
# ``1 - gate``: the complement of a sigmoid-like gate is one too (a GRU's ``(1 - z) * h``).
GATE_COMPLEMENTS = frozenset({torch.Tensor.__rsub__, torch.rsub})
# Resizing a gate to the signal's size (GhostNetV2's ``x * interpolate(sigmoid(s), size, mode="nearest")``) keeps
# it a gate where each output is a copy or a convex combination of the gate's values: still in [0, 1].
GATE_RESIZES = frozenset({F.interpolate})
# Splitting a gate gives gates (iFormer's ``v, gate = sigmoid(conv(x)).chunk(2, dim=1)``).
GATE_SPLITS = frozenset(
    {torch.Tensor.chunk, torch.chunk, torch.Tensor.split, torch.split, torch.Tensor.unbind, torch.unbind}
    | {torch.Tensor.tensor_split, torch.tensor_split}
)
_CONVEX_RESIZE_MODES = frozenset({"nearest", "nearest-exact", "linear", "bilinear", "trilinear", "area"})
# Dividing a gate by a positive number keeps it a gate (a hard sigmoid written out, ``relu6(s + 3) / 6``).
GATE_SCALINGS = frozenset(
    {torch.Tensor.__truediv__, torch.Tensor.div, torch.div, torch.Tensor.true_divide, torch.true_divide}
    | {torch.Tensor.divide, torch.divide}
)
# Multiplying a gate by a positive number keeps it a gate too (``2 * torch.sigmoid(s)``, ``sigmoid(s) * gain``).
GATE_MULTIPLICATIONS = frozenset(
    {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.multiply, torch.Tensor.multiply}
)


# The same operations called through ``torch.ops`` (``torch.ops.aten.view.default(gate, shape)``): a gate stays one.
SAME_VALUES |= _aten("view", "_unsafe_view", "reshape", "expand", "unsqueeze", "squeeze", "permute", "transpose", "t")
SAME_VALUES |= _aten("flatten", "clone", "_to_copy", "alias", "slice", "select", "contiguous")
SAME_VALUES |= _aten("numpy_T", "mT", "adjoint", "unflatten", "movedim", "swapaxes", "narrow", "repeat", "flip", "roll")
# Elements selected (``g.gather(-1, idx)``, ``g.repeat_interleave(2, 1)``): a gate, or weights (see _selected_gates).
SAME_VALUES |= SELECTIONS
GATE_COMPLEMENTS |= _aten("rsub")
GATE_SPLITS |= _aten("chunk", "split", "split_with_sizes", "unbind", "tensor_split")
GATE_SCALINGS |= _aten("div", "true_divide", "divide")
GATE_MULTIPLICATIONS |= _aten("mul", "multiply")
GATE_PRESERVING = SAME_VALUES | GATE_COMPLEMENTS | GATE_RESIZES | GATE_SPLITS | GATE_SCALINGS | GATE_MULTIPLICATIONS
# Copies of a tensor's values at the same places (``m.t().contiguous()``, a cast), and (with a positive constant)
# its scalings, and (the others of SAME_VALUES, where they copy) its values rearranged: a gate in some elements only
# keeps those (see :mod:`~tdhook.attribution.rules._kept_gate_elements`).
_COPIES = frozenset({torch.Tensor.contiguous, torch.Tensor.clone, torch.clone, torch.Tensor.to, torch.Tensor.type_as})
_COPIES |= {torch.Tensor.float, torch.Tensor.double, torch.Tensor.half, torch.Tensor.bfloat16}
_COPIES |= _aten("clone", "_to_copy", "contiguous")
_ELEMENTS_KEPT = _COPIES | GATE_SCALINGS | GATE_MULTIPLICATIONS | SAME_VALUES
# Gates joined (``torch.cat([sigmoid(a), sigmoid(b)], 1)``, ``torch.stack``): a gate where every piece is one (see
# :mod:`~tdhook.attribution.rules._joined_gates`).
GATE_PRESERVING |= GATE_JOINS
# A gate padded (``F.pad(g, (0, 1), value=1.0)``: a gate of 1 for a unit, as ``torch.cat([g, ones], 1)``; reflected,
# replicated or circular padding copies its values): a gate, of its kind. (It was none: the product's relevance was
# shared with the gate, 1.3-7.0 off, relative L2, under AttnLRP and CP-LRP, 0.16-0.27 under the CNN presets.)
GATE_PADS = PADS
GATE_PRESERVING |= GATE_PADS
# Constants written into a gate (``g.masked_fill(pad, 0.0)``, ``torch.where(keep, g, 0.0)``): see _filled_gates.
GATE_PRESERVING |= FILLS | COPIES_IN_PLACE  # and the values of a gate or weights copied in place (_copied_gates)
# The values a sort or a selection of the largest picks (``torch.topk(w, 2).values``, a mixture's routing weights): a
# gate's or weights' values, as what they pick from is (the weights were none: 0.50-0.72 off, relative L2, AttnLRP).
SORTED_SELECTIONS = frozenset(
    {torch.topk, torch.Tensor.topk, torch.sort, torch.Tensor.sort, torch.kthvalue, torch.Tensor.kthvalue}
    | {torch.max, torch.Tensor.max, torch.min, torch.Tensor.min, torch.median, torch.Tensor.median}
)
GATE_PRESERVING |= SORTED_SELECTIONS
_WEIGHTS_SCALINGS = GATE_SCALINGS | GATE_MULTIPLICATIONS  # (weights scaled by a constant of either sign: weights)
ELEMENTWISE_PRODUCTS = frozenset({torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__})
ELEMENTWISE_PRODUCTS |= {torch.multiply, torch.Tensor.multiply}  # aliases of ``mul``
# A signal multiplied by a gate in place (``h.mul_(g)``, ``h *= g``): the gate is held, as in ``h * g``.
_PRODUCTS_IN_PLACE = frozenset({torch.Tensor.mul_, torch.Tensor.__imul__})
# The calls the gates' mode reads by position: products, gates, clips and bounds (see ``GateRules.__torch_function__``).
_GATES_AND_CLIPS = ELEMENTWISE_PRODUCTS | GATE_FUNCTIONS | CLIPS | set(CLIPS_IN_PLACE) | BOUNDS | {F.glu}
_GATES_AND_CLIPS |= WRITTEN_NORM_CALLS


def mark_gate(tensor: torch.Tensor, source: torch.Tensor, sigmoid: bool = False) -> torch.Tensor:
    """Mark ``tensor`` as a gate computed from ``source`` (``sigmoid``: by a sigmoid-like function), and return it.

    Examples:
        >>> x = torch.ones(2, requires_grad=True) * 1
        >>> is_gate(mark_gate(torch.sigmoid(x), x)), is_gate(x)
        (True, False)
    """
    setattr(tensor, GATE_MARK, source)
    if sigmoid:
        setattr(tensor, SIGMOID_MARK, True)
    base = tensor._base
    # A view of a tensor written into, or a gate made in a view of a tensor that is none (``c[:, :3].sigmoid_()``):
    # its elements a gate now, noted on the tensor, whose later writes (``c[:, 3:] = g``) would else make the mask
    # without them (a view of a gate, its tensor a gate with no mask, needs none: the tensor's marks tell then).
    # (Not a view that shows a gate its tensor is marked as whole, a tanh filled with constants: its mask tells.)
    own = base.__dict__ if base is not None else {}
    inherited = own.get(GATE_MARK) is source and bool(own.get(SIGMOID_MARK, False)) is sigmoid
    if base is not None and not inherited and ((GATE_MASKS_MADE and GATE_WRITTEN in own) or GATE_MARK not in own):
        note_gate_views(tensor, None, {GATE_MARK: source, SIGMOID_MARK: True} if sigmoid else {GATE_MARK: source})
    return tensor


def _mark(value: Any, name: str, default: Any = None) -> Any:
    """The gate mark ``name`` of ``value``: for a view of a tensor an in-place write changed the gate elements of,
    that of what it shows now (see :func:`~tdhook.attribution.rules._in_place_writes.gate_marks_of`)."""
    if GATE_MASKS_MADE:
        return gate_marks_of(value).get(name, default)
    return getattr(value, name, default)


def is_gate(value: Any) -> bool:
    """Whether ``value`` is a tensor marked as a gate (see :func:`mark_gate`); a view of a tensor written into in
    place, whether every element it shows is a gate now."""
    if GATE_MASKS_MADE:  # (no function call on the common path, where no in-place write changed a gate)
        return _mark(value, GATE_MARK) is not None
    return getattr(value, GATE_MARK, None) is not None


def keep_gate_mark(func: Any, args: tuple, result: Any, kwargs: dict | None = None) -> Any:
    """``result`` marked as its input was, where ``func`` only rearranges, copies or casts values (a view, a reshape,
    an ``expand_as``: ECA and squeeze-excite reshape their gate before the product), or resizes them by copies
    or convex combinations (``F.interpolate`` but bicubic: GhostNetV2 upsamples its gate to the signal's size), or
    pads them (``F.pad``: constants, or copies of its values);
    each piece of a gate split in pieces (``chunk``, ``split``, ``unbind``) marked as it was; gates joined
    (``torch.cat``, ``torch.stack``, ``hstack``, ...) a gate, where every piece is one (see
    :func:`~tdhook.attribution.rules._joined_gates.mark_joined_gate`); a softmax's weights joined, weights (see
    :func:`~tdhook.attribution.rules._joined_weights.mark_joined_weights`).

    Examples:
        >>> x = torch.ones(2, requires_grad=True) * 1
        >>> gate = mark_gate(torch.sigmoid(x), x, sigmoid=True)
        >>> is_gate(keep_gate_mark(torch.Tensor.view, (gate, 2, 1), gate.view(2, 1)))
        True
    """
    if kwargs and not args and func not in WHERES:  # ``torch.gather(input=g, dim=1, index=i)``: its input by position
        args, kwargs = positional_factors(func, args, kwargs)
    if func in GATE_JOINS:  # (first: a join of no gate, rotary embeddings' ``cat``, costs one call more)
        mark_joined_gate(func, args, kwargs or {}, result)
        if WEIGHTS_MASKS_MADE:  # (a piece may show weights in part: a view of a join of weights and others)
            mark_joined_weights(func, args, kwargs or {}, result)
            return result
        for piece in args[0] if args else (kwargs or {})["tensors"]:  # (tensors all: the join ran)
            if WEIGHTS_MARK in piece.__dict__:  # a softmax's weights joined (attention written per head)
                mark_joined_weights(func, args, kwargs or {}, result)
                break
        return result
    same_values = func in SAME_VALUES or (func in GATE_RESIZES and _convex_resize(args, kwargs or {}))
    if (same_values or func in GATE_PADS) and args and is_gate(args[0]) and isinstance(result, torch.Tensor):
        if func in SELECTIONS and result._base is not None and result._base is not _root_of(args[0]):
            # ``g.repeat_interleave(2, 1)``: a view of a copy of g's (not ``m[:, :3].unfold(1, 2, 1)``, a view of the
            # tensor ``m`` itself: a join whose other elements are none, marked a gate whole, 0.046 off)
            mark_gate(result._base, _mark(args[0], GATE_MARK), sigmoid=_mark(args[0], SIGMOID_MARK, False))
        mark_gate(result, _mark(args[0], GATE_MARK), sigmoid=_mark(args[0], SIGMOID_MARK, False))
    elif func in GATE_SPLITS and args and is_gate(args[0]) and isinstance(result, (tuple, list)):
        for piece in result:
            if isinstance(piece, torch.Tensor):
                mark_gate(piece, _mark(args[0], GATE_MARK), sigmoid=_mark(args[0], SIGMOID_MARK, False))
    elif func in GATE_COMPLEMENTS and len(args) == 2 and _is_one(args[1]) and _mark(args[0], SIGMOID_MARK, False):
        if isinstance(result, torch.Tensor):  # 1 - sigmoid(s) = sigmoid(-s): a gate in [0, 1] as well
            mark_gate(result, _mark(args[0], GATE_MARK), sigmoid=True)
    elif func in ODD_UNIT_OFFSETS and (odd := odd_unit_offset(func, args, kwargs or {})) is not None:
        if isinstance(result, torch.Tensor):  # 1 + tanh(z) = 2 sigmoid(2z), 1 + erf(z) = 2 Phi(z √2): a gate
            source = _mark(odd, GATE_MARK)
            mark_gate(result, odd if source is None else source, sigmoid=True)
    elif func in GATE_SCALINGS and len(args) == 2 and is_gate(args[0]) and _is_positive(args[1]):
        if isinstance(result, torch.Tensor):  # relu6(s + 3) / 6: a gate divided by a positive number
            mark_gate(result, _mark(args[0], GATE_MARK), sigmoid=_mark(args[0], SIGMOID_MARK, False))
    elif func in GATE_MULTIPLICATIONS and len(args) == 2 and isinstance(result, torch.Tensor):
        gate, factor = args if is_gate(args[0]) else args[::-1]
        # 2 * sigmoid(s); a gate times a constant softmax's weights (CP-LRP's): a gate in [0, 1] scaled
        constant = _is_positive_constant(factor) or (getattr(factor, WEIGHTS_MARK, False) and not is_activation(factor))
        if is_gate(gate) and not is_gate(factor) and constant:
            mark_gate(result, _mark(gate, GATE_MARK), sigmoid=_mark(gate, SIGMOID_MARK, False))
            if getattr(factor, WEIGHTS_MARK, False):  # (and weights, as under AttnLRP: ``-(w * s)`` is weights too)
                mark_weights(result)
        elif is_activation(factor) and is_activation(gate):  # two gates (the gates' mode, which holds any)
            keep_held_product_mark(args, result, any_gate=True)
    elif func in FILLS and isinstance(result, torch.Tensor) and (filled := filled_pieces(func, args, kwargs or {})):
        _keep_filled_marks(filled, result, filled_mask(func, args, kwargs or {}, filled[0]))
        keep_filled_elements(func, args, kwargs or {}, filled, result)  # gates chosen, constants filled in
    masks = GATE_MASKS_MADE or CONSTANT_MASKS_MADE or OTHER_MASKS_MADE
    if masks and func in _ELEMENTS_KEPT and isinstance(result, torch.Tensor) and result._base is None:
        # A copy or a positive scaling of a gate, or of constants, in some elements only (``m.t().contiguous()``,
        # ``m * 2``), or its values rearranged into a new tensor (``m.t().reshape(-1)``, ``m.flip(1)``): those kept.
        source = _scaled_or_copied(func, args)
        if source is not None:
            keep_gate_elements(source, result)
            keep_constant_elements(source, result)
        elif func in SAME_VALUES and args and isinstance(args[0], torch.Tensor):
            rearranged = on_mask(func, args, kwargs or {})
            keep_gate_elements(args[0], result, rearranged)
            keep_constant_elements(args[0], result, rearranged)
    if WEIGHTS_MASKS_MADE and func in SAME_VALUES and isinstance(result, torch.Tensor) and result._base is None:
        # A copy of weights in some elements only (``mixed.t().contiguous()``, ``mixed.flip(1)``): those kept.
        if args and isinstance(args[0], torch.Tensor):
            rearranged = None if func in _COPIES else on_mask(func, args, kwargs or {})
            keep_weights_elements(args[0], result, rearranged)
    if func in COPIES_IN_PLACE:  # ``torch.empty_like(m).copy_(m)``: marked as what is copied
        keep_copied_marks(args, result)
    if func in SELECTIONS and (masks or WEIGHTS_MASKS_MADE) and isinstance(result, torch.Tensor):
        keep_selected_elements(func, args, kwargs or {}, result)  # a selection that views a copy (repeat_interleave)
    if func in GATE_PADS and (GATE_MASKS_MADE or WEIGHTS_MASKS_MADE) and args and isinstance(result, torch.Tensor):
        # A gate or weights in some elements only padded (``F.pad(m, (1, 1))``): those kept, and the constants
        # padded with, as a join's (they were lost: 0.20 off, relative L2, under AttnLRP, 0.44 under CP-LRP).
        if isinstance(args[0], torch.Tensor):
            keep_gate_elements(args[0], result, padded_mask(func, args, kwargs or {}))
            keep_weights_elements(args[0], result, padded_mask(func, args, kwargs or {}))
    if func in CONSTANTS_KEPT:  # constants beside an activation padded, negated, shifted: kept (_kept_constants)
        keep_constants(func, args, kwargs or {}, result)
    if func in _WEIGHTS_SCALINGS and len(args) == 2 and isinstance(result, torch.Tensor):
        weights, factor = args if getattr(args[0], WEIGHTS_MARK, False) else args[::-1]
        # ``w * 2.5``; ``w / w.sum(-1, keepdim=True)``, a sum of weights (see _held_values), not ``w / h``
        if getattr(weights, WEIGHTS_MARK, False) and (
            not is_activation(factor) or getattr(factor, WEIGHTS_MARK, False)
        ):
            mark_weights(result)  # (a softmax's weights scaled: weights still; they were none, 1.05 off under AttnLRP)
        elif WEIGHTS_MASKS_MADE and result._base is None:  # weights in part, scaled: those kept
            for value, other in ((args[0], args[1]), (args[1], args[0])):
                if isinstance(value, torch.Tensor) and not is_activation(other):
                    keep_weights_elements(value, result)
    if func in WEIGHTS_KEPT and isinstance(result, torch.Tensor) and keeps_weights(func, args, kwargs):
        mark_weights(result)  # ``-w``, ``1 - w``, ``w.sum(-1)``: weights, as ``w * -1.0`` is (see _held_values)
    if func in SORTED_SELECTIONS and args and isinstance(result, tuple) and isinstance(result[0], torch.Tensor):
        keep_selected_marks(args[0], result[0])  # ``torch.topk(w, k).values``: weights, or a gate, as ``w`` is
    if args and getattr(args[0], WEIGHTS_MARK, False) and (same_values or func in GATE_SPLITS or func in GATE_PADS):
        # (weights padded, ``F.pad(w, (1, 1))``: its constants held as the weights are, a constant takes none)
        for piece in result if isinstance(result, (tuple, list)) else (result,):  # a softmax's weights, reshaped
            if isinstance(piece, torch.Tensor):
                mark_weights(piece)
    return result


def keep_selected_marks(source: Any, values: torch.Tensor) -> None:
    """Mark ``values``, picked from ``source`` by a sort or a selection of the largest (see :data:`SORTED_SELECTIONS`),
    as ``source`` is marked in every element: a gate, of its kind; a softmax's weights.

    Examples:
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> values = torch.topk(mark_weights(torch.softmax(x * 1, -1)), 2).values
        >>> keep_selected_marks(mark_weights(torch.softmax(x * 1, -1)), values)
        >>> bool(getattr(values, WEIGHTS_MARK, False))
        True
    """
    if is_gate(source):
        mark_gate(values, _mark(source, GATE_MARK), sigmoid=_mark(source, SIGMOID_MARK, False))
    if getattr(source, WEIGHTS_MARK, False):
        mark_weights(values)


def _keep_filled_marks(filled: list, result: torch.Tensor, made: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Mark ``result``, the tensors ``filled`` with constants written into some elements, as they are all marked (a
    gate, weights); where one alone is a gate or weights in some elements only, those kept (see _filled_gates)."""
    if all(is_gate(piece) for piece in filled):
        mark_gate(result, _mark(filled[0], GATE_MARK), sigmoid=all(_mark(p, SIGMOID_MARK, False) for p in filled))
    if all(getattr(piece, WEIGHTS_MARK, False) for piece in filled):
        mark_weights(result)
    if len(filled) == 1 and (GATE_MASKS_MADE or WEIGHTS_MASKS_MADE):
        keep_gate_elements(filled[0], result, made)
        keep_weights_elements(filled[0], result, made)


def mark_weights(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as a softmax's output, weights that mix what they multiply (see :func:`weighing_factors`), and
    return it.

    Examples:
        >>> x = torch.ones(2, requires_grad=True) * 1
        >>> weighing_factors((x * 2, mark_weights(torch.softmax(x, 0))))
        [False, True]
    """
    setattr(tensor, WEIGHTS_MARK, True)
    return tensor


def keep_held_product_mark(args: tuple, result: Any, any_gate: bool) -> None:
    """Mark ``result``, the element-wise product of ``args``, as a factor that products hold where both factors are
    (``any_gate``: any gate is held, not the sigmoid-like ones alone): weights, or a gate (see _held_values).

    Examples:
        >>> x = torch.ones(2, requires_grad=True) * 1
        >>> a, b = mark_gate(torch.sigmoid(x), x, sigmoid=True), mark_gate(torch.sigmoid(x * 2), x, sigmoid=True)
        >>> product = a * b
        >>> keep_held_product_mark((a, b), product, any_gate=False)
        >>> is_gate(product)
        True
    """
    mark_held_kind(result, held_product_kind(args, any_gate) if isinstance(result, torch.Tensor) else None)


def mark_held_kind(result: torch.Tensor, kind: tuple[str, Any] | None) -> None:
    """Mark ``result`` as :func:`~tdhook.attribution.rules._held_values.held_product_kind` says (``None``: nothing)."""
    if kind is None:
        return
    if kind[0] == "weights":
        mark_weights(result)
    else:
        mark_gate(result, kind[1], sigmoid=kind[0] == "sigmoid")


def weighing_factors(args: tuple, broadcast: bool = True) -> list[bool] | None:
    """Which of an element-wise product's two factors is a softmax's weights to hold, or ``None`` where neither or
    both are.

    A softmax's output multiplied element by element with an activation weighs it: selective-kernel attention
    (``(paths * softmax(s, dim=1)).sum(1)``, SK-ResNet) and split attention (ResNeSt) mix branches with weights
    that sum to 1 across them, as a mixture of experts' routing weights mix experts (:class:`RouterRule` holds
    those) and a sigmoid gate scales its signal (over two branches the softmax is ``sigmoid(a - b)`` and its
    complement). Held constant (signal-take-all), the mixture passes all its relevance to the branches, which
    sum to it. A matrix product with the weights (attention's ``weights @ v``) is not an element-wise product
    and keeps its rule, and so does one written out as a broadcast product, ``(weights[..., None] * v[:, :, None])``
    summed: the activation repeated along the weights' other dimensions (each value weighed for every query) is
    what no mixture does. Over one query nothing is repeated: attention written so is a mixture's weights, held
    (``p @ v`` keeps the uniform rule). ``broadcast=False``: ``args`` are an einsum's operands, not compared.

    Examples:
        >>> x = torch.tensor([[1.0, -2.0]], requires_grad=True)
        >>> paths = torch.stack([x * 2, x * 3], 1)
        >>> weighing_factors((paths, mark_weights(torch.softmax(paths * 1, 1)))), weighing_factors((paths, paths))
        ([False, True], None)
    """
    if len(args) != 2 or not (is_activation(args[0]) and is_activation(args[1])):
        return None
    marks = [getattr(a, WEIGHTS_MARK, False) for a in args]
    if marks[0] == marks[1]:
        return None
    if not broadcast:  # an einsum's operands: their shapes follow its equation, not broadcasting
        return marks
    signal = args[marks.index(False)]
    try:
        repeated = torch.broadcast_shapes(args[0].shape, args[1].shape) != signal.shape
    except RuntimeError:  # no product of these shapes runs: nothing is repeated
        repeated = False
    return None if repeated else marks


def _scaled_or_copied(func: Any, args: tuple) -> torch.Tensor | None:
    """The tensor ``func(*args)`` (one of ``_ELEMENTS_KEPT``) copies, or scales by a positive constant; ``None`` where
    it does neither."""
    if func in _COPIES:
        return args[0] if args and isinstance(args[0], torch.Tensor) else None
    if len(args) != 2 or func in SAME_VALUES:
        return None
    if func in GATE_SCALINGS:
        return args[0] if isinstance(args[0], torch.Tensor) and _is_positive(args[1]) else None
    for value, factor in (args, args[::-1]):
        if isinstance(value, torch.Tensor) and _is_positive_constant(factor):
            return value
    return None


def _convex_resize(args: tuple, kwargs: dict) -> bool:
    """Whether an ``F.interpolate`` call gives each output a copy or a convex combination of its input's values."""
    mode = args[3] if len(args) > 3 else kwargs.get("mode", "nearest")
    return mode in _CONVEX_RESIZE_MODES


def _is_one(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 1


def _is_positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def _is_positive_constant(value: Any) -> bool:
    """Whether ``value`` is a positive number, or a tensor of one positive number that no gradient reaches (not a
    learned gain: a parameter, or an activation)."""
    if not isinstance(value, torch.Tensor):
        return _is_positive(value)
    with torch._C.DisableTorchFunction():  # an inspection, which a function mode of the call must not see
        if value.requires_grad or value.numel() != 1 or value.is_complex() or value.device.type == "meta":
            return False
        try:
            return bool(value.detach().reshape(()) > 0)
        except RuntimeError:  # a tensor a transform wraps (torch.vmap): its value is not to be read
            return False


def held_gate_product(func: Any, args: tuple, kwargs: dict, any_gate: bool = True) -> torch.Tensor | None:
    """``func(*args, **kwargs)`` with the gate held constant, when exactly one of the two factors is a gate and
    both are activations; ``None`` otherwise.

    A sigmoid-like gate is held first. With ``any_gate`` false only a sigmoid-like gate is held: another
    activation's output (``silu(gate) * up``) is a signal there, as AttnLRP's uniform rule takes it.

    Examples:
        >>> x = torch.tensor([2.0], requires_grad=True)
        >>> signal, gate = x * 3, mark_gate(torch.sigmoid(x * 1), x)
        >>> z = held_gate_product(torch.mul, (signal, gate), {})
        >>> (x * torch.autograd.grad(z, x)[0]).item() == z.item()  # all of z's relevance reaches x, through the signal
        True
    """
    gates = held_factors(args, any_gate)
    if gates is None:
        return None
    return func(*(hold(a) if gate else a for a, gate in zip(args, gates, strict=True)), **kwargs)


def held_factors(args: tuple, any_gate: bool = True) -> list[bool] | None:
    """Which of a product's two factors is the gate to hold, or ``None`` where none is (see
    :func:`held_gate_product`).

    Examples:
        >>> x = torch.tensor([2.0], requires_grad=True)
        >>> held_factors((x * 3, mark_gate(torch.sigmoid(x * 1), x, sigmoid=True)))
        [False, True]
    """
    if len(args) != 2 or not (is_activation(args[0]) and is_activation(args[1])):
        return None
    # A sigmoid-like gate first (squeeze-excite: sigmoid(s) times an activation's output), then any gate.
    gates = [_mark(a, SIGMOID_MARK, False) if GATE_MASKS_MADE else getattr(a, SIGMOID_MARK, False) for a in args]
    if gates[0] == gates[1] and any_gate:
        gates = [is_gate(a) for a in args]
        if gates[0] and gates[1] and is_clipped(args[0]) != is_clipped(args[1]):
            # A clip's output times another activation's (a gated unit whose value path is clipped): the clip is the
            # signal's bounded identity, the other the gate.
            gates = [not is_clipped(a) for a in args]
    return None if gates[0] == gates[1] else gates


def marked_call(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)``, a call the modes let through, its result marked as computed from parameters alone or
    not; an in-place write judged by what it writes (a weight built in place from parameters stays a weight: peft's
    OFT rotation), and a write out of place as the same write into a copy (see _written_copies).

    Examples:
        >>> weight = torch.nn.Parameter(torch.ones(3))
        >>> is_activation(marked_call(torch.mul, (weight, 2.0), {}))
        False
    """
    if func in WRITES_IN_PLACE:
        return mark_written_in_place(func, args, kwargs)
    if func in WRITES_INTO_COPIES and writes_into_copy(func, args, kwargs):
        return write_into_copy(func, args, kwargs, copy_marked)
    return mark_parameter_derived(args, func(*args, **kwargs), func)


def copy_marked(tensor: torch.Tensor, shape: torch.Size | None = None) -> torch.Tensor:
    """``tensor.clone()`` (of ``tensor`` broadcast to ``shape``, where given), marked as the modes mark a copy (a
    gate, constants or gates in part, weights kept).

    Examples:
        >>> x = torch.ones(2, requires_grad=True) * 1
        >>> is_gate(copy_marked(mark_gate(torch.sigmoid(x), x))), copy_marked(x, torch.Size([3, 2])).shape
        (True, torch.Size([3, 2]))
    """
    if shape is not None and shape != tensor.shape:
        expanded = tensor.expand(shape)
        tensor = keep_gate_mark(torch.Tensor.expand, (tensor, shape), mark_parameter_derived((tensor,), expanded))
    return keep_gate_mark(torch.Tensor.clone, (tensor,), mark_parameter_derived((tensor,), tensor.clone()))


class GateRule(PassRule):
    """A sigmoid-like module: relevance passes through it as through any activation (:class:`PassRule`), and its
    output is marked as a gate, held constant where it multiplies an activation (see :class:`HeldGates`).

    Examples:
        >>> from torch import nn
        >>> x = torch.tensor([[1.0, -2.0]], requires_grad=True)
        >>> sigmoid = nn.Sigmoid()
        >>> with GateRule().register(sigmoid), HeldGates():
        ...     z = (x * 1) * sigmoid(x * 1)  # an activation times a gate
        ...     relevance = x * torch.autograd.grad(z.sum(), x)[0]
        >>> torch.allclose(relevance, z)  # signal-take-all: the product's relevance, all of it, on the signal
        True
    """

    def rewrite(self, module, registration, inputs, output):
        if not isinstance(module, GATES):  # taken for a gate by its class name (timm's Sigmoid, HardSigmoid)
            raise_for_values_outside_a_gate(module, output)
        result = super().rewrite(module, registration, inputs, output)
        return mark_gate(output if result is None else result, inputs[0], sigmoid=True)


# No F.normalize or F.cosine_similarity call yet (never given one: each mode makes its own at its first).
_NO_NORM_CALLS = HeldNormCalls()
# The pass rule of clipping calls under HeldGates: the presets' on ``nn.Hardtanh`` and ``nn.ReLU6`` modules.
_PASS_CLIPS = PassRule()


class HeldGates(TorchFunctionMode):
    """Hold gates constant in element-wise products (in place too: ``h.mul_(g)``, ``h *= g``) and in gated linear
    units (``F.glu``, ``nn.GLU``) during a forward pass; mark sigmoid outputs as gates; give
    clipping calls (``torch.clamp``, ``clip``, ``F.hardtanh``, ``F.relu6``, in place too, and ``torch.maximum``,
    ``minimum``, ``fmax``, ``fmin`` of an activation and a constant) the pass rule that
    ``nn.Hardtanh`` and ``nn.ReLU6`` modules get (see :mod:`~tdhook.attribution.rules._clips`); hold the norms of
    ``F.normalize`` and ``F.cosine_similarity`` (``nn.CosineSimilarity``) constant, the cosine's product of two
    activations shared (see :mod:`~tdhook.attribution.rules._held_norm_calls`).

    The rule mappers for CNNs run the forward pass in this mode. It is cheap enough to stay on inside modules
    that have a rule of their own (``pause_in_ruled_modules`` is false): a module's rule takes the gradient of its
    output past the calls inside it.

    Examples:
        >>> x = torch.tensor([1.0, -2.0], requires_grad=True)
        >>> with HeldGates():
        ...     signal = 2 * x
        ...     z = signal * torch.sigmoid(x * 1)
        >>> torch.allclose(x * torch.autograd.grad(z.sum(), x)[0], z)
        True
    """

    pause_in_ruled_modules = False
    #: clipping calls get the pass rule (the watch of nonlinear calls names those made by ATen operators)
    passes_clips = True
    #: the held gates keep the graph in a call that asks for it (see :func:`~tdhook.attribution.rules._autograd.hold`)
    differentiable = True

    def __init__(self, probe: bool = False) -> None:
        super().__init__()
        self.held = False  # whether a gate was held in a product (what the wrapper's first call asks: ``probe``)
        self.probe = probe
        self.clips: list = []  # the nodes of the clipping calls given the pass rule (in a first call)
        # The F.normalize and F.cosine_similarity calls given their rule: made at the first (a call costs nothing).
        self.norm_calls = _NO_NORM_CALLS

    def gave_back(self, node: Any) -> bool:
        """Whether the call whose output's autograd node is ``node`` is an ``F.normalize`` or
        ``F.cosine_similarity`` call this mode covered, then gave back its plain gradient (see
        :meth:`~tdhook.attribution.rules._held_norm_calls.HeldNormCalls.gave_back`)."""
        return self.norm_calls.gave_back(node)

    def covers(self, func: Any, args: tuple) -> bool:
        """Whether this mode gives ``func`` a rule: a product whose gate it holds. A sigmoid is not covered here:
        held, its output is cut from the explained output's graph, and one that gates nothing keeps its plain
        gradient (the coverage report names it)."""
        if func is F.glu:
            return bool(args) and is_activation(args[0])
        if func in _PRODUCTS_IN_PLACE:
            return held_factors(args) == [False, True]
        if func in NORMALIZING_CALLS:
            return any(is_activation(x) for x in normalized_inputs(func, args, {}))
        if func in WRITTEN_NORM_CALLS and self.norm_calls.holds_statistic(args):
            return True
        if func in FUSED_PRODUCTS:
            return any(fused_factors(func, args, {}, held_factors) or ())
        return func in ELEMENTWISE_PRODUCTS and held_factors(args) is not None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs and func in _GATES_AND_CLIPS:  # ``h.mul(other=g)``, ``torch.sigmoid(input=h)``: read by position
            args, kwargs = positional_factors(func, args, kwargs)
        if kwargs and "out" in kwargs:  # an ``out=`` write into an alias, or under no_grad: see _unrecorded_writes
            note_out_write(func, kwargs["out"])
        if UNRECORDED and (read := read_unrecorded(func, args, kwargs)) is not NOT_READ:  # see _unrecorded_writes
            return read
        if func in WRITTEN_NORM_CALLS and (place := statistic_place(func, args, kwargs)) is not None:
            # ``h / h.norm(...)``, ``h * rsqrt(...)``: its statistic held, as F.normalize's norm (_written_norms)
            what = "the norms written out held constant"
            raise_for_transformed_call(what, args)
            raise_for_checkpoint(what)
            if self.norm_calls is _NO_NORM_CALLS:
                self.norm_calls = HeldNormCalls()
            return self.norm_calls.written(func, args, kwargs, place)
        if func in STATISTICS_AND_MEANS and args and is_activation(args[0]) and not in_checkpoint():
            # ``var, mean = torch.var_mean(h, ...)``: the mean on a node of its own, so that the call is reached (and
            # named in the coverage report) only where its statistic keeps its gradient (see _means_apart)
            return mean_apart(func, args, kwargs)
        if func in ELEMENTWISE_PRODUCTS:
            # A factor a gate in some elements only (a join of gates and other activations): element by element.
            held = (
                mixed_gate_product(func, args, kwargs, True, _plain_product(func, kwargs))
                if GATE_MASKS_MADE or CONSTANT_MASKS_MADE
                else None
            )
            held = held_gate_product(func, args, kwargs) if held is None else held
            if held is not None:
                raise_for_checkpoint("gates held constant in products")
                self.held = True
                return held
            if self.norm_calls.held:  # a product of two activations, which has no rule here: see _held_norm_calls
                self.norm_calls.release_reached(func, args, kwargs)
            return keep_gate_mark(func, args, mark_parameter_derived(args, func(*args, **kwargs), func), kwargs)
        if func in _PRODUCTS_IN_PLACE and not kwargs and GATE_MASKS_MADE and mixed_gate_in_place(args):
            # A signal written into by a gate in some elements only (``h.mul_(m)``): those held, as ``h * m`` holds
            # them. (One written into by its signal keeps its plain gradient, as below.)
            product = mixed_gate_product(
                torch.mul, args, {}, True, _plain_product(torch.mul, {}), (args[0].clone(), args[1]), first=False
            )
            if product is not None:
                raise_for_checkpoint("gates held constant in products")
                self.held = True
                return args[0].copy_(product)
        if (
            func in _PRODUCTS_IN_PLACE
            and not kwargs
            and held_factors(args) == [False, True]
            and torch.is_grad_enabled()
        ):
            # ``h.mul_(g)``, ``h *= g``: the signal written into by the gate held, as ``h * g`` holds it. (A gate
            # written into by the signal, ``g.mul_(h)``, keeps its plain gradient: the coverage report names it.)
            raise_for_checkpoint("gates held constant in products")
            self.held = True
            return func(args[0], hold(args[1]))
        if func is F.glu and args and is_activation(args[0]):  # a · sigmoid(b): its gate held as any other
            raise_for_transformed_call("gates held constant in products", args[:1])
            raise_for_checkpoint("gates held constant in products")
            self.held = True
            return held_glu(args[0], call_argument(args, kwargs, 1, "dim", -1))
        if func in NORMALIZING_CALLS:  # F.normalize, F.cosine_similarity: their norms held
            what = f"the norms of {func.__name__} held constant"
            inputs = normalized_inputs(func, args, kwargs)
            raise_for_transformed_call(what, inputs)
            if any(is_activation(x) for x in inputs):
                raise_for_checkpoint(what)
                if self.norm_calls is _NO_NORM_CALLS:
                    self.norm_calls = HeldNormCalls()
                return self.norm_calls.call(func, args, kwargs)
        if func in CLIPS or func in CLIPS_IN_PLACE:
            raise_for_transformed_call("the pass rule on clipping calls", args[:1])
            if clips_a_signal(func, args):
                result = clip_passing(func, args, kwargs, _PASS_CLIPS.apply, _PASS_CLIPS)
                self.clips.append(result.grad_fn)
                return result
        if func in BOUNDS:  # ``torch.maximum(h, c)`` with a constant ``c``: a clip
            signal = bounded_signal(func, args, kwargs)
            if signal is not None:
                raise_for_transformed_call("the pass rule on clipping calls", (signal,))
                result = bound_passing(func, args, kwargs, signal, _PASS_CLIPS.apply, _PASS_CLIPS)
                self.clips.append(result.grad_fn)
                return result
        if func in FUSED_PRODUCTS and any(fused_factors(func, args, kwargs, held_factors) or ()):
            raise_for_checkpoint("gates held constant in products")  # ``torch.lerp(h, n, z)``: its gate held
            self.held = True
            return fused_product(func, args, kwargs, fused_factors(func, args, kwargs, held_factors), uniform=False)
        gate = func in GATE_FUNCTIONS or func in _GATES_IN_PLACE
        if gate:  # a gate computed under torch.vmap is neither seen nor held
            raise_for_transformed_call("gates held constant in products", args[:1])
        if self.norm_calls.held:  # a product of two activations, which has no rule here: see _held_norm_calls
            self.norm_calls.release_reached(func, args, kwargs)
        result = marked_call(func, args, kwargs)
        if gate and args and is_activation(args[0]) and isinstance(result, torch.Tensor):
            return mark_gate(result, args[0], sigmoid=True)
        if func in WHERES and self.probe and not self.held and choice_follows_values(func, args, kwargs):
            self.held = True  # a gate chosen or not as a condition's values say: later calls keep it (_whole_choices)
        return keep_gate_mark(func, args, result, kwargs)


def _plain_product(func: Any, kwargs: dict) -> Any:
    """The product ``func(*factors, **kwargs)`` of two factors with its plain gradient."""
    return lambda factors: func(*factors, **kwargs)


def give_back_norms_entering(args: tuple) -> None:
    """Give the plain gradient back to the norm calls held by the open :class:`HeldGates` modes that the
    activations in ``args`` are computed from: they enter a module run with the modes paused (one the caller maps
    to ``IgnoreRule``), whose products of two activations the modes do not see.

    Examples:
        >>> x = torch.randn(2, 3, requires_grad=True)
        >>> with HeldGates() as mode:
        ...     e = F.normalize(x * 1, dim=1)
        ...     give_back_norms_entering((e,))
        >>> mode.norm_calls.held
        0
    """
    for mode in torch.overrides._get_current_function_mode_stack():
        if isinstance(mode, HeldGates) and mode.norm_calls.held:
            mode.norm_calls.release_from(args)
