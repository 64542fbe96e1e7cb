"""A ruled module's call that computed from a parameter or buffer on the ``meta`` device.

torch computes ``F.linear`` of an input on the CPU with a weight on the meta
device and a bias on the CPU, and returns a tensor of whatever the memory held:
no error, and the relevance of those values. A module that holds such a tensor
is not refused before its call, since a network may swap the real tensors in for
the call (torchrl's multi-agent networks call their template network so): the
call that returns an output off the meta device is refused.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["raise_for_meta_tensors"]


def raise_for_meta_tensors(module: nn.Module, output: torch.Tensor) -> None:
    """Raise a ``ValueError`` (``error.module`` is ``module``) where ``module`` holds a parameter or buffer on the
    meta device and its ``output`` is not there.

    Examples:
        >>> layer = nn.Linear(2, 1)
        >>> layer.weight = nn.Parameter(torch.empty(1, 2, device="meta"))
        >>> raise_for_meta_tensors(layer, layer(torch.ones(1, 2)))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: Linear holds its parameter 'weight' on the meta device, ... output on cpu from it
    """
    if output.is_meta:
        return
    for kind, tensors in (("parameter", module._parameters), ("buffer", module._buffers)):
        for name, tensor in tensors.items():
            if tensor is not None and tensor.is_meta:
                error = ValueError(
                    f"{type(module).__name__} holds its {kind} {name!r} on the meta device, which holds no values, "
                    f"and computed an output on {output.device} from it"
                )
                error.module = module  # type: ignore[attr-defined]
                raise error
