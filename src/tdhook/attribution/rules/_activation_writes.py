"""Views of a tensor written into in place, whose mark (an activation, or computed from parameters alone) went stale.

The function modes mark a tensor computed from parameters alone (``weight * 2``, a view of it) so that a product
with it is a linear map, not a product of two activations (see
:func:`~tdhook.attribution.rules._autograd.mark_parameter_derived`). An in-place write changes what elements of the
tensor written into are (see :mod:`~tdhook.attribution.rules._in_place_writes`), and so what every view of them
shows, but a view taken before the write kept its mark: ``v = c.view(...)`` then ``c.copy_(h)`` left ``v`` a
constant to the rules, and a product ``v * g`` passed all of its relevance to ``g``; ``v = c[:, :2]`` of an
activation ``c``, then ``c.copy_(w)``, left ``v`` an activation (the weight's values it shows got the rule of an
activation: all of the relevance of ``v * g`` to ``v``, with a sigmoid gate ``g`` held, and none to the input).

:func:`note_activation_written` and :func:`note_weight_written` keep, on the tensor viewed, a mask of its storage's
elements, true where an activation is: made at the first write that puts an activation into a tensor that held none
there, or a weight's values over an activation. :func:`activation_shown` tells, for a view of a tensor with such a
mask, whether it shows an activation, whatever its mark; the tensor itself is marked by its mask at each write.
"""

from __future__ import annotations

import contextlib

import torch

from tdhook.attribution.rules._storage_masks import bytes_reached, count_mask, read_mask

__all__ = [
    "ACTIVATION_WRITTEN",
    "MASKS_MADE",
    "PARAMETER_DERIVED",
    "SHOWN",
    "activation_shown",
    "marked_parameter_derived",
    "note_activation_written",
    "note_weight_written",
]


# On a tensor some of whose elements an in-place write made activations or weights: a mask of its storage's
# elements, true where an activation is (see :func:`note_activation_written`).
ACTIVATION_WRITTEN = "_tdhook_activation_written"
# On a view whose class was read from such a mask: the mask, its version then, None, and the answer.
SHOWN = "_tdhook_activation_shown"
#: One entry a mask alive (see :func:`~tdhook.attribution.rules._storage_masks.count_mask`): views pay for the
#: look-up only while one is.
MASKS_MADE: list[bool] = []
# The attribute that marks a tensor computed from parameters alone (``gamma.reshape(...)``, ``1 + weight``).
PARAMETER_DERIVED = "_tdhook_parameter_derived"


def _mask(root: torch.Tensor, fill: bool) -> torch.Tensor:
    """The mask of ``root`` (see :data:`ACTIVATION_WRITTEN`), made with every element ``fill`` where it has none."""
    mask = root.__dict__.get(ACTIVATION_WRITTEN)
    if mask is None:
        size = root.untyped_storage().nbytes() // root.element_size()
        mask = torch.full((size,), fill, dtype=torch.bool, device=root.device)
        setattr(root, ACTIVATION_WRITTEN, mask)
        count_mask(root, MASKS_MADE)
    return mask


def _note(target: torch.Tensor, region: torch.Tensor | None, activation: bool, fill: bool | None) -> bool | None:
    """Set the elements ``region`` (a mask of ``target``'s shape; ``None``: all) of ``target`` in the mask of the
    tensor it views (or its own) to ``activation``; one is made, every element ``fill``, where there is none (none is
    made where ``fill`` is ``None``). Whether the tensor viewed holds an activation afterwards (``None`` where it has
    no mask)."""
    # Bookkeeping, which a function mode of the call must not see. A tensor without a storage to read (one a
    # transform wraps, under torch.vmap) is not noted: its views keep their marks.
    with torch._C.DisableTorchFunction(), contextlib.suppress(RuntimeError, NotImplementedError), torch.no_grad():
        root = target if target._base is None else target._base
        if fill is None and ACTIVATION_WRITTEN not in root.__dict__:
            return None
        mask = _mask(root, bool(fill))
        if target.element_size() == root.element_size():
            shown = mask.as_strided(target.shape, target.stride(), target.storage_offset())
            if region is None:
                shown.fill_(activation)
            else:
                shown.masked_fill_(region, activation)
        else:
            _note_bytes(mask, root, target, region, activation)
        return bool(mask.as_strided(root.shape, root.stride(), root.storage_offset()).any())
    return None


def _note_bytes(
    mask: torch.Tensor, root: torch.Tensor, target: torch.Tensor, region: torch.Tensor | None, activation: bool
) -> None:
    """:func:`_note` for ``target``, a view of ``root`` as a dtype of another size (``torch.view_as_complex``): an
    activation makes every element of ``root`` it touches one, a weight those it covers whole."""
    elements = bytes_reached(mask, root, target, region)
    if activation:
        mask |= elements.any(1)
    else:
        mask &= ~elements.all(1)


def note_activation_written(target: torch.Tensor, region: torch.Tensor | None = None, made: bool = True) -> bool | None:
    """Note that an activation was written in place into ``target`` (the elements ``region``, a mask of its shape,
    where given): views of the same tensor that show an element written then show an activation (see
    :func:`activation_shown`). A mask is made, every other element a weight, where the tensor viewed has none and
    ``made``; where it has none and not ``made`` (it was an activation, every element of it) nothing is noted. Whether
    the tensor viewed holds an activation afterwards (``None`` where it has no mask), which is what it is.

    Examples:
        >>> from tdhook.attribution.rules._autograd import is_activation, mark_parameter_derived
        >>> weight = torch.nn.Parameter(torch.ones(2, 3))
        >>> table = mark_parameter_derived((weight,), weight * 2)
        >>> row, other = (mark_parameter_derived((table,), table[i]) for i in (0, 1))  # views, of parameters alone
        >>> table[0] = torch.ones(3, requires_grad=True) * 5  # an activation written over it
        >>> is_activation(row)
        False
        >>> note_activation_written(table, torch.tensor([[True] * 3, [False] * 3]))
        True
        >>> is_activation(row), is_activation(other)  # the row written shows an activation, the other does not
        (True, False)
    """
    return _note(target, region, True, False if made else None)


def note_weight_written(target: torch.Tensor, region: torch.Tensor | None = None, made: bool = False) -> bool | None:
    """Note that values computed from parameters alone replaced elements of ``target`` (the elements ``region``, a
    mask of its shape, where given: ``copy_``, ``fill_``, ``target[key] = w``, ``index_put_``): views of the same tensor
    that show only such elements, or elements no activation was written into, show a weight. A mask is made, every
    other element an activation, where the tensor viewed has none and ``made`` (it was an activation); where it has
    none and not ``made`` (it held no activation) nothing is noted. Whether the tensor viewed holds an activation
    afterwards (``None`` where it has no mask).

    Examples:
        >>> from tdhook.attribution.rules._autograd import is_activation
        >>> x = torch.ones(2, 3, requires_grad=True)
        >>> table = x * 2  # an activation
        >>> row, other = table[0], table[1]
        >>> note_weight_written(table, torch.tensor([[True] * 3, [False] * 3]), made=True)  # a weight over row 0
        True
        >>> is_activation(row), is_activation(other)
        (False, True)
    """
    return _note(target, region, False, True if made else None)


def activation_shown(value: torch.Tensor) -> bool | None:
    """Whether ``value``, a view of a tensor written into in place, shows an element of it that is an activation (see
    :func:`note_activation_written`): ``None`` where ``value`` is no view, or the tensor it views has no mask (its
    mark then tells)."""
    return read_mask(value, MASKS_MADE, ACTIVATION_WRITTEN, SHOWN, _shows_activation)


def _shows_activation(mask: torch.Tensor, root: torch.Tensor, value: torch.Tensor) -> bool:
    return bool(_shown_mask(mask, root, value).any())


def _shown_mask(mask: torch.Tensor, root: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The elements of ``mask`` (of ``root``'s storage) that ``value`` shows; for a view as a dtype of another size
    (``torch.view_as_real`` of a complex tensor), those of the bytes it shows, one more dimension."""
    size, own = value.element_size(), root.element_size()
    if size == own:
        return mask.as_strided(value.shape, value.stride(), value.storage_offset())
    strides = (*(stride * size for stride in value.stride()), 1)
    return mask.repeat_interleave(own).as_strided((*value.shape, size), strides, value.storage_offset() * size)


def marked_parameter_derived(value: torch.Tensor) -> bool:
    """Whether ``value``, a tensor with autograd history, is marked as computed from parameters alone (see
    :func:`~tdhook.attribution.rules._autograd.mark_parameter_derived`): for a view of a tensor written into in
    place, whether it shows no activation, whatever its mark said before the write (see :func:`activation_shown`).

    Examples:
        >>> from tdhook.attribution.rules._autograd import mark_parameter_derived
        >>> weight = torch.nn.Parameter(torch.ones(3))
        >>> doubled = mark_parameter_derived((weight,), weight * 2)
        >>> marked_parameter_derived(doubled), marked_parameter_derived(weight * 1)
        (True, False)
    """
    shown = activation_shown(value) if MASKS_MADE else None  # a view of a tensor written into in place: what it shows
    return getattr(value, PARAMETER_DERIVED, False) if shown is None else not shown
