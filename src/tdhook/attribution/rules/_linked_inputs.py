"""The explained inputs of a call that keeps the graph: fresh leaves for the relevance pass, linked to the
caller's tensors for every other pass.

In an ordinary call each explained input is fed to the model as a copy of a fresh leaf: the relevance pass
stops there, and the rules that look back along the graph (the input-layer rules carrying relevance back
through glue, the first-layer switch) find the model input as a leaf. In a call that keeps the graph
(``create_graph=True``) the relevance must also stay a function of the caller's tensor where it has a history
(``x0 + delta``, an encoder's output, an embedding's rows): :func:`linked_input` gives the same fresh leaf,
and a copy of it whose node sends the gradient to the leaf in the wrapper's relevance pass and to the caller's
tensor in every other pass (the derivative of a loss on the relevance, or on the outputs). For the relevance
pass, the graph is that of an ordinary call; :func:`linked_source` gives the caller's tensor behind a leaf, the
factor of ``input * gradient``.

Examples:
    >>> from tdhook.attribution.rules._keeping_graph import keeping_graph
    >>> source = torch.tensor([1.0, 2.0], requires_grad=True) * 3
    >>> with keeping_graph() as relevance_pass:
    ...     leaf, fed = linked_input(source)
    >>> leaf.is_leaf, linked_source(leaf) is source, is_linked_copy(fed.grad_fn)
    (True, True, True)
    >>> y = (fed**2).sum()
    >>> with relevance_pass.running():  # the wrapper's relevance pass reaches the leaf
    ...     torch.autograd.grad(y, leaf, retain_graph=True)[0]
    tensor([ 6., 12.])
    >>> torch.autograd.grad(y, source)[0]  # any other pass reaches the caller's tensor
    tensor([ 6., 12.])
"""

from __future__ import annotations

import torch

from tdhook.attribution.rules._autograd import pass_no_relevance
from tdhook.attribution.rules._keeping_graph import RelevancePass, graph_kept

__all__ = ["is_linked_copy", "linked_input", "linked_source"]

_LINKED = "tdhook_linked_input"  # the autograd metadata key set on the copies' nodes
_SOURCE = "_tdhook_linked_source"  # the attribute of a leaf that holds the caller's tensor


class _LinkedCopy(torch.autograd.Function):
    """A copy of ``leaf`` whose gradient goes to ``leaf`` in the relevance pass and to ``source`` in any other."""

    @staticmethod
    def forward(ctx, relevance_pass: RelevancePass, leaf: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
        ctx.relevance_pass = relevance_pass
        # Out of the function modes' sight: a watch would take this copy, made under no_grad from the signal, for a
        # part of the signal the model computed without gradient (``f(h).detach()``).
        with torch._C.DisableTorchFunction():
            return leaf.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.relevance_pass.is_running:
            return None, grad, None
        return None, None, grad


def linked_input(source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fresh leaf with ``source``'s values, and the copy of it to feed the model (see the module's docstring).

    Outside a call that keeps the graph (``lrp.inactive()``: no rules, no relevance pass to tell apart), the leaf
    is a view of ``source`` of its own, with its history.
    """
    relevance_pass = graph_kept()
    if relevance_pass is None:
        leaf = source.view_as(source)
        return leaf, leaf.clone()
    leaf = source.detach().requires_grad_(True)
    fed = _LinkedCopy.apply(relevance_pass, leaf, source)
    pass_no_relevance(fed.grad_fn, [1])  # the relevance pass reaches the leaf, not the caller's graph
    fed.grad_fn.metadata[_LINKED] = True
    setattr(leaf, _SOURCE, source)
    return leaf, fed


def linked_source(leaf: torch.Tensor) -> torch.Tensor:
    """The caller's tensor a leaf of :func:`linked_input` stands for, or the leaf itself."""
    return getattr(leaf, _SOURCE, leaf)


def is_linked_copy(node: object) -> bool:
    """Whether the autograd ``node`` made the copy :func:`linked_input` feeds the model: a copy of a leaf for the
    relevance pass, as ``clone`` makes in an ordinary call."""
    return node is not None and bool(node.metadata.get(_LINKED, False))
