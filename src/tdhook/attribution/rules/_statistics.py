"""Clips that guard a divisor: a clamp of a statistic (a norm, a root mean square, a variance) keeps its gradient.

A norm written by hand divides by a statistic kept away from zero, ``h / h.norm(dim=-1, keepdim=True).clamp_min(eps)``
(as ``F.normalize`` computes it). The clamp is no activation's clip: where the statistic is below the bound, the
quotient is ``h / eps``, linear in ``h``, and its plain gradient is LRP-0. The identity rule on the clamp would pass
that gradient on into the statistic's path as if the clamp were not there; the unclamped quotient is invariant to the
scale of ``h``, so the statistic's path would take back what the numerator gets (99 % of the relevance lost on inputs
whose statistic is below ``eps``). The function mode's clipping rule leaves such clamps alone.

A norm written out in a forward that is no norm module's (``h * rsqrt((h * h).mean(-1, keepdim=True) + eps)``,
``h / h.norm(dim=-1, keepdim=True)``, a query normalised before attention) is told by :func:`is_statistic`: the
function modes hold such a statistic constant where it scales an activation (a factor of a product, a divisor), as
the norm rule holds a norm module's scale (see :mod:`~tdhook.attribution.rules._held_statistics`).

Examples:
    >>> h = torch.randn(2, 3, requires_grad=True) * 1
    >>> clips_a_statistic(h.norm(dim=-1, keepdim=True)), clips_a_statistic((h.pow(2).mean(-1) + 1e-6).sqrt())
    (True, True)
    >>> clips_a_statistic(h), clips_a_statistic(h.sum(-1)), clips_a_statistic(h.abs())
    (False, False, False)
    >>> is_statistic(torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6)), is_statistic(torch.sqrt(h * h))
    (True, False)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MEAN_APART", "clips_a_statistic", "is_statistic", "is_statistic_of", "may_be_statistic"]

#: the metadata key of the node that passes on the gradient of ``torch.var_mean``'s mean by a plain mean's node, the
#: last of its inputs (see :mod:`~tdhook.attribution.rules._means_apart`)
MEAN_APART = "tdhook_mean_apart"

# Autograd nodes of statistics that normalise: norms, roots, variances and deviations.
_STATISTICS = (
    "LinalgVectorNormBackward",
    "NormBackward",
    "SqrtBackward",
    "RsqrtBackward",
    "VarBackward",
    "StdBackward",
    "VarMeanBackward",
    "StdMeanBackward",
)
# Reductions, which make a statistic of magnitudes (a sum or mean of squares, a maximum of absolute values).
_REDUCTIONS = ("SumBackward", "MeanBackward", "MaxBackward", "AmaxBackward", "NansumBackward")
# Nodes that only reshape or copy; with one input that requires grad, sums and products by constants (``var + eps``,
# ``norm * scale``) are passed through as well.
_PASSED = frozenset(
    "ViewBackward0 UnsafeViewBackward0 ReshapeAliasBackward0 UnsqueezeBackward0 SqueezeBackward0 SqueezeBackward1 "
    "SqueezeBackward2 SqueezeBackward3 ExpandBackward0 CloneBackward0 ToCopyBackward0 TransposeBackward0 "
    "PermuteBackward0 TBackward0 AddBackward0 AddBackward1 SubBackward0 SubBackward1 MulBackward0 MulBackward1 "
    "DivBackward0 DivBackward1".split()
)
_DEPTH = 16  # nodes walked back at most


def clips_a_statistic(x: torch.Tensor) -> bool:
    """Whether ``x`` is a statistic that normalises (a norm, a root, a variance, a sum or mean of squares, or a
    negative power of one), up to reshapes and sums or products by constants: a clip of it guards a divisor."""
    node = x.grad_fn
    for _ in range(_DEPTH):
        if node is None:
            return False
        name = type(node).__name__
        edges = [edge for edge, _ in node.next_functions if edge is not None]
        if name.startswith(_STATISTICS) or (name == "PowBackward0" and _is_root(node)):
            return True
        if name.startswith(_REDUCTIONS):
            return len(edges) == 1 and _is_magnitude(edges[0])
        if name not in _PASSED or len(edges) != 1:
            return False
        node = edges[0]
    return False


def _is_root(node: Any) -> bool:
    """A power with an exponent that is negative or no integer (``pow(0.5)``, ``pow(-0.5)``)."""
    exponent = getattr(node, "_saved_exponent", None)
    return isinstance(exponent, (int, float)) and (exponent < 0 or not float(exponent).is_integer())


# The function modes' own nodes that scale a product's gradient (AttnLRP's uniform rule on ``h * h``).
_SCALINGS = frozenset({"_ScaledGradientBackward", "_GraphKeepingScaledGradientBackward"})


def _is_magnitude(node: Any) -> bool:
    """An absolute value, an even power, or a product of a tensor by itself (``h * h``, with its gradient scaled by
    the uniform rule or not)."""
    name = type(node).__name__
    if name in _SCALINGS:
        edges = [edge for edge, _ in node.next_functions if edge is not None]
        if len(edges) != 1:
            return False
        node, name = edges[0], type(edges[0]).__name__
    if name == "AbsBackward0":
        return True
    if name == "PowBackward0":
        exponent = getattr(node, "_saved_exponent", None)
        return isinstance(exponent, (int, float)) and exponent > 0 and float(exponent) % 2 == 0
    if name == "MulBackward0":
        (a, _), (b, _) = node.next_functions
        return a is not None and a is b
    return False


# Nodes a statistic stays one through: its guards away from zero (a clamp, a maximum with a constant), roots and
# powers of it, and, where every input is a statistic, sums, products and quotients of them.
_KEPT = _PASSED | frozenset(
    "ClampMinBackward0 ClampBackward1 MaximumBackward0 FmaxBackward0 SqrtBackward0 RsqrtBackward0 PowBackward0 "
    "PowBackward1 ReciprocalBackward0".split()
)
# Statistics of their own: norms, variances and deviations.
_OWN = ("LinalgVectorNormBackward", "NormBackward", "VarBackward", "StdBackward", "VarMeanBackward", "StdMeanBackward")


def is_statistic(x: torch.Tensor) -> bool:
    """Whether ``x`` is a statistic that normalises: a norm, a variance or deviation, a sum, mean or maximum of
    magnitudes (absolute values, even powers, ``h * h``) or of statistics, and roots, powers, guards (``clamp_min``),
    reshapes, sums, products and quotients of statistics and constants (``rsqrt(mean(h²) + ε)``). An element-wise
    root with no reduction under it (``sqrt(h * h)``) is none.

    Examples:
        >>> h = torch.randn(2, 3, requires_grad=True) * 1
        >>> is_statistic(h.norm(dim=-1, keepdim=True).clamp_min(1e-6)), is_statistic(1 / h.var(-1).sqrt())
        (True, True)
        >>> is_statistic(h.sum(-1)), is_statistic(h.pow(2)), is_statistic(h.norm(dim=-1) * h.sum(-1))
        (False, False, False)
    """
    return x.grad_fn is not None and _statistic(x.grad_fn, [_DEPTH])


def _statistic(node: Any, budget: list[int], sources: list | None = None) -> bool:
    """Whether ``node`` makes a statistic (see :func:`is_statistic`), visiting at most ``budget[0]`` nodes; the edges
    of the values it is computed from (a norm's input, the input of a magnitude that is reduced) appended to
    ``sources``, where given."""
    budget[0] -= 1
    if budget[0] < 0:
        return False
    name = type(node).__name__
    if name.startswith(_OWN):
        if sources is not None:
            sources += [edge for edge in node.next_functions if edge[0] is not None]
        return True
    edges = [edge for edge, _ in node.next_functions if edge is not None]
    if name.startswith(_REDUCTIONS):
        if len(edges) != 1:
            return False
        if _is_magnitude(edges[0]):
            if sources is not None:
                sources.append(_magnitude_input(edges[0]))
            return True
        return _statistic(edges[0], budget, sources)
    return name in _KEPT and bool(edges) and all(_statistic(edge, budget, sources) for edge in edges)


def _magnitude_input(node: Any) -> tuple[Any, int]:
    """The edge of the values a magnitude (see :func:`_is_magnitude`) is computed from."""
    if type(node).__name__ in _SCALINGS:
        node = next(edge for edge, _ in node.next_functions if edge is not None)
    return node.next_functions[0]


# Nodes that rearrange, copy or scale by a number all of a tensor's values (no slice, no sum): a statistic of their
# output is one of their input's values, up to that number.
_REARRANGED = frozenset(
    "ViewBackward0 UnsafeViewBackward0 ReshapeAliasBackward0 UnsqueezeBackward0 SqueezeBackward0 SqueezeBackward1 "
    "SqueezeBackward2 SqueezeBackward3 CloneBackward0 ToCopyBackward0 TransposeBackward0 PermuteBackward0 "
    "TBackward0 MulBackward1 DivBackward1".split()
)


# Whether an autograd node's type may make a statistic, by type (a dictionary look-up per call after the first).
_MAY_MAKE: dict[type, bool] = {}


def may_be_statistic(x: torch.Tensor) -> bool:
    """A quick test before :func:`is_statistic_of`: whether the node that made ``x`` is of a kind a statistic's last
    node is (a norm, a reduction, a root, a guard, a reshape, a sum or product); a layer's output, an activation
    function's, is not.

    Examples:
        >>> h = torch.randn(2, 3, requires_grad=True) * 1
        >>> may_be_statistic(h.norm(dim=1)), may_be_statistic(torch.relu(h))
        (True, False)
    """
    node = x.grad_fn
    if node is None:
        return False
    kind = type(node)
    known = _MAY_MAKE.get(kind)
    if known is None:
        name = kind.__name__
        known = _MAY_MAKE[kind] = name.startswith(_OWN) or name.startswith(_REDUCTIONS) or name in _KEPT
    return known


def is_statistic_of(statistic: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``statistic`` is a statistic that normalises (see :func:`is_statistic`) computed from the values of
    ``x`` alone, up to reshapes, transposes, copies and multiples of it by numbers (``x / x.norm(dim=-1,
    keepdim=True)``, ``x * rsqrt((x * x).mean(-1, keepdim=True) + ε)``, ``x / x.flatten(1).norm(dim=1).view(-1, 1,
    1, 1)``), or where ``x`` is ``h - h.mean(...)``, of ``h``'s (``(h - m) / h.std(-1, keepdim=True)``); a statistic
    of a slice of ``x``, of another tensor, or of both, is none.

    Examples:
        >>> h, g = torch.randn(2, 3, requires_grad=True) * 1, torch.randn(2, 3, requires_grad=True) * 1
        >>> is_statistic_of(h.norm(dim=1, keepdim=True), h), is_statistic_of(h.T.pow(2).sum(0).rsqrt(), h)
        (True, True)
        >>> is_statistic_of(g.norm(dim=1, keepdim=True), h), is_statistic_of(h[:, :2].norm(dim=1), h)
        (False, False)
        >>> is_statistic_of(h.norm(dim=1) + g.norm(dim=1), h), is_statistic_of(h.sum(1), h)
        (False, False)
        >>> is_statistic_of(h.std(1, keepdim=True), h - h.mean(1, keepdim=True))
        True
    """
    if statistic.grad_fn is None or not x.requires_grad:
        return False
    sources: list = []
    if not _statistic(statistic.grad_fn, [_DEPTH], sources):
        return False
    edge = torch.autograd.graph.get_gradient_edge(x)
    bases = {_base((edge.node, edge.output_nr))}
    centred = _centred(next(iter(bases)))
    if centred is not None:  # ``h - h.mean(...)`` over a statistic of ``h``: a layer norm written out
        bases.add(centred)
    return all(_base(source) in bases for source in sources)


# Nodes of a mean (``torch.var_mean`` and ``torch.std_mean`` make it with the statistic).
_MEANS = ("MeanBackward", "VarMeanBackward", "StdMeanBackward")


def _centred(edge: tuple[Any, int]) -> tuple[Any, int] | None:
    """For an edge of ``h - h.mean(dim)`` (up to rearrangements of ``h`` on either side), with a mean over
    dimensions other than the first (a sample's own features, not the batch's: a batch norm's rule holds its mean as
    well): the edge of ``h``."""
    node = edge[0]
    if node is None or type(node).__name__ != "SubBackward0":
        return None
    (a, a_number), (mean, _) = node.next_functions
    if mean is not None and mean.metadata.get(MEAN_APART):  # ``torch.var_mean``'s mean, on a mean's node of its own
        mean = [edge for edge in mean.next_functions if edge[0] is not None][-1][0]
    if a is None or mean is None or not type(mean).__name__.startswith(_MEANS) or _over_first(mean):
        return None
    inputs = [e for e in mean.next_functions if e[0] is not None]
    source = _base((a, a_number))
    return source if len(inputs) == 1 and _base(inputs[0]) == source else None


def _base(edge: Any) -> tuple[Any, int]:
    """The edge ``(node, output number)`` below the nodes that only rearrange or copy the values at ``edge``."""
    node, number = edge
    for _ in range(_DEPTH):
        if node is None or type(node).__name__ not in _REARRANGED:
            break
        edges = [e for e in node.next_functions if e[0] is not None]
        if len(edges) != 1:
            break
        node, number = edges[0]
    return node, number


def _over_first(mean: Any) -> bool:
    """Whether the mean of the autograd node ``mean`` is taken over the first dimension (the batch's), or over all."""
    dims = getattr(mean, "_saved_dim", None)
    sizes = getattr(mean, "_saved_self_sym_sizes", None)
    rank = len(sizes) if sizes is not None else getattr(getattr(mean, "_saved_self", None), "ndim", None)
    if not dims or rank is None:
        return True
    return any((d - 2**64 if d >= 2**63 else d) % rank == 0 for d in dims)
