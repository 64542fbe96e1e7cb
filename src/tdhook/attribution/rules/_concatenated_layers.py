"""The layers whose outputs a tensor concatenates along the channels, for a BatchNorm to merge into each of them.

timm's ``MixedConv2d`` (MixNet) splits its input's channels into groups, runs a convolution of its own kernel size on
each, and concatenates the outputs along the channels; a BatchNorm follows. Each of its channels is one layer's
output channel, so the BatchNorm merges into the layers channel by channel, as it merges into a single layer before
it (see :class:`~tdhook.attribution.rules.batch_norm.MergeBatchNormRule`).

The concatenation is read from the autograd graph: the tensor's node is a ``cat`` along dimension 1, and each of the
node's inputs is the node of a layer's output as the layer's rule returned it, which holds that call
(``node.metadata[LAYER_CALL]``, set where the output is marked). A part changed after the layer (a slice, an
activation, an in-place change) has a node of its own, and the concatenation is not merged.

Examples:
    >>> import torch
    >>> concatenated_layer_calls(torch.cat([torch.ones(1, 2, requires_grad=True) * 2, torch.ones(1, 3)], dim=1))
"""

from __future__ import annotations

from typing import Any

import torch

from tdhook.attribution.rules._layer_nodes import LAYER_CALL

__all__ = ["concatenated_layer_calls"]


def concatenated_layer_calls(tensor: Any) -> list | None:
    """The ``LayerCall`` of each part of ``tensor``, in order, where ``tensor`` is a concatenation along dimension 1
    of layers' unmodified outputs (each once) and, at most, one other tensor (``None`` in its place); else ``None``.
    At least one part is a layer's."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 2:
        return None
    node = tensor.grad_fn
    if node is None or type(node).__name__ != "CatBackward0" or node._saved_dim % tensor.dim() != 1:
        return None
    calls = []
    for part, _ in node.next_functions:
        call = None if part is None else part.metadata.get(LAYER_CALL)
        if call is not None and any(seen is not None and call.raw.data_ptr() == seen.raw.data_ptr() for seen in calls):
            return None
        calls.append(call)
    others = calls.count(None)
    return calls if others <= 1 and len(calls) - others >= 1 and len(calls) > 1 else None
