"""Gates of two kinds, or a gate of another kind beside an activation, in one tensor written in place.

A rule that holds gates of any kind (CP-LRP holds a tanh's output in a product, as a sigmoid's) reads where a tensor
is such a gate: its own marks where it is one in every element, a join's mask where a join of gates of another kind
and other activations made it (see :data:`~tdhook.attribution.rules._gate_writes.OTHER_GATES`). An in-place write
into part of a tensor that mixes the kinds (``c = relu(h) * 1; c[:, :3] = torch.tanh(a[:, :3])``, an activation's
values into part of a tanh's output, a tanh's into part of a sigmoid gate or the reverse) left it one kind in every
element, or none: the product with it held a signal's elements or shared a gate's (0.09-2.6 off, relative L2,
float64, under AttnLRP and CP-LRP, against the pieces multiplied apart). :func:`note_other_gates_written` notes
where a gate of any kind is after such a write; the sigmoid-like gates' elements are noted apart (see
:func:`~tdhook.attribution.rules._in_place_writes.note_gate_views`).
"""

from __future__ import annotations

import torch

from tdhook.attribution.rules._gate_writes import GATE_WRITTEN, OTHER_GATES, OTHER_MASKS_MADE
from tdhook.attribution.rules._storage_masks import count_mask

__all__ = ["note_other_gates_written"]


def note_other_gates_written(
    target: torch.Tensor, region: torch.Tensor, written: bool, before: bool, prior: tuple | None
) -> None:
    """Note on the tensor ``target`` views (or on itself), after an in-place write into the elements ``region`` (a
    mask of ``target``'s shape) of ``target``, where a gate of any kind is: ``written``, whether what is written is
    one; ``before``, whether the tensor was one in every element; ``prior``, its mask of such gates read before the
    write (``(mask, version then, version before the write)``), or ``None``.

    Examples:
        >>> from tdhook.attribution.rules._joined_gates import other_gates_shown
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> c = x * 2  # an activation
        >>> c[:, :1] = torch.tanh(x[:, :1])  # a gate of another kind over its first column
        >>> note_other_gates_written(c, torch.tensor([[True, False, False]] * 2), True, False, None)
        >>> other_gates_shown(c).tolist()
        [[True, False, False], [True, False, False]]
    """
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        base = target._base
        root = target if base is None else base
        try:
            size = root.untyped_storage().nbytes() // root.element_size()
            record = root.__dict__.get(GATE_WRITTEN)
            if prior is not None and prior[0] is not None and prior[1] == prior[2]:
                mask = prior[0].clone()
            elif before:
                mask = torch.ones(size, dtype=torch.bool, device=root.device)
            elif record is not None and record[1]:  # gates written in before (of one kind): where they are
                mask = record[0].clone()
            else:
                mask = torch.zeros(size, dtype=torch.bool, device=root.device)
            if target.element_size() != root.element_size():  # a view as a dtype of another size: not known
                root.__dict__[OTHER_GATES] = (None, root._version)
                return
            mask.as_strided(target.shape, target.stride(), target.storage_offset()).masked_fill_(region, written)
        except (RuntimeError, NotImplementedError):  # no storage to read (under torch.vmap)
            root.__dict__.pop(OTHER_GATES, None)
            return
        noted = OTHER_GATES in root.__dict__
        root.__dict__[OTHER_GATES] = (mask, root._version)
    if not noted:
        count_mask(root, OTHER_MASKS_MADE)
