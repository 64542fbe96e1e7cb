"""A view of a tensor with all its strides: the identity the rules put on a tensor, laid out as the tensor is.

``x.view_as(x)`` recomputes the strides of the dimensions of size 1. A kernel that follows its input's layout (a
fused attention) may then lay its output out otherwise, and the layers after it sum in another order: values a
rounding apart from the plain call's, where the rules promise them bit for bit.
"""

from __future__ import annotations

import torch

__all__ = ["same_strides"]


def same_strides(x: torch.Tensor) -> torch.Tensor:
    """A view of ``x`` with its strides, those of its dimensions of size 1 too.

    Examples:
        >>> x = torch.zeros(2, 144, 1, 1).reshape(2, 1, 144, 1).permute(0, 1, 3, 2)[..., :48]
        >>> x.stride(), same_strides(x).stride(), x.view_as(x).stride()
        ((144, 144, 1, 1), (144, 144, 1, 1), (144, 48, 48, 1))
    """
    return x.as_strided(x.size(), x.stride(), x.storage_offset())
