"""The precision that sums over many evaluations run in: at least float32, whatever the model's dtype.

A method that sums over points of a path, noisy copies, occluding windows or orders of groups adds up many terms
(hundreds for a window slid by one over an image). In bfloat16 (8 bits of mantissa) a running sum stops growing
once it is 256 times the terms it adds, and a count of windows stops at 256: the sums run in float32 for a model
in half precision, in the model's dtype otherwise (float32 and float64 are unchanged), and the result is rounded
once to the input's dtype.

Examples:
    >>> import torch
    >>> accumulation_dtype(torch.bfloat16), accumulation_dtype(torch.float16), accumulation_dtype(torch.float64)
    (torch.float32, torch.float32, torch.float64)
    >>> total = torch.zeros((), dtype=torch.bfloat16)
    >>> for _ in range(300):
    ...     total += 1
    >>> total.item()  # where a bfloat16 count stops
    256.0
"""

from __future__ import annotations

import torch

__all__ = ["accumulation_dtype"]


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums over a method's evaluations run in for inputs of ``dtype``: float32 at least.

    Args:
        dtype: the input's floating-point dtype.

    Returns:
        ``dtype`` promoted with float32.
    """
    return torch.promote_types(dtype, torch.float32)
