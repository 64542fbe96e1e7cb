"""Views whose mark as computed from parameters alone went stale: an activation written into what they show.

The function modes mark a tensor computed from parameters alone (``weight * 2``, a view of it) so that a product
with it is a linear map, not a product of two activations (see
:func:`~tdhook.attribution.rules._autograd.mark_parameter_derived`). An activation written in place into such a
tensor makes it an activation (see :mod:`~tdhook.attribution.rules._in_place_writes`), but a view of it taken
before the write kept its mark: ``v = c.view(...)`` then ``c.copy_(h)`` left ``v`` a constant to the rules, and a
product ``v * g`` passed all of its relevance to ``g``. :func:`note_activation_written` notes, on the tensor
viewed, which elements of its storage an activation was written into; :func:`overwritten_by_activation` tells a
view that shows one of them, which is then an activation whatever its mark.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

__all__ = ["ACTIVATION_WRITTEN", "note_activation_written", "note_weight_written", "overwritten_by_activation"]


# On a tensor computed from parameters alone that an activation was then written into: a mask of its storage's
# elements, true where the activation went (see :func:`note_activation_written`).
ACTIVATION_WRITTEN = "_tdhook_activation_written"


def note_activation_written(target: torch.Tensor, key: Any = None) -> None:
    """Note that an activation was written in place into ``target``, which was computed from parameters alone (or is a
    view of a tensor that was): views of the same tensor marked as such before the write and that show an element
    written then show an activation (see :func:`overwritten_by_activation`). ``key``, where given, selects the
    elements written (``target[key] = h``); one that selects no view (a list of indices) counts all of them.

    Examples:
        >>> from tdhook.attribution.rules._autograd import PARAMETER_DERIVED, is_activation, mark_parameter_derived
        >>> weight = torch.nn.Parameter(torch.ones(2, 3))
        >>> table = mark_parameter_derived((weight,), weight * 2)
        >>> row, other = (mark_parameter_derived((table,), table[i]) for i in (0, 1))  # views, of parameters alone
        >>> table[0] = torch.ones(3, requires_grad=True) * 5  # an activation written over it
        >>> setattr(table, PARAMETER_DERIVED, False)
        >>> is_activation(row)
        False
        >>> note_activation_written(table, 0)
        >>> is_activation(row), is_activation(other)  # the row written shows an activation, the other does not
        (True, False)
    """
    # Bookkeeping, which a function mode of the call must not see. A tensor without a storage to read (one a
    # transform wraps, under torch.vmap) is not noted: its views keep their marks.
    with torch._C.DisableTorchFunction(), contextlib.suppress(RuntimeError, NotImplementedError):
        root = target if target._base is None else target._base
        if key is not None:
            with torch.no_grad():
                part = target[key]
            target = part if part.untyped_storage().data_ptr() == root.untyped_storage().data_ptr() else target
        mask = root.__dict__.get(ACTIVATION_WRITTEN)
        if mask is None:
            size = root.untyped_storage().nbytes() // root.element_size()
            mask = torch.zeros(size, dtype=torch.bool, device=root.device)
            setattr(root, ACTIVATION_WRITTEN, mask)
        mask.as_strided(target.shape, target.stride(), target.storage_offset()).fill_(True)


def note_weight_written(target: torch.Tensor, key: Any = None) -> None:
    """Note that values computed from parameters alone replaced elements of ``target`` (``copy_``, ``fill_``,
    ``target[key] = w``): views marked as computed from parameters alone that show only such elements show a weight
    again, whatever activation was written there before (see :func:`note_activation_written`). ``key`` as there; one
    that selects no view notes nothing (the elements replaced are not known).

    Examples:
        >>> from tdhook.attribution.rules._autograd import is_activation, mark_parameter_derived
        >>> weight = torch.nn.Parameter(torch.ones(2, 3))
        >>> table = mark_parameter_derived((weight,), weight * 2)
        >>> row = mark_parameter_derived((table,), table[0])
        >>> note_activation_written(table)  # an activation written over all of it
        >>> is_activation(row)
        True
        >>> note_weight_written(table, 0)  # the row overwritten with a weight's values
        >>> is_activation(row)
        False
    """
    with torch._C.DisableTorchFunction(), contextlib.suppress(RuntimeError, NotImplementedError):
        root = target if target._base is None else target._base
        mask = root.__dict__.get(ACTIVATION_WRITTEN)
        if mask is None:
            return
        if key is not None:
            with torch.no_grad():
                part = target[key]
            if part.untyped_storage().data_ptr() != root.untyped_storage().data_ptr():
                return
            target = part
        mask.as_strided(target.shape, target.stride(), target.storage_offset()).fill_(False)


def overwritten_by_activation(value: torch.Tensor) -> bool:
    """Whether ``value``, a view marked as computed from parameters alone, shows an element of the tensor it views
    that an activation was written into since (see :func:`note_activation_written`): the mark is stale, and ``value``
    an activation."""
    with torch._C.DisableTorchFunction():  # an inspection, which a function mode of the call must not see
        root = value._base
        mask = None if root is None else root.__dict__.get(ACTIVATION_WRITTEN)
        if mask is None:
            return False
        if value.element_size() != root.element_size():  # a view as another dtype: its elements are not the mask's
            return True
        try:
            return bool(mask.as_strided(value.shape, value.stride(), value.storage_offset()).any())
        except (RuntimeError, NotImplementedError):  # a mask on the meta device: no values to read
            return False
