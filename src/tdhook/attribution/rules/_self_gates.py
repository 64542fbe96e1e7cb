"""Activations written out as a signal times a gate computed from it: the product is the activation's output.

``x * torch.sigmoid(x)`` is SiLU, ``x * torch.sigmoid(1.702 * x)`` the quick GELU, ``0.5 * x * (1 + torch.tanh(c * (x
+ 0.044715 * x ** 3)))`` the tanh GELU. The transformer presets hold the sigmoid-like gate inside such a product, as
their activation rule passes an activation's relevance to its input whole. Under CP-LRP the product then stands where
``F.silu(x)``'s output would: in a gated MLP (``act(g) * up``) that output is the gate the preset holds, so that the
``up`` path takes all of the unit's relevance. Written out, the product was no gate: the outer product shared its
relevance between the two paths (10.8 % relative L2 from ``F.silu(g) * up`` for SiLU, 15 % for the GELUs, both
conserving, with no warning). :func:`mark_self_gated` marks it as ``F.silu``'s output is marked.

The gate counts as computed from the signal where both come, through element-wise operations alone (scalings,
sums, powers, views: :data:`~tdhook.attribution.rules.normalization.ELEMENT_WISE_NODES`) and parameters, from one
and the same output of one operation: a squeeze-excite gate (a pooling of the signal), a GLU's (the other half of a
``chunk``), a gate of another branch or of two (``(a + b) * sigmoid(a - b)``) is not one.

Examples:
    >>> from tdhook.attribution.rules.gates import is_gate, mark_gate
    >>> g, other = (torch.randn(2, 3, requires_grad=True) * 1 for _ in range(2))
    >>> gate = mark_gate(torch.sigmoid(g), g, sigmoid=True)
    >>> silu = g * gate
    >>> mark_self_gated((g, gate), silu)
    >>> is_gate(silu)
    True
    >>> gate = mark_gate(torch.sigmoid(other), other, sigmoid=True)  # a gate of another signal
    >>> gated = g * gate
    >>> mark_self_gated((g, gate), gated)
    >>> is_gate(gated)
    False
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tdhook.attribution.rules._autograd import is_activation
from tdhook.attribution.rules.gates import GATE_MARK, SIGMOID_MARK, _mark, mark_gate
from tdhook.attribution.rules.normalization import ELEMENT_WISE_NODES

__all__ = ["mark_self_gated"]

# The autograd nodes a search for a tensor's origins walks at most (beyond: no origin, no mark).
_MOST_NODES = 64


def mark_self_gated(args: tuple, product: Any) -> None:
    """Mark ``product``, the element-wise product of ``args``, as an activation's output (a gate of the kind
    ``F.silu``'s output is) where one factor is a sigmoid-like gate computed element by element from the other."""
    if len(args) != 2 or not isinstance(product, torch.Tensor):
        return
    sigmoid = [bool(_mark(factor, SIGMOID_MARK, False)) for factor in args]
    if sigmoid[0] == sigmoid[1]:
        return
    gate, signal = args if sigmoid[0] else args[::-1]
    source = _mark(gate, GATE_MARK)
    if not (isinstance(source, torch.Tensor) and is_activation(signal) and is_activation(source)):
        return
    if not product.shape == signal.shape == gate.shape:  # a broadcast product (an outer one) is no activation
        return
    origins = _origins(signal)
    if origins is not None and len(origins) == 1 and origins == _origins(source):  # (a + b) * sigmoid(a - b): none
        # Marked with the gate as its source, not the signal: a module computing the activation so (Swish) keeps its
        # own rule's factor, which AttnLRP's identity rule leaves out for an output marked as of the module's input
        # (a function activation inside it that had the rule).
        mark_gate(product, gate)


def _origins(tensor: torch.Tensor) -> frozenset | None:
    """The outputs (node, output number) ``tensor`` is computed from through element-wise nodes and parameters
    alone; ``None`` where the walk grows past :data:`_MOST_NODES` nodes."""
    with torch._C.DisableTorchFunction():  # an inspection, which a function mode of the call must not see
        stack, seen, origins = [(tensor.grad_fn, tensor.output_nr)], set(), set()
        while stack:
            node, number = stack.pop()
            if node is None or (node, number) in seen:
                continue
            seen.add((node, number))
            if len(seen) > _MOST_NODES:
                return None
            if type(node).__name__ in ELEMENT_WISE_NODES:
                stack.extend(node.next_functions)
            elif not isinstance(getattr(node, "variable", None), nn.Parameter):  # a parameter: a constant here
                origins.add((node, number))
        return frozenset(origins)
