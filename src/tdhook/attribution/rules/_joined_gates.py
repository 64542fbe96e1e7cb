"""Gates joined by ``torch.cat`` or ``torch.stack``: a gate where every element joined is one.

A gate (a sigmoid's output, see :mod:`~tdhook.attribution.rules.gates`) computed in pieces and joined again
(``torch.cat([sigmoid(a), sigmoid(b)], 1)``: a gate per head or per group; ``torch.cat([g[:, :3], g[:, 3:]], 1)``)
has the values of its pieces, each in ``[0, 1]``: it is a gate, held where a product takes it. It was none, and the
product's relevance was shared with the gate (2.2 to 3.5 off, relative L2, under AttnLRP and CP-LRP, 0.18 to 0.69
under the CNN presets, against the same model with the gate's pieces detached).

A join of gates and other activations (``torch.cat([i.sigmoid(), g.tanh(), o.sigmoid()], 1)``, an LSTM cell's gates
computed together) is no gate, but the elements its sigmoid-like gates went to are: they are noted as a mask over
the result (see :func:`~tdhook.attribution.rules._gate_writes.note_gate_written`), and a view of it (``chunk``,
``split``, a slice) that shows only such elements is a gate. Such a join joined again (two cells' joins stacked, or
a view across its pieces joined with others) passes its noted elements on to the new join's mask (they were lost:
the gates split out again were none, 2.3 off, relative L2, under AttnLRP, 2.7 under CP-LRP, 0.84 under the CNN
presets). Gates of another kind (an activation's output, which
CP-LRP holds as well, AttnLRP not) are not noted there: every activation's output under those presets is one, and a
mask alive makes every later gate test of the call look it up. A join of them alone is one, as a view of one is. A
join of them beside other activations and no sigmoid-like gate (``torch.cat([tanh(a), relu(h)], 1)``) notes where
they went in a mask of their own (:data:`OTHER_GATES`, counted in :data:`OTHER_MASKS_MADE`), which CP-LRP's
products alone look up (it was no gate at all: 0.22 off, relative L2, under CP-LRP, 0.50 for a view across both).
Constants joined with gates (``torch.cat([torch.ones(b, 1), gate], 1)``: a gate of 1 for a token) count as gates:
held or not, they pass no gradient. So do constants joined with activations that are no sigmoid-like gate
(``torch.cat([torch.ones(b, 2), relu(h)], 1) * s``; a parameter, a buffer, a ViT's class token expanded): their
elements are noted as a sigmoid-like gate's, held in a product, which took them as none (the uniform rule gave them
half of its relevance, passed on to nothing: 0.36 to 0.49 off, relative L2, under AttnLRP and CP-LRP).

The joins (:data:`GATE_JOINS`) are the calls that copy their pieces' values into a new tensor: ``cat``, ``concat``,
``concatenate``, ``stack``, ``hstack``, ``vstack``, ``row_stack``, ``dstack``, ``column_stack``, and the same through
``torch.ops.aten``. (With ``out=``, torch refuses pieces that need a gradient: a gate cannot be joined that way.)
"""

from __future__ import annotations

from typing import Any

import torch

from tdhook.attribution.rules._activation_writes import MASKS_MADE, PARAMETER_DERIVED
from tdhook.attribution.rules._autograd import is_activation
from tdhook.attribution.rules._constant_elements import (
    CACHED,
    CONSTANT_MASKS_MADE,
    CONSTANTS_JOINED,
    constants_shown,
    note_constant_gates,
)
from tdhook.attribution.rules._gate_writes import (
    GATE_MASKS_MADE,
    GATE_WRITTEN,
    OTHER_GATES,
    OTHER_MASKS_MADE,
    note_gate_written,
)
from tdhook.attribution.rules._in_place_writes import GATE_MARKS, gate_marks_of
from tdhook.attribution.rules._storage_masks import count_mask, laid_over_storage, shown_of_storage

__all__ = [
    "CONSTANTS_JOINED",
    "CONSTANT_MASKS_MADE",
    "GATE_JOINS",
    "OTHER_GATES",
    "OTHER_MASKS_MADE",
    "constants_shown",
    "mark_joined_gate",
    "note_other_gates",
    "other_gates_shown",
]

_JOIN_NAMES = ("cat", "concat", "concatenate", "stack", "hstack", "vstack", "row_stack", "dstack", "column_stack")
_ATEN_JOINS = [getattr(torch.ops.aten, name) for name in _JOIN_NAMES]
#: The calls that join tensors given as a sequence, their first argument (or ``tensors=``), into a new tensor.
GATE_JOINS = frozenset(
    {getattr(torch, name) for name in _JOIN_NAMES}
    | {op for packet in _ATEN_JOINS for op in (packet, *(getattr(packet, o) for o in packet.overloads()))}
)
_GATE, _SIGMOID = GATE_MARKS


def mark_joined_gate(func: Any, args: tuple, kwargs: dict, result: Any) -> None:
    """Mark ``result``, the output of the join ``func(*args, **kwargs)`` (one of :data:`GATE_JOINS`), as a gate
    where every piece joined is one (a sigmoid-like gate where every piece is); where only some are, note the
    elements of the gates on ``result``, for its views (see the module's docstring).

    Examples:
        >>> x = torch.ones(2, 4, requires_grad=True)
        >>> gates = [torch.sigmoid(x[:, :2] * 1), torch.sigmoid(x[:, 2:] * 1)]
        >>> for gate in gates:
        ...     gate.__dict__.update(_tdhook_activation_of=x, _tdhook_sigmoid_gate=True)
        >>> joined = torch.cat(gates, 1)
        >>> mark_joined_gate(torch.cat, (gates, 1), {}, joined)
        >>> bool(gate_marks_of(joined))
        True
        >>> pieces = [gates[0], x[:, 2:] * 2]  # a gate beside an activation
        >>> mixed = torch.cat(pieces, 1)
        >>> mark_joined_gate(torch.cat, (pieces, 1), {}, mixed)
        >>> [bool(gate_marks_of(piece)) for piece in (mixed, *mixed.chunk(2, 1))]
        [False, True, False]
    """
    pieces = args[0] if args else kwargs.get("tensors", ())
    if not GATE_MASKS_MADE:  # the common path: a look at each piece's own marks, no call (rotary embeddings' cat)
        constant = activation = False
        try:
            for piece in pieces:  # (tensors, or what else the join took: TensorDicts, an RSSM's rollout steps)
                own = piece.__dict__
                if _GATE in own:
                    break
                # A constant (no grad, a parameter, a tensor of parameters alone) beside an activation: noted below.
                # (Not an empty one: a key cache's first ``cat`` onto ``torch.tensor([])`` would keep a mask alive
                # all call.)
                if piece.requires_grad and not piece.is_leaf:
                    activation = True
                    # (the masks: is_activation tells; a piece's constants beside its activation tell where they go)
                    constant = constant or MASKS_MADE or PARAMETER_DERIVED in own
                    constant = constant or bool(CONSTANT_MASKS_MADE and _holds_constants(piece))
                elif 0 not in piece.shape and CACHED not in own:  # (a cache's prefix: the whole sequence's)
                    constant = True
            else:
                if not (constant and activation):
                    return
        except AttributeError:  # a piece no tensor (``torch.cat`` of TensorDicts): no gate to note
            return
    if not isinstance(result, torch.Tensor) or not isinstance(pieces, (list, tuple)) or not pieces:
        return
    if kwargs.get("out") is not None:  # (under no_grad alone: a tensor written into, whose views this does not follow)
        return
    marks = [gate_marks_of(piece) for piece in pieces]
    with torch._C.DisableTorchFunction():  # (a property read is a call of another mode)
        # Constants joined with gates (``torch.cat([torch.ones(b, 1), gate], 1)``): held or not, they are constants;
        # and no activation (CP-LRP's softmax held in a first call's graph, a parameter): they pass no relevance.
        constants = [not is_activation(piece) for piece in pieces]
    kept = [bool(mark) or constant for mark, constant in zip(marks, constants, strict=True)]
    # Constants joined with activations (``torch.cat([torch.ones(b, 2), relu(h)], 1)``): in a product they take
    # none of its relevance, as a gate held, whatever the other pieces are (the uniform rule gave them half, passed
    # on to nothing: 0.36-0.49 off, relative L2, under AttnLRP and CP-LRP); their elements noted as a sigmoid gate's.
    # (Not a key-value cache's prefix: the new tokens get the relevance the whole sequence gives them.)
    noted_constants = [c and CACHED not in p.__dict__ for c, p in zip(constants, pieces, strict=True)]
    joined_constants = not all(constants) and any(c and p.numel() for c, p in zip(noted_constants, pieces, strict=True))
    # (Pieces with constants beside their activations, a join of them joined again: where theirs go.)
    joined_constants = joined_constants or bool(CONSTANT_MASKS_MADE and any(map(_holds_constants, pieces)))
    # Pieces that show gates in part (a join of gates and others, a view across its pieces): their gates' elements.
    shown = [None if keep else _gates_shown(piece) for piece, keep in zip(pieces, kept, strict=True)]
    kinds = [bool(mark.get(_SIGMOID, False)) for mark in marks if mark]
    partly = [part for part in shown if part is not None]
    if not kinds and not partly and not joined_constants:
        return
    if kinds and all(kept) and (all(kinds) or not (any(kinds) or joined_constants)):  # a gate, of one kind
        source = next(mark[_GATE] for mark in marks if mark)
        result.__dict__.update({_GATE: source, _SIGMOID: True} if all(kinds) else {_GATE: source})
        if joined_constants:  # (sigmoid-like gates beside constants: times another gate, the constants take none)
            _note_constants(func, args, kwargs, pieces, noted_constants, result)
        return
    if not any(kinds) and not partly and not joined_constants:
        if kinds and not all(kept):  # gates of another kind beside other activations: where they went alone
            _note_other_gates(func, args, kwargs, pieces, kept, shown, result)
            if isinstance(other_gates_shown(result), torch.Tensor):
                count_mask(result, OTHER_MASKS_MADE)
        return
    # Some elements are sigmoid-like gates (or constants): noted for the views of ``result``.
    noted = [bool(mark.get(_SIGMOID, False)) or (keep and not mark) for mark, keep in zip(marks, kept, strict=True)]
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        flags = [
            torch.full(piece.shape, note, dtype=torch.bool, device=result.device) if part is None else part[0]
            for piece, note, part in zip(pieces, noted, shown, strict=True)
        ]
        region = func(flags, *args[1:], **{k: v for k, v in kwargs.items() if k != "tensors"})
    if region.shape == result.shape:
        sources = [mark[_GATE] for mark in marks if mark.get(_SIGMOID, False)] + [part[1] for part in partly]
        sources += [piece for piece, constant in zip(pieces, constants, strict=True) if constant]  # (their own)
        source = sources[0] if sources else torch.zeros((), device=result.device)  # (constants of pieces alone)
        note_gate_written(result, region, {_GATE: source, _SIGMOID: True})
        _note_other_gates(func, args, kwargs, pieces, kept, shown, result)
        if joined_constants:
            _note_constants(func, args, kwargs, pieces, noted_constants, result)


def _holds_constants(piece: Any) -> bool:
    """Whether ``piece``, a piece joined, shows constants beside an activation (see :data:`CONSTANTS_JOINED`)."""
    return constants_shown(piece) is not None


def _note_constants(
    func: Any, args: tuple, kwargs: dict, pieces: Any, constants: list[bool], result: torch.Tensor
) -> None:
    """Note on ``result``, a join of constants and activations, where its constants went (see
    :data:`CONSTANTS_JOINED`): a piece itself such a join (or a view of one) tells where its own went."""
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        flags = []
        for piece, constant in zip(pieces, constants, strict=True):
            part = None if constant else constants_shown(piece)
            flags.append(
                torch.full(piece.shape, constant, dtype=torch.bool, device=result.device) if part is None else part
            )
        region = func(flags, *args[1:], **{k: v for k, v in kwargs.items() if k != "tensors"})
        mask = laid_over_storage(result, region) if region.shape == result.shape else None
    if mask is not None:
        setattr(result, CONSTANTS_JOINED, (mask, result._version))
        count_mask(result, CONSTANT_MASKS_MADE)
        if not all(constants):  # (a piece's constants beside its activation: a sigmoid-like gate's elements, as its)
            note_constant_gates(result, region, None)


def _note_other_gates(
    func: Any, args: tuple, kwargs: dict, pieces: Any, kept: list[bool], shown: list, result: torch.Tensor
) -> None:
    """Note on ``result``, a join of gates and other activations, where a gate of any kind (or a constant) went (see
    :mod:`~tdhook.attribution.rules._mixed_gate_products`): where every piece tells (a piece showing gates in part
    tells where it was noted so, a join itself)."""
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        flags = []
        for piece, keep, part in zip(pieces, kept, shown, strict=True):
            other = other_gates_shown(piece) if OTHER_MASKS_MADE or GATE_MASKS_MADE else None
            if part is None and not (isinstance(other, torch.Tensor) and not keep):  # (its mask: gates of another kind)
                flags.append(torch.full(piece.shape, keep, dtype=torch.bool, device=result.device))
                continue
            if other is None or other is False:
                return  # not known: a product that would hold them raises
            flags.append(other)
        region = func(flags, *args[1:], **{k: v for k, v in kwargs.items() if k != "tensors"})
    note_other_gates(result, region)


def note_other_gates(result: torch.Tensor, region: torch.Tensor | bool) -> None:
    """Note on ``result`` where a gate of any kind is (see :data:`OTHER_GATES`): ``region``, a mask of its shape, laid
    over its storage (a join in channels-last layout, a copy of a transposed view keep their elements' strides);
    ``False``: not known (a product that would hold them raises).

    Examples:
        >>> result = torch.zeros(3, 2).t().clone()  # a copy of a transposed view: its storage laid out transposed
        >>> note_other_gates(result, torch.tensor([[True, False, False], [False, False, True]]))
        >>> other_gates_shown(result).tolist(), other_gates_shown(result[1]).tolist()
        ([[True, False, False], [False, False, True]], [False, False, True])
    """
    mask = None if region is False else laid_over_storage(result, region)  # (``None``: not known)
    setattr(result, OTHER_GATES, (mask, result._version))


def other_gates_shown(piece: torch.Tensor) -> torch.Tensor | bool | None:
    """Where ``piece``, a join of gates and other activations (or a view of one), is a gate of any kind (see
    :data:`OTHER_GATES`): a mask of its shape; ``None`` where no join noted it, ``False`` where the join was written
    into in place since (not known).

    Examples:
        >>> x = torch.ones(3, requires_grad=True)
        >>> sigmoid, tanh, other = torch.sigmoid(x * 1), torch.tanh(x * 1), x * 2  # gates of two kinds, and none
        >>> sigmoid.__dict__.update(_tdhook_activation_of=x, _tdhook_sigmoid_gate=True)
        >>> tanh.__dict__.update(_tdhook_activation_of=x)
        >>> mixed = torch.stack([sigmoid, tanh, other])
        >>> mark_joined_gate(torch.stack, ([sigmoid, tanh, other],), {}, mixed)
        >>> other_gates_shown(mixed[:, 0]).tolist()
        [True, True, False]
    """
    return shown_of_storage(piece, OTHER_GATES)


def _gates_shown(piece: torch.Tensor) -> tuple[torch.Tensor, Any] | None:
    """Where ``piece``, a tensor or a view of one whose gate elements are noted (see
    :func:`~tdhook.attribution.rules._gate_writes.note_gate_written`: a join of gates and other activations), shows
    sigmoid-like gates: a mask of its shape, and the gate's source; ``None`` where no such gate is noted.

    Examples:
        >>> x = torch.ones(2, 4, requires_grad=True)
        >>> pieces = [torch.sigmoid(x[:, :2] * 1), x[:, 2:] * 2]  # a gate beside an activation
        >>> pieces[0].__dict__.update(_tdhook_activation_of=x, _tdhook_sigmoid_gate=True)
        >>> mixed = torch.cat(pieces, 1)
        >>> mark_joined_gate(torch.cat, (pieces, 1), {}, mixed)
        >>> _gates_shown(mixed[:, 1:])[0].tolist()  # a view across the gate and the activation
        [[True, False, False], [True, False, False]]
    """
    if not GATE_MASKS_MADE:
        return None
    with torch._C.DisableTorchFunction(), torch.no_grad():  # an inspection, which a function mode must not see
        root = piece if piece._base is None else piece._base
        record = root.__dict__.get(GATE_WRITTEN)
        if record is None or not record[1].get(_SIGMOID, False) or piece.element_size() != root.element_size():
            return None
        return record[0].as_strided(piece.shape, piece.stride(), piece.storage_offset()), record[1][_GATE]
