"""Gates joined by ``torch.cat`` or ``torch.stack``: a gate where every element joined is one.

A gate (a sigmoid's output, see :mod:`~tdhook.attribution.rules.gates`) computed in pieces and joined again
(``torch.cat([sigmoid(a), sigmoid(b)], 1)``: a gate per head or per group; ``torch.cat([g[:, :3], g[:, 3:]], 1)``)
has the values of its pieces, each in ``[0, 1]``: it is a gate, held where a product takes it. It was none, and the
product's relevance was shared with the gate (2.2 to 3.5 off, relative L2, under AttnLRP and CP-LRP, 0.18 to 0.69
under the CNN presets, against the same model with the gate's pieces detached).

A join of gates and other activations (``torch.cat([i.sigmoid(), g.tanh(), o.sigmoid()], 1)``, an LSTM cell's gates
computed together) is no gate, but the elements its sigmoid-like gates went to are: they are noted as a mask over
the result (see :func:`~tdhook.attribution.rules._gate_writes.note_gate_written`), and a view of it (``chunk``,
``split``, a slice) that shows only such elements is a gate. Gates of another kind (an activation's output, which
CP-LRP holds as well, AttnLRP not) are not noted there: every activation's output under those presets is one, and a
mask alive makes every later gate test of the call look it up. A join of them alone is one, as a view of one is.
Constants joined with gates (``torch.cat([torch.ones(b, 1), gate], 1)``: a gate of 1 for a token) count as gates:
held or not, they pass no gradient.

The joins (:data:`GATE_JOINS`) are the calls that copy their pieces' values into a new tensor: ``cat``, ``concat``,
``concatenate``, ``stack``, ``hstack``, ``vstack``, ``row_stack``, ``dstack``, ``column_stack``, and the same through
``torch.ops.aten``. (With ``out=``, torch refuses pieces that need a gradient: a gate cannot be joined that way.)
"""

from __future__ import annotations

from typing import Any

import torch

from tdhook.attribution.rules._gate_writes import GATE_MASKS_MADE, note_gate_written
from tdhook.attribution.rules._in_place_writes import GATE_MARKS, gate_marks_of

__all__ = ["GATE_JOINS", "mark_joined_gate"]

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
        for piece in pieces:  # (tensors all: the join ran)
            if _GATE in piece.__dict__:
                break
        else:
            return
    if not isinstance(result, torch.Tensor) or not isinstance(pieces, (list, tuple)) or not pieces:
        return
    if kwargs.get("out") is not None:  # (under no_grad alone: a tensor written into, whose views this does not follow)
        return
    marks = [gate_marks_of(piece) for piece in pieces]
    with torch._C.DisableTorchFunction():  # (a property read is a call of another mode)
        # Constants joined with gates (``torch.cat([torch.ones(b, 1), gate], 1)``): held or not, they are constants.
        kept = [bool(mark) or not piece.requires_grad for piece, mark in zip(pieces, marks, strict=True)]
    kinds = [bool(mark.get(_SIGMOID, False)) for mark in marks if mark]
    if not kinds:
        return
    source = next(mark[_GATE] for mark in marks if mark)
    if all(kept) and (all(kinds) or not any(kinds)):  # a gate, of one kind
        result.__dict__.update({_GATE: source, _SIGMOID: True} if all(kinds) else {_GATE: source})
        return
    if not any(kinds):  # (another activation's output beside others: held by CP-LRP alone, not noted)
        return
    # Some elements are sigmoid-like gates (or constants): noted for the views of ``result``.
    noted = [bool(mark.get(_SIGMOID, False)) or (keep and not mark) for mark, keep in zip(marks, kept, strict=True)]
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        flags = [torch.full(piece.shape, note, dtype=torch.bool) for piece, note in zip(pieces, noted, strict=True)]
        region = func(flags, *args[1:], **{k: v for k, v in kwargs.items() if k != "tensors"})
    if region.shape == result.shape:
        sigmoid_source = next(mark[_GATE] for mark in marks if mark.get(_SIGMOID, False))
        note_gate_written(result, region.to(result.device), {_GATE: sigmoid_source, _SIGMOID: True})
