"""Views of a gate, or of a tensor a gate is written into, whose gate marks went stale at an in-place write.

A gate (a sigmoid's output, see :mod:`~tdhook.attribution.rules.gates`) is marked, and so is a view of it
(``v = g[:, :2]``); a product of a marked gate with an activation holds the gate constant. An in-place write changes
what the elements of the tensor written into are, and so what each view of them shows, but a view taken before the
write kept its marks: ``v = c[:, :2]`` of a gate ``c``, then ``c.copy_(h)`` or ``c.mul_(h)``, left ``v`` a gate
(held in ``h2 * v``: 1.0 and 1.1 off, relative L2, under AttnLRP); ``v = c[:, :2]`` of an activation ``c``, then
``c.copy_(g)`` or ``c[:, :2] = g[:, :2]``, left ``v`` no gate (15.3 off).

:func:`note_gate_written` keeps, on the tensor viewed, a mask of its storage's elements, true where a gate is, and
the marks a gate there has; :func:`gate_marks_shown` tells, for a view of a tensor with such a mask, the marks it
has now: the gate's where every element it shows is one, none otherwise.
"""

from __future__ import annotations

import contextlib

import torch

from tdhook.attribution.rules._storage_masks import bytes_reached, count_mask, read_mask

__all__ = [
    "GATE_MASKS_MADE",
    "GATE_WRITTEN",
    "OTHER_GATES",
    "OTHER_MASKS_MADE",
    "gate_marks_shown",
    "note_gate_written",
]

# On a tensor an in-place write changed the gate elements of, where views of it may exist: a mask of its storage's
# elements, true where a gate is, and the marks (``{GATE_MARK: source, SIGMOID_MARK: True}``) a gate there has.
GATE_WRITTEN = "_tdhook_gate_written"
# On a view whose marks were read from such a mask: the mask, its version then, the gate's marks then, and the marks.
_GATE_SHOWN = "_tdhook_gate_shown"
#: On a join of gates and other activations: a mask of its storage's elements, true where a gate of any kind (or a
#: constant) went, and the join's version then (see :mod:`~tdhook.attribution.rules._mixed_gate_products`).
OTHER_GATES = "_tdhook_other_gates"
#: One entry a mask alive of :data:`OTHER_GATES` where no sigmoid-like gate tells the gates of another kind (a join of
#: them alone beside other activations, ``torch.cat([tanh(a), relu(h)], 1)``): products under CP-LRP look it up only
#: while one is.
OTHER_MASKS_MADE: list[bool] = []
#: One entry a mask alive (see :func:`~tdhook.attribution.rules._storage_masks.count_mask`): views pay for the
#: look-up only while one is.
GATE_MASKS_MADE: list[bool] = []


def note_gate_written(
    target: torch.Tensor, region: torch.Tensor | None, marks: dict | None, before: dict | None = None
) -> None:
    """Note that the elements ``region`` (a mask of ``target``'s shape; ``None``: all) of ``target`` are, after an
    in-place write, a gate with the marks ``marks`` (``None``: no gate). The mask of the tensor ``target`` views (or
    its own) is made, where it has none, true where that tensor was a gate before the write (``before``: its marks
    then, ``None`` where it was none).

    Examples:
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> c = x * 1  # an activation
        >>> row, other = c[0], c[1]
        >>> marks = {"_tdhook_activation_of": x, "_tdhook_sigmoid_gate": True}
        >>> note_gate_written(c, torch.tensor([[True] * 3, [False] * 3]), marks)  # a gate's values over row 0
        >>> bool(gate_marks_shown(row)), gate_marks_shown(other)
        (True, {})
    """
    # Bookkeeping, which a function mode of the call must not see. A tensor without a storage to read (one a
    # transform wraps, under torch.vmap) is not noted: its views keep their marks.
    with torch._C.DisableTorchFunction(), contextlib.suppress(RuntimeError, NotImplementedError), torch.no_grad():
        root = target if target._base is None else target._base
        record = root.__dict__.get(GATE_WRITTEN)
        if record is None:
            size = root.untyped_storage().nbytes() // root.element_size()
            mask = torch.full((size,), before is not None, dtype=torch.bool, device=root.device)
            record = [mask, dict(before or {})]
            setattr(root, GATE_WRITTEN, record)
            count_mask(root, GATE_MASKS_MADE)
        mask = record[0]
        if marks is not None:
            record[1] = dict(marks)
        if target.element_size() != root.element_size():  # a view as a dtype of another size (view_as_complex):
            mask &= ~bytes_reached(mask, root, target, region).any(1)  # no gate where it reaches, the rest as it was
            return
        shown = mask.as_strided(target.shape, target.stride(), target.storage_offset())
        if region is None:
            shown.fill_(marks is not None)
        else:
            shown.masked_fill_(region, marks is not None)


def gate_marks_shown(value: torch.Tensor) -> dict | None:
    """The gate marks of ``value``, a view of a tensor an in-place write changed the gate elements of (see
    :func:`note_gate_written`): the gate's where every element it shows is one, none (``{}``) otherwise; ``None``
    where ``value`` is no view, or the tensor it views has no mask (its own marks then tell).

    Examples:
        >>> gate_marks_shown(torch.ones(2)[:1]) is None  # no write noted
        True
    """
    return read_mask(value, GATE_MASKS_MADE, GATE_WRITTEN, _GATE_SHOWN, _shown_marks)


def _shown_marks(record: list, root: torch.Tensor, value: torch.Tensor) -> dict:
    """The marks of the gate in ``record`` (on ``root``) where every element ``value`` shows is one, else none."""
    if value.element_size() != root.element_size():
        return {}
    return record[1] if bool(record[0].as_strided(value.shape, value.stride(), value.storage_offset()).all()) else {}
