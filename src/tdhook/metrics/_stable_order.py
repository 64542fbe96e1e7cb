"""The order of a stable sort of float32 values along their last dimension, from a sort of unique integer keys.

A stable sort of attributions (ties go to the lower index) is the fixed cost of every perturbation curve. On CPU,
``torch.sort(..., stable=True)`` runs a merge sort whose branches cost about 0.3 ms for 8 × 768 floats. The same
order comes from a sort of int64 keys that are all distinct: the high 32 bits map each float32 to an integer with
the same order (its bits, with the magnitude bits of negatives flipped, and ``-0.0`` taken as ``0.0``), the low 32
bits hold the element's index. Distinct keys have one sorted order, which any sort algorithm finds, so numpy's
vectorised (unstable) sort gives exactly the stable order, about three times faster. The keys are built with numpy
too (0.09 ms for the keys and the sort of 8 × 768 fresh values, 0.16 ms with torch's operations). NaN, other dtypes
and other devices take ``torch.sort``.

Examples:
    >>> import torch
    >>> values = torch.tensor([[0.5, 2.0, 0.5, -0.0, 0.0, -1.0]])
    >>> stable_order(values, descending=True)
    tensor([[1, 0, 2, 3, 4, 5]])
    >>> torch.equal(stable_order(values, descending=False), torch.sort(values, stable=True).indices)
    True
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["stable_order"]

# The magnitude bits of a float32: flipped in negatives, so that a larger magnitude gives a smaller key.
_MAGNITUDE = 0x7FFFFFFF
_INDEX_BITS = 32


def stable_order(values: torch.Tensor, descending: bool = True, nan_free: bool = False) -> torch.Tensor:
    """The indices that sort ``values`` along the last dimension, ties in index order (``torch.sort``'s stable order).

    Args:
        values: the values, of any shape.
        descending: largest first (ties still go to the lower index).
        nan_free: the caller has checked that ``values`` hold no NaN (the check is then skipped).

    Returns:
        ``int64`` indices of ``values``' shape, as ``torch.sort(values, dim=-1, descending=descending,
        stable=True).indices``.
    """
    if not _keyable(values, nan_free):
        return torch.sort(values, dim=-1, descending=descending, stable=True).indices
    # numpy's operations on a few thousand elements cost about a microsecond each, torch's three to five.
    bits = (values.detach().numpy() + np.float32(0.0)).view(np.int32)  # + 0.0: -0.0 becomes 0.0, its equal
    # Flipped so that the order of the keys is that of the values: the magnitude bits of negatives (the sign bit
    # gives the order of the signs), and for a descending sort every bit (~k reverses the order).
    flips = ~(bits >> 31) | np.int32(-(1 << 31)) if descending else (bits >> 31) & np.int32(_MAGNITUDE)
    keys = (bits ^ flips).astype(np.int64)
    keys <<= _INDEX_BITS
    keys |= np.arange(values.shape[-1], dtype=np.int64)
    keys.sort(axis=-1)
    keys &= (1 << _INDEX_BITS) - 1
    return torch.from_numpy(keys)


def _keyable(values: torch.Tensor, nan_free: bool) -> bool:
    """Whether ``values`` fit the keys: float32 on CPU, a last dimension below 2³², and no NaN (``torch.sort`` puts
    every NaN first in a descending sort; their bits would not)."""
    return (
        values.dtype == torch.float32
        and values.device.type == "cpu"
        and values.dim() > 0
        and values.shape[-1] < 1 << _INDEX_BITS
        and (nan_free or not bool(np.isnan(values.detach().numpy()).any()))
    )
