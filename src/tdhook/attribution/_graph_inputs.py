"""An activation's input computed again from the nodes below it, where no node saved it and no module returned it.

Gemma 2 caps its attention logits and its final logits as ``tanh(a / c) · c``: ``TanhBackward0`` saves the tanh's
output, the division by a number saves the number, and ``a / c`` is no module's output (see
:mod:`~tdhook.attribution._kept_outputs`), so the identity rule's factor ``tanh(x) / x`` had no ``x`` to be
computed from, and every call ran in the function mode. The nodes below it hold what computed it: ``a`` is a
``matmul``'s output (``q · kᵀ · s``, or the head's ``Linear`` without a bias), whose ``bmm`` or ``mm`` node saved
both factors. So a chain of such nodes (products and quotients by a number, one view, then a ``bmm`` or ``mm``)
computes ``x`` again with the forward's own operations on the same tensors: a recording call keeps the chain's node
types only where that gives ``x`` to the last bit, and a later call follows the same types from the activation's node.

Examples:
    >>> import torch
    >>> q, k = torch.randn(2, 3, 4, requires_grad=True), torch.randn(2, 4, 3, requires_grad=True)
    >>> x = torch.matmul(q, k) * 0.5 / 30.0
    >>> chain = chain_of(x, {})
    >>> chain
    ('DivBackward0', 'MulBackward0', 'UnsafeViewBackward0', 'BmmBackward0')
    >>> torch.equal(computed_again(torch.tanh(x).grad_fn, chain, x.shape), x)
    True
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["chain_of", "computed_again"]

# A chain's nodes: a product or quotient by a number (its node saved the number), a view, and a matmul's own node.
_BY_NUMBER = {"MulBackward0": torch.mul, "DivBackward0": torch.div}
_VIEWS = frozenset({"ViewBackward0", "UnsafeViewBackward0"})
_PRODUCTS = {"BmmBackward0": torch.bmm, "MmBackward0": torch.mm}
_LONGEST = 6  # nodes in a chain, at most

# Inputs of up to this many elements are computed again; a larger one keeps the mode. The chain's ``bmm`` costs
# what the attention logits' product costs in the forward pass: at a realistic size (a Gemma 2 of hidden size 256,
# 4 layers, 4 × 128 tokens, 262k elements in each layer's logits) AttnLRP took 1.13-1.21x a gradient pass with its
# inputs computed again, 1.04-1.08x in the mode (one CPU thread).
_LARGEST = 2**14


def chain_of(x: torch.Tensor, skipped: dict[int, Any]) -> tuple[str, ...] | None:
    """The node types of the chain that computes ``x`` again (see the module), from ``x``'s node down; ``None`` where
    there is none, where it does not give ``x`` to the last bit, or where ``x`` is large (the mode costs less there).
    ``skipped``: by id, nodes of the function mode's own (a product's gradient factor) and the nodes a plain call has
    in their place."""
    if x.numel() > _LARGEST:
        return None
    node, kinds = x.grad_fn, []
    while node is not None and len(kinds) < _LONGEST:
        node = skipped.get(id(node), node)
        kind = type(node).__name__
        kinds.append(kind)
        if kind in _PRODUCTS:
            break
        if kind not in _BY_NUMBER and kind not in _VIEWS:
            return None
        node = node.next_functions[0][0]
    else:
        return None
    chain = tuple(kinds)
    if sum(kind in _VIEWS for kind in chain) > 1:
        return None  # a view below another: its shape is not the activation's
    with torch.no_grad():
        again = _computed(x.grad_fn, chain, x.shape, skipped)
    return chain if again is not None and again.dtype == x.dtype and torch.equal(again, x) else None


def computed_again(node: Any, chain: tuple[str, ...], shape: torch.Size) -> torch.Tensor | None:
    """The input of the activation whose node is ``node``, of shape ``shape``, computed again by ``chain`` (see
    :func:`chain_of`) from the nodes below it; ``None`` where they are not of its types, or saved no tensor."""
    with torch.no_grad():
        return _computed(node.next_functions[0][0], chain, shape, {})


def _computed(node: Any, chain: tuple[str, ...], shape: torch.Size, skipped: dict[int, Any]) -> torch.Tensor | None:
    nodes = []
    for kind in chain:
        node = skipped.get(id(node), node)
        if node is None or type(node).__name__ != kind:
            return None
        if kind in _BY_NUMBER and not _by_number(node):
            return None
        nodes.append(node)
        node = node.next_functions[0][0] if kind not in _PRODUCTS else None
    try:
        a, b = nodes[-1]._saved_self, nodes[-1]._saved_mat2
    except RuntimeError:  # changed in place since
        return None
    if a is None or b is None:
        return None
    value = _PRODUCTS[chain[-1]](a, b)
    for node in reversed(nodes[:-1]):
        kind = type(node).__name__
        value = value.view(shape) if kind in _VIEWS else _BY_NUMBER[kind](value, node._saved_other)
    return value if value.shape == shape else None


def _by_number(node: Any) -> bool:
    """Whether a product's or quotient's node took a number (or a tensor of one element without a gradient) as its
    second operand, which it saved."""
    other = node._saved_other
    return isinstance(other, torch.Tensor) and other.dim() == 0 and node.next_functions[1][0] is None
