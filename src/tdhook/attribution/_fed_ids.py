"""Whether a tensor an embedding reads is the token ids fed for an explained input, and whether it looked them up.

It is where it is the fed tensor, a reshaped view of it (GPT-2 flattens its input_ids), or the fed ids put back
together from their slices: a lazily stacked TensorDict holds an input written into it as slices, one per stacked
TensorDict, and stacks them anew at each read (:func:`restacks`, seen by the tracking of
:class:`~tdhook.attribution._tokens.TokenInputs`, which marks the result with :func:`mark_restacked`).

Examples:
    >>> import torch
    >>> ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    >>> read = torch.stack(ids.unbind(0))
    >>> reads_fed_ids(ids.flatten(), ids), reads_fed_ids(read, ids)
    (True, False)
    >>> mark_restacked(read, ids)
    >>> reads_fed_ids(read, ids)
    True
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["RESTACKING", "looks_up_ids", "mark_restacked", "reads_fed_ids", "restacks"]

# The fed ids that a tensor puts back together from their slices (a lazy stack's read of them): it is those ids.
RESTACKED = "_tdhook_restacked_ids"
# The calls that may put the fed ids back together from their slices: ``torch.stack``, and ``pad_sequence`` of slices
# of one length (a lazy stack's read ``td.get(key, as_padded_tensor=True)``, as torchrl's LLM wrappers read tokens).
RESTACKING = frozenset({"stack", "pad_sequence"})


def mark_restacked(tensor: torch.Tensor, fed: torch.Tensor) -> None:
    """Mark ``tensor`` as the fed ids ``fed``, or a part of them (a view), put back together from their slices: as
    long as nothing writes into it (its version counter then moves, and the mark no longer holds)."""
    setattr(tensor, RESTACKED, (fed, tensor._version))


def _restacked(tensor: object) -> torch.Tensor | None:
    """What of the fed ids ``tensor`` holds by its mark (see :func:`mark_restacked`), unless it was written since."""
    mark = getattr(tensor, RESTACKED, None)
    return mark[0] if mark is not None and mark[1] == tensor._version else None


def reads_fed_ids(arg: object, tokens: torch.Tensor) -> bool:
    """Whether an embedding's input ``arg`` is the fed ``tokens``, or a reshaped view of them (GPT-2 flattens its
    input_ids)."""
    if arg is tokens or _restacked(arg) is tokens:
        return True
    if not isinstance(arg, torch.Tensor) or arg._base is None or arg.numel() != tokens.numel():
        return False
    return arg._base is tokens or _restacked(arg._base) is tokens


def _same_view(tensor: torch.Tensor, part: torch.Tensor) -> bool:
    """Whether ``tensor`` reads the elements ``part`` reads, in its layout (the stride of a dimension of one element
    is not read)."""
    return (
        tensor.untyped_storage().data_ptr() == part.untyped_storage().data_ptr()
        and tensor.storage_offset() == part.storage_offset()
        and tensor.shape == part.shape
        and all(a == b for a, b, n in zip(tensor.stride(), part.stride(), part.shape, strict=True) if n > 1)
    )


def restacks(fed: torch.Tensor, args: tuple, kwargs: dict, name: str = "stack") -> torch.Tensor | None:
    """What of the fed ids ``fed`` the call ``torch.stack(tensors, dim)`` (``name``: one of :data:`RESTACKING`; a
    ``pad_sequence`` of slices of one length pads nothing, and stacks them) puts back together from their slices
    along ``dim``, in their order: ``fed`` itself (a lazily stacked TensorDict's read of the ids written into it), a
    part of it (an inner stack's read, where a lazy stack holds lazy stacks: the slices of a slice), or ``None``.
    A slice is a view of ``fed``, or a tensor marked by :func:`mark_restacked` as a part of it. To be called with
    the function modes off.

    Examples:
        >>> ids = torch.tensor([[1, 2], [3, 4]])
        >>> restacks(ids, (ids.unbind(1), 1), {}) is ids, restacks(ids, (ids.unbind(1)[::-1], 1), {})
        (True, None)
        >>> row = restacks(ids, (ids[1].unbind(0), 0), {})  # the slices of a slice: that slice
        >>> row.tolist(), _same_view(row, ids[1])
        ([3, 4], True)
    """
    if name == "pad_sequence":
        args, kwargs = _as_stack(args, kwargs)
    tensors = args[0] if args else kwargs.get("tensors")
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not tensors or not isinstance(dim, int) or fed.dim() == 0:
        return None
    parts = [  # an inner stack's read: its part of fed (a tensor marked but written since is none)
        tensor if getattr(tensor, RESTACKED, None) is None else _restacked(tensor) for tensor in tensors
    ]
    if not all(isinstance(part, torch.Tensor) for part in parts):
        return None
    first = parts[0]
    if first.untyped_storage().data_ptr() != fed.untyped_storage().data_ptr() or first.dim() >= fed.dim():
        return None
    dim = dim % (first.dim() + 1)
    step = parts[1].storage_offset() - first.storage_offset() if len(parts) > 1 else 0
    if step < 0 or any(part.storage_offset() != first.storage_offset() + k * step for k, part in enumerate(parts)):
        return None  # not the slices of one view, in order
    shape, stride = list(first.shape), list(first.stride())
    shape.insert(dim, len(parts))
    stride.insert(dim, step)
    whole = fed.as_strided(shape, stride, first.storage_offset())  # what the slices are the slices of, if anything
    if not all(_same_view(part, whole.select(dim, position)) for position, part in enumerate(parts)):
        return None
    if _same_view(whole, fed):
        return fed
    inside = fed.storage_offset() <= whole.storage_offset() and whole.numel() < fed.numel()
    return whole if inside else None


def _as_stack(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments of ``torch.stack`` that put together what ``pad_sequence(sequences, batch_first, ...)`` does,
    where its sequences are all of one shape (no padding); else none (an empty list of tensors).

    Examples:
        >>> ids = torch.tensor([[1, 2], [3, 4]])
        >>> _as_stack((ids.unbind(0), True), {})[0][1], _as_stack((ids.unbind(0),), {})[0][1]
        (0, 1)
        >>> _as_stack(([ids[0], ids[1, :1]], True), {})
        (([], 0), {})
    """
    sequences = args[0] if args else kwargs.get("sequences")
    batch_first = args[1] if len(args) > 1 else kwargs.get("batch_first", False)
    if not isinstance(sequences, (list, tuple)) or len({getattr(s, "shape", None) for s in sequences}) != 1:
        return ([], 0), {}
    return (sequences, 0 if batch_first else 1), {}


def looks_up_ids(embedding: nn.Module, ids: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether ``output`` is the rows of ``embedding``'s table that ``ids`` select, up to one scale (a scaled
    word embedding, as Gemma's and BART's): not so for an embedding that reads ids only for their shape and looks
    up positions."""
    weight = getattr(embedding, "weight", None)
    if not isinstance(weight, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64):
        return True  # nothing to compare with: taken as a lookup
    with torch.no_grad():
        rows = nn.functional.embedding(ids, weight).to(output.dtype)
        if rows.shape != output.shape:
            return False
        scale = (rows * output).sum() / (rows * rows).sum().clamp_min(torch.finfo(rows.dtype).tiny)
        return bool(torch.allclose(output, scale * rows))
