"""A tensor a gate's or a softmax's weights' values are copied into in place (``c.copy_(w)``): marked as they are.

A copy written into a tensor made for it (``torch.empty_like(m).copy_(m)``, a buffer filled by ``copy_``) has the
values of what is copied. A gate copied so kept its marks already (see
:mod:`~tdhook.attribution.rules._in_place_writes`); a softmax's weights lost theirs, and a join of gates (or weights)
and other activations its gate elements: a product with the copy shared its relevance with the gate or the weights
(0.33 off, relative L2, under AttnLRP, for the weights; a join's 6.5 under AttnLRP and CP-LRP, 0.24 under
EpsilonPlus, 0.45 for a join of weights under AttnLRP; against the same product without the copy).
:func:`keep_copied_marks` marks the copy as what it copies is, element by element for a join;
:func:`written_in_place`, an in-place write marked as the function modes mark it, for the modes that mark the writes
they see around the rules' (the watch of a first call's nonlinear calls, the stabilised additions), which would
otherwise mark the copy again as no gate.
"""

from __future__ import annotations

from typing import Any

import torch

from tdhook.attribution.rules._gate_writes import GATE_WRITTEN, note_gate_written
from tdhook.attribution.rules._in_place_writes import GATE_MARKS, gate_marks_of, mark_written_in_place
from tdhook.attribution.rules._joined_gates import OTHER_GATES, other_gates_shown
from tdhook.attribution.rules._joined_weights import (
    _WEIGHTS_JOINED,
    WEIGHTS_MARK,
    WEIGHTS_MASKS_MADE,
    keep_weights_elements,
    weights_shown,
)
from tdhook.attribution.rules._kept_gate_elements import keep_gate_elements
from tdhook.attribution.rules._mixed_gate_products import gate_elements
from tdhook.attribution.rules._storage_masks import count_mask, laid_over_storage

__all__ = ["COPIES_IN_PLACE", "keep_copied_marks", "written_in_place"]

_ATEN = torch.ops.aten.copy_
#: The in-place copies: ``c.copy_(v)``, and through ``torch.ops.aten``.
COPIES_IN_PLACE = frozenset({torch.Tensor.copy_, _ATEN, *(getattr(_ATEN, name) for name in _ATEN.overloads())})


def keep_copied_marks(args: tuple, result: object) -> None:
    """Mark ``result``, ``args[0]`` after ``args[0].copy_(args[1])``, as a softmax's weights where ``args[1]`` is
    (and as none where it is not), and note the elements that ``args[1]``, a gate (or weights) in some elements only,
    shows as such (broadcast as the copy broadcasts); a view written into is left as the write left it.

    Examples:
        >>> weights = torch.softmax(torch.ones(2, 3, requires_grad=True), -1)
        >>> weights.__dict__["_tdhook_softmax_weights"] = True
        >>> copy = torch.empty(2, 3).copy_(weights)
        >>> keep_copied_marks((copy, weights), copy)
        >>> copy.__dict__.get("_tdhook_softmax_weights")
        True
    """
    if len(args) < 2 or result is not args[0] or not isinstance(args[1], torch.Tensor):
        return
    with torch._C.DisableTorchFunction():  # (a property read is a call of another mode)
        if result._base is not None:  # ``buf[:, :3].copy_(m)``: noted on the tensor viewed
            _keep_copied_into_view(args[1], result)
            return
        source, shape = args[1], result.shape
        if WEIGHTS_MARK in source.__dict__:
            result.__dict__[WEIGHTS_MARK] = True
        else:
            result.__dict__.pop(WEIGHTS_MARK, None)
        marks = gate_marks_of(source)  # (a gate's marks, set by ``Tensor.copy_``'s write already, not ``aten.copy_``'s)
        for mark in GATE_MARKS:
            result.__dict__.pop(mark, None)
        # Every element is the copy's now: the note of a join of weights held before goes (it read as written into
        # since, not known: a product with a signal copied over it was refused).
        result.__dict__.pop(_WEIGHTS_JOINED, None)
        result.__dict__.update(marks)
        broadcast = None if source.shape == shape else (lambda mask: mask.expand(shape))
    keep_gate_elements(source, result, broadcast)
    keep_weights_elements(source, result, broadcast)


def written_in_place(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)``, an in-place write, marked as the function modes mark it (see
    :func:`~tdhook.attribution.rules._in_place_writes.mark_written_in_place`), a copy as what it copies is (see
    :func:`keep_copied_marks`).

    Examples:
        >>> weights = torch.softmax(torch.ones(2, 3, requires_grad=True), -1)
        >>> weights.__dict__["_tdhook_softmax_weights"] = True
        >>> copy = written_in_place(torch.Tensor.copy_, (torch.empty(2, 3), weights), {})
        >>> copy.__dict__.get("_tdhook_softmax_weights")
        True
    """
    result = mark_written_in_place(func, args, kwargs)
    if func in COPIES_IN_PLACE:
        keep_copied_marks(args, result)
    return result


def _keep_copied_into_view(source: torch.Tensor, view: torch.Tensor) -> None:
    """Note on the tensor ``view`` shows, after ``view.copy_(source)``, the elements ``source`` shows as sigmoid-like
    gates, gates of any kind, or a softmax's weights, where it is such in some elements only (a join of gates and
    other activations, ``buf[:, :3].copy_(m)``), or weights: they were lost (1.1 off, relative L2, under AttnLRP and
    CP-LRP, 0.25 under EpsilonPlus, against the product with the join's pieces apart). (A gate copied whole into a
    view is noted as every in-place write of a gate is.) The tensor's other elements are taken as they were noted as
    sigmoid-like gates, and as no weights."""
    shown = gate_elements(source)
    root = view._base
    with torch.no_grad():  # bookkeeping, which a function mode must not see
        if shown is not None:
            note_gate_written(view, shown[0].expand(view.shape), {GATE_MARKS[0]: shown[1], GATE_MARKS[1]: True})
            other, record = other_gates_shown(source), root.__dict__.get(GATE_WRITTEN)
            if record is not None and view.element_size() == root.element_size():
                mask = record[0].clone() if isinstance(other, torch.Tensor) else None  # (``None``: not known)
                if mask is not None:
                    mask.as_strided(view.shape, view.stride(), view.storage_offset()).copy_(other.expand(view.shape))
                setattr(root, OTHER_GATES, (mask, root._version))
        weights = True if WEIGHTS_MARK in source.__dict__ else weights_shown(source)
        if weights is None:
            return
        mask = None if weights is False else laid_over_storage(view, torch.as_tensor(weights).expand(view.shape))
        setattr(root, _WEIGHTS_JOINED, (mask, root._version))
        count_mask(root, WEIGHTS_MASKS_MADE)
