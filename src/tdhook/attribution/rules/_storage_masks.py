"""Masks over a tensor's storage, kept on the tensor, that the in-place write modules share.

:mod:`~tdhook.attribution.rules._activation_writes` keeps, on a tensor written into in place, a mask of its storage's
elements, true where an activation is; :mod:`~tdhook.attribution.rules._gate_writes` one true where a gate is. Views
of the tensor read them. What both need, once:

* :func:`count_mask`: a count of the masks alive, so that a view pays for the look-up only while one is. (A count
  that never fell, a flag set at the first mask of the process, made every later product of every call look: four
  times the cost of the gate test of a product.)
* :func:`read_mask`: what a view reads from the mask of the tensor it views, kept on the view until the mask
  changes.
* :func:`bytes_reached`: the elements a view as a dtype of another size (``torch.view_as_complex``) reaches.
* :func:`laid_over_storage`: a mask of a tensor's shape laid over its storage's elements, for its views to read;
  :func:`shown_of_storage`: what a view reads of it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["bytes_reached", "count_mask", "laid_over_storage", "read_mask", "rearranged_mask", "shown_of_storage"]


def count_mask(root: torch.Tensor, made: list[bool]) -> None:
    """Count a mask just kept on ``root`` in ``made`` (one entry a mask) until ``root`` is freed: ``made`` is empty
    while no mask is alive.

    Examples:
        >>> import gc
        >>> made, root = [], torch.zeros(3)
        >>> count_mask(root, made)
        >>> made
        [True]
        >>> del root
        >>> _ = gc.collect()
        >>> made
        []
    """
    made.append(True)
    weakref.finalize(root, _uncount, made).atexit = False


def _uncount(made: list[bool]) -> None:
    if made:
        made.pop()


def read_mask(
    value: torch.Tensor,
    made: list[bool],
    attribute: str,
    shown: str,
    read: Callable[[Any, torch.Tensor, torch.Tensor], Any],
) -> Any:
    """What ``value``, a view, reads from the record kept at ``attribute`` (a mask, or a list of a mask and what it
    marks) on the tensor it views: ``read(record, tensor, value)``, kept on ``value`` at ``shown`` until the mask, or
    what it marks, changes; ``None`` where ``value`` is no view, that tensor has no record, no mask is alive (``made``
    is empty, see :func:`count_mask`) or the mask has no values to read (the meta device).

    Examples:
        >>> root, made = torch.zeros(4), []
        >>> root.mask_here = torch.tensor([True, True, False, False])
        >>> count_mask(root, made)
        >>> def every(mask, tensor, view):
        ...     return bool(mask.as_strided(view.shape, view.stride(), view.storage_offset()).all())
        >>> [read_mask(view, made, "mask_here", "read_here", every) for view in (root[:2], root[1:], root)]
        [True, False, None]
    """
    if not made:
        return None
    with torch._C.DisableTorchFunction():  # an inspection, which a function mode of the call must not see
        root = value._base
        record = None if root is None else root.__dict__.get(attribute)
        if record is None:
            return None
        mask, marks = _parts(record)
        seen = value.__dict__.get(shown)
        if seen is not None and seen[0] is mask and seen[1] == mask._version and seen[2] is marks:
            return seen[3]
        try:
            answer = read(record, root, value)
        except (RuntimeError, NotImplementedError):  # a mask on the meta device: no values to read
            return None
        setattr(value, shown, (mask, mask._version, marks, answer))
        return answer


def _parts(record: Any) -> tuple[torch.Tensor, Any]:
    """The mask of ``record`` (a mask, or a list of a mask and what it marks) and what it marks (``None``: nothing)."""
    return (record, None) if isinstance(record, torch.Tensor) else (record[0], record[1])


def bytes_reached(
    mask: torch.Tensor, root: torch.Tensor, target: torch.Tensor, region: torch.Tensor | None
) -> torch.Tensor:
    """Which bytes of each element of ``root``'s storage (``mask``'s elements, one row each) the elements ``region``
    (a mask of ``target``'s shape; ``None``: all) of ``target`` reach, ``target`` a view of ``root`` as a dtype of
    another size (``torch.view_as_complex``, ``torch.view_as_real``).

    Examples:
        >>> root = torch.zeros(4, dtype=torch.float64)
        >>> target = torch.view_as_complex(root.view(2, 2))  # complex elements, each two of root's
        >>> bytes_reached(torch.zeros(4, dtype=torch.bool), root, target, torch.tensor([False, True])).all(1).tolist()
        [False, False, True, True]
    """
    size, own = target.element_size(), root.element_size()
    touched = torch.zeros(mask.numel() * own, dtype=torch.bool, device=mask.device)
    strides = (*(stride * size for stride in target.stride()), 1)
    part = touched.as_strided((*target.shape, size), strides, target.storage_offset() * size)
    if region is None:
        part.fill_(True)
    else:
        part.masked_fill_(region.unsqueeze(-1), True)
    return touched.view(-1, own)


def laid_over_storage(tensor: torch.Tensor, region: torch.Tensor) -> torch.Tensor | None:
    """``region``, a mask of ``tensor``'s shape, laid over the elements of ``tensor``'s storage (false where
    ``tensor`` shows none), so that a view of ``tensor`` reads its part with its own strides and offset (a tensor in
    channels-last layout, or a copy of a transposed view, keeps its elements' strides); ``None`` where ``tensor`` has
    no storage to read (the meta device) or shows an element more than once.

    Examples:
        >>> tensor = torch.zeros(3, 2).t().clone()  # a copy of a transposed view: its storage laid out transposed
        >>> mask = laid_over_storage(tensor, torch.tensor([[True, False, False], [False, False, True]]))
        >>> mask.tolist(), mask.as_strided((3,), (2,), 1).tolist()  # the storage; the view tensor[1]
        ([True, False, False, False, False, True], [False, False, True])
    """
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        try:
            mask = torch.zeros(
                tensor.untyped_storage().nbytes() // tensor.element_size(), dtype=torch.bool, device=tensor.device
            )
            mask.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset()).copy_(region)
        except (RuntimeError, NotImplementedError):
            return None
        return mask


def shown_of_storage(value: torch.Tensor, attribute: str) -> torch.Tensor | bool | None:
    """What ``value`` (a tensor, or a view of one) shows of the mask its tensor keeps at ``attribute``, a mask laid
    over its storage (see :func:`laid_over_storage`) and the tensor's version then: a mask of ``value``'s shape;
    ``None`` where no mask is kept, ``False`` where it is not known (the tensor written into in place since, no mask
    laid, or ``value`` a view as a dtype of another size).

    Examples:
        >>> tensor = torch.zeros(2, 3)
        >>> tensor.mask_here = (laid_over_storage(tensor, torch.tensor([[True] * 3, [False] * 3])), tensor._version)
        >>> shown_of_storage(tensor[:, 1], "mask_here").tolist(), shown_of_storage(tensor, "other")
        ([True, False], None)
        >>> _ = tensor.add_(1)
        >>> shown_of_storage(tensor[:, 1], "mask_here")  # written into since
        False
    """
    with torch._C.DisableTorchFunction(), torch.no_grad():  # an inspection, which a function mode must not see
        root = value if value._base is None else value._base
        noted = root.__dict__.get(attribute)
        if noted is None:
            return None
        if noted[1] != root._version or noted[0] is None or value.element_size() != root.element_size():
            return False
        return noted[0].as_strided(value.shape, value.stride(), value.storage_offset())


def rearranged_mask(
    mask: torch.Tensor, rearranged: Callable[[torch.Tensor], torch.Tensor] | None, shape: torch.Size
) -> torch.Tensor | None:
    """``rearranged(mask)`` (the call that made a new tensor of ``shape`` from one ``mask`` is of, made on the mask;
    ``None``: the same places), where no function mode sees it; ``None`` where the call cannot take a mask, or gives
    another shape.

    Examples:
        >>> mask = torch.tensor([[True, False]])
        >>> rearranged_mask(mask, lambda m: m.flip(1), torch.Size([1, 2])).tolist()
        [[False, True]]
        >>> rearranged_mask(mask, None, torch.Size([2, 1])) is None
        True
    """
    with torch._C.DisableTorchFunction(), torch.no_grad():  # bookkeeping, which a function mode must not see
        try:
            region = mask if rearranged is None else rearranged(mask)
        except (RuntimeError, TypeError, NotImplementedError):  # a call a mask cannot take
            return None
    return region if isinstance(region, torch.Tensor) and region.shape == shape else None
