"""Norms written out under the CNN presets: held constant as ``F.normalize``'s norm is.

An embedding network may normalise its output by hand instead of calling ``F.normalize``: ``h / h.norm(dim=1,
keepdim=True)``, ``h / torch.linalg.vector_norm(h, dim=-1, keepdim=True)``, ``h / h.pow(2).sum(-1,
keepdim=True).sqrt()``, ``h * torch.rsqrt((h * h).sum(-1, keepdim=True) + eps)``, ``h / (h.norm(...) + eps)``,
``h / h.norm(...).clamp_min(eps)``, ``torch.div(h, n)``, ``h.div_(n)``, ``h /= n``. Such a map is invariant to the
scale of ``h``: its plain gradient gives ``h`` relevance summing to zero, and a cosine of two of them multiplied
(``a_n @ b_n.T``) created relevance (-21 times the logit in one CLIP-style probe). The CNN presets hold the norm of
``F.normalize`` constant (see :mod:`~tdhook.attribution.rules._held_norm_calls`); a division of ``h`` by a statistic
of ``h``'s own values, or a product of ``h`` by one (see
:func:`~tdhook.attribution.rules._statistics.is_statistic_of`), gets the same rule here: the call runs as written,
and a hook on its autograd node passes the statistic no gradient in the relevance pass (:class:`HeldPlace`), so
that ``h`` gets the gradient of ``h`` over its norm held constant, as from ``F.normalize``. The hook gives the plain
gradient back where the call's output reaches a product of two activations, as ``F.normalize``'s rule does.

A layer norm written out, ``(h - h.mean(-1, keepdim=True)) / h.std(-1, keepdim=True)`` (or its variance's root,
or the centred values' root mean square), divides the centred ``h`` by a statistic of ``h``: held too, its
centring linear, it gets the relevance the norm rule gives an ``nn.LayerNorm`` module
(:class:`~tdhook.attribution.rules.normalization.NormRule`). A divisor that is no statistic of the numerator's own
values (``h / g.norm()``, the norm of another tensor, of a slice, or of both) keeps its plain gradient: the coverage
report names it.

Examples:
    >>> h = torch.randn(2, 3, requires_grad=True) * 1
    >>> statistic_place(torch.Tensor.__truediv__, (h, h.norm(dim=1, keepdim=True)), {})
    1
    >>> statistic_place(torch.Tensor.__mul__, (torch.rsqrt((h * h).sum(1, keepdim=True)), h), {})
    0
    >>> g = torch.randn(2, 3, requires_grad=True) * 1
    >>> statistic_place(torch.Tensor.__truediv__, (h, g.norm(dim=1, keepdim=True)), {}) is None
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tdhook.attribution.rules._autograd import is_activation, pass_no_relevance
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._statistics import is_statistic_of, may_be_statistic

__all__ = ["WRITTEN_NORM_CALLS", "HeldPlace", "held_written_norm", "statistic_place"]

_T = torch.Tensor
# Divisions of one tensor by another (``floor_divide`` rounds: no normalisation), out of place and in place.
_DIVISIONS = frozenset(
    {torch.div, _T.div, _T.__truediv__, torch.true_divide, _T.true_divide, torch.divide, _T.divide}
    | {_T.div_, _T.__itruediv__, _T.true_divide_, _T.divide_}
)
# Element-wise products of two tensors, out of place and in place.
_PRODUCTS = frozenset({torch.mul, _T.mul, _T.__mul__, _T.__rmul__, torch.multiply, _T.multiply})
_PRODUCTS |= {_T.mul_, _T.__imul__, _T.multiply_}
#: the calls that may normalise a tensor by a statistic of its own values: :func:`statistic_place` tells which do
WRITTEN_NORM_CALLS = _DIVISIONS | _PRODUCTS
# In place: the statistic can only be the second argument (the first is written into).
_IN_PLACE = frozenset({_T.div_, _T.__itruediv__, _T.true_divide_, _T.divide_, _T.mul_, _T.__imul__, _T.multiply_})


def statistic_place(func: Callable, args: tuple, kwargs: dict) -> int | None:
    """Where the statistic lies among the two arguments of ``func`` (one of :data:`WRITTEN_NORM_CALLS`, its factors
    given by position) that normalises the other by a statistic of its own values: the divisor of a division, either
    factor of a product (the other factor's, or for ``x.mul_(s)`` the second); ``None`` where the call is no such
    norm (a rounding division, a statistic of another tensor, a constant)."""
    if len(args) != 2 or (kwargs and (kwargs.get("rounding_mode") is not None or kwargs.get("out") is not None)):
        return None
    x, y = args
    if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
        return None
    divisor_only = func in _DIVISIONS or func in _IN_PLACE
    held_y, held_x = may_be_statistic(y), not divisor_only and may_be_statistic(x)  # most calls end here
    if not (held_x or held_y) or not (is_activation(x) and is_activation(y)):
        return None
    if held_y and is_statistic_of(y, x):
        return 1
    return 0 if held_x and is_statistic_of(x, y) else None


class HeldPlace:
    """A hook on a call's autograd node that passes the statistic at ``place`` among its inputs no gradient in the
    relevance pass (in a call that keeps the graph, the plain gradient in every other pass), until :meth:`release`
    gives the call its plain gradient back.

    Examples:
        >>> x = torch.tensor([3.0, 4.0], requires_grad=True)
        >>> y = x / x.norm()
        >>> held = HeldPlace(y.grad_fn, 1)
        >>> torch.allclose(torch.autograd.grad(y[0], x)[0], torch.tensor([0.2, 0.0]))  # 1 / ‖x‖ held
        True
    """

    __slots__ = ("plain", "node", "_place", "_relevance_pass")

    def __init__(self, node: Any, place: int) -> None:
        self.plain = False
        self.node, self._place = node, place
        self._relevance_pass = graph_kept()
        node.register_hook(self._hook)
        pass_no_relevance(node, [place])  # the walks of the relevance pass do not reach the statistic either

    def _hook(self, grad_inputs: tuple, grad_outputs: tuple) -> tuple | None:
        if self.plain or (self._relevance_pass is not None and not self._relevance_pass.is_running):
            return None
        return tuple(None if i == self._place else grad for i, grad in enumerate(grad_inputs))

    def release(self) -> None:
        """Give the call its plain gradient back (the statistic's path is walked again)."""
        self.plain = True
        pass_no_relevance(self.node, [])


def held_written_norm(func: Callable, args: tuple, kwargs: dict, place: int) -> tuple[Any, HeldPlace | None]:
    """``func(*args, **kwargs)``, a norm written out whose statistic is ``args[place]`` (see
    :func:`statistic_place`), and the :class:`HeldPlace` that holds the statistic on the call's node; ``None`` in
    its place where the node that took the statistic is not found (the call keeps its plain gradient)."""
    statistic = torch.autograd.graph.get_gradient_edge(args[place])
    result = func(*args, **kwargs)
    candidates = [getattr(result, "grad_fn", None)]
    base = getattr(result, "_base", None)
    if base is not None:  # written in place through a view: the node that took the statistic is the base's
        candidates.append(base.grad_fn)
    for node in candidates:
        if node is None:
            continue
        places = [
            i
            for i, (n, number) in enumerate(node.next_functions)
            if n is statistic.node and number == statistic.output_nr
        ]
        if len(places) == 1:
            return result, HeldPlace(node, places[0])
    return result, None
