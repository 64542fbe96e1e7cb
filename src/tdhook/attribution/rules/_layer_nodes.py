"""Where the first-layer walks stop: the autograd nodes of layers.

The first-layer rule goes on the layers the model's input reaches through glue alone; the walks that decide it (and
the glue checks of the rules that set relevance at zero inputs) go back from a layer's input and stop at a layer's
output. The outputs of layers with a rule are marked as such (``node.metadata[LAYER_MARK]``); a layer without one
(``nn.RNN``, ``nn.Bilinear``, a module of one's own that calls ``F.conv2d`` or ``F.linear`` with its own weight)
leaves no mark, but its product with a weight computed from parameters is in the graph: a walk stops there too.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> x, weight = torch.randn(2, 3, requires_grad=True), nn.Parameter(torch.randn(3, 2))
    >>> is_layer_node((x @ weight).grad_fn), is_layer_node((x @ x.T).grad_fn), is_layer_node((x * 2).grad_fn)
    (True, False, False)
    >>> frozen, basis = nn.Parameter(torch.randn(2, 3), requires_grad=False), torch.randn(2, 3)
    >>> is_layer_node((x @ frozen.T).grad_fn), is_layer_node((x @ basis.T).grad_fn)  # a frozen weight, a buffer's
    (True, False)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["LAYER_CALL", "LAYER_MARK", "is_layer_node"]

LAYER_MARK = "tdhook_layer"  # the autograd metadata key set on the outputs of layers with a rule
# The autograd metadata key under which a layer's output node holds its LayerCall (see rules/_concatenated_layers.py).
LAYER_CALL = "tdhook_layer_call"

# The autograd nodes of products of an activation by a weight (matrix products, convolutions, bilinear maps and
# fused recurrent kernels): a layer's, where one factor is computed from parameters alone.
_WEIGHT_PRODUCTS = frozenset(
    "MmBackward0 AddmmBackward0 BmmBackward0 BaddbmmBackward0 AddbmmBackward0 MvBackward0 AddmvBackward0 "
    "ConvolutionBackward0 TrilinearBackward0 CudnnRnnBackward0 MiopenRnnBackward0 MkldnnRnnLayerBackward0".split()
)
_FROM_PARAMETERS = "tdhook_from_parameters"  # a node's cached answer to _from_parameters
# The operands a product's node saves, where a frozen weight is found.
_SAVED_OPERANDS = ("_saved_mat2", "_saved_self", "_saved_mat1", "_saved_weight", "_saved_vec", "_saved_batch1")
_SAVED_OPERANDS += ("_saved_batch2",)


def is_layer_node(node: Any) -> bool:
    """Whether the autograd ``node`` is a layer's output: marked as one, or a product of an activation by a weight
    computed from parameters alone."""
    if node.metadata.get(LAYER_MARK, False):
        return True
    if type(node).__name__ not in _WEIGHT_PRODUCTS:
        return False
    sources = [_from_parameters(n) for n, _ in node.next_functions if n is not None]
    if any(sources):
        return not all(sources)
    return bool(sources) and _frozen_weight(node)


def _frozen_weight(node: Any) -> bool:
    """Whether one of the tensors the product ``node`` saved is a parameter that does not require grad, or a view of
    one (a frozen model's weight, ``model.requires_grad_(False)``: no edge of the graph leads to it)."""
    with torch._C.DisableTorchFunction():  # an inspection, which a function mode of the call must not see
        for name in _SAVED_OPERANDS:
            try:
                saved = getattr(node, name, None)
            except RuntimeError:  # freed by a backward pass
                return False
            if isinstance(saved, nn.Parameter) or isinstance(getattr(saved, "_base", None), nn.Parameter):
                return True
    return False


def _from_parameters(node: Any) -> bool:
    """Whether every leaf behind ``node`` is an ``nn.Parameter`` (a weight, or one computed from weights)."""
    cached = node.metadata.get(_FROM_PARAMETERS)
    if cached is not None:
        return cached
    pending, seen, answer = [node], set(), True
    while pending and answer:
        current = pending.pop()
        if current in seen:
            continue
        seen.add(current)
        variable = getattr(current, "variable", None)
        if variable is not None:
            answer = isinstance(variable, nn.Parameter)
            continue
        pending.extend(n for n, _ in current.next_functions if n is not None)
    node.metadata[_FROM_PARAMETERS] = answer
    return answer
