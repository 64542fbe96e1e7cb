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

from tdhook.attribution.rules._in_place_writes import GATE_MARKS, gate_marks_of, mark_written_in_place
from tdhook.attribution.rules._joined_weights import _WEIGHTS_JOINED, WEIGHTS_MARK, keep_weights_elements
from tdhook.attribution.rules._kept_gate_elements import keep_gate_elements

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
        if result._base is not None:
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
