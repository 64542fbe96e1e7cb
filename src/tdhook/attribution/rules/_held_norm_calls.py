"""``F.normalize`` and ``F.cosine_similarity`` under the CNN presets: norms held constant, a cosine's product shared.

Embedding networks end in ``F.normalize`` (metric learning, face verification, CLIP-style image towers), and siamese
networks compare two embeddings with ``F.cosine_similarity`` (or ``nn.CosineSimilarity``, whose forward calls it).
Both are invariant to the scale of their inputs, so their plain gradient gives every input relevance summing to
zero (a function of degree 0 has ``⟨∇f(x), x⟩ = 0``), and zennit, which has no rule for a call that is no module,
leaves them so. LRP treats a norm's scale as a constant of the sample, as the norm rules do (see
:class:`~tdhook.attribution.rules.normalization.NormRule`): held, ``x / max(‖x‖, eps)`` is linear in ``x`` and
conserves its relevance. The cosine, each norm held, is ``Σ â · b̂`` over ``dim``, a product of two activations
(bilinear): each input gets half of each element's relevance, as AttnLRP's uniform rule gives it and as
:mod:`~tdhook.attribution.rules._cosine_similarity` computes it under AttnLRP and CP-LRP; where one input is a
constant (a learned prototype, a stored reference embedding), the other gets all of it. A second-order explanation
of the pair (BiLRP) sums, over either input, to the whole score: the first-order relevance here is half of it.

The CNN presets' :class:`~tdhook.attribution.rules.gates.HeldGates` gives these calls the rule
(:func:`held_norm_call`); the cosine's value is that of the cosine written out (``normalize(x1) · normalize(x2)``
summed), the same operations as torch's kernel.

Examples:
    >>> import torch
    >>> x = torch.randn(2, 3, requires_grad=True)
    >>> h = 2 * x
    >>> y = held_norm_call(F.normalize, (h,), {"dim": 1})
    >>> torch.allclose(y, F.normalize(h, dim=1))
    True
    >>> relevance = x * torch.autograd.grad(y[:, 0].sum(), x)[0]  # the held norm: linear, conserved
    >>> torch.allclose(relevance.sum(1), y[:, 0])
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tdhook.attribution.rules._autograd import call_argument, is_activation, scale_gradient
from tdhook.attribution.rules._cosine_similarity import COSINE_SIMILARITY, cosine_inputs
from tdhook.attribution.rules.normalization import NormRule

__all__ = ["NORMALIZING_CALLS", "held_norm_call", "normalized_inputs"]

#: the calls :func:`held_norm_call` gives a rule
NORMALIZING_CALLS = frozenset({F.normalize, COSINE_SIMILARITY})

# The norm rule of ``F.normalize`` (its ε is no part of it: the call's own ``eps`` clamps the norm).
_RULE = NormRule()
_NORMALIZE = NormRule.functions[F.normalize]


def normalized_inputs(func: Callable, args: tuple, kwargs: dict) -> list[object]:
    """What a call of ``func`` (one of :data:`NORMALIZING_CALLS`) normalises: ``F.normalize``'s input, the two
    inputs of ``F.cosine_similarity``; nothing for any other call.

    Examples:
        >>> h = torch.randn(2, 3, requires_grad=True) * 1
        >>> [is_activation(x) for x in normalized_inputs(COSINE_SIMILARITY, (h,), {"x2": torch.ones(3)})]
        [True, False]
    """
    if func is F.normalize:
        inputs = [call_argument(args, kwargs, 0, "input")]
    elif func is COSINE_SIMILARITY:
        inputs = [call_argument(args, kwargs, 0, "x1"), call_argument(args, kwargs, 1, "x2")]
    else:
        return []
    return inputs


def held_norm_call(func: Callable, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A call of ``F.normalize`` or ``F.cosine_similarity`` with each norm of an activation held constant and a
    cosine's product of two activations shared (half of its relevance to each input); ``None`` where the call
    normalises no activation (it keeps its plain gradient)."""
    if not any(is_activation(x) for x in normalized_inputs(func, args, kwargs)):
        return None
    if func is F.normalize:
        return _held_normalize(
            call_argument(args, kwargs, 0, "input"),
            call_argument(args, kwargs, 1, "p", 2.0),
            call_argument(args, kwargs, 2, "dim", 1),
            call_argument(args, kwargs, 3, "eps", 1e-12),
            call_argument(args, kwargs, 4, "out"),
        )
    x1, x2 = call_argument(args, kwargs, 0, "x1"), call_argument(args, kwargs, 1, "x2")
    dim, eps = call_argument(args, kwargs, 2, "dim", 1), call_argument(args, kwargs, 3, "eps", 1e-8)
    factors = []
    for given, x in zip((x1, x2), cosine_inputs(x1, x2), strict=True):
        # An input that is a constant (a prototype) stays one: its norm is no statistic of the sample.
        factors.append(_held_normalize(x, 2.0, dim, eps) if is_activation(given) else F.normalize(x, 2.0, dim, eps))
    if is_activation(x1) and is_activation(x2):  # a product of two activations: the uniform rule
        factors = [scale_gradient(factor, 0.5) for factor in factors]
    return (factors[0] * factors[1]).sum(dim)


def _held_normalize(x: torch.Tensor, p: float, dim: int, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``F.normalize(x, p, dim, eps, out)`` with the norm rule's gradient: ``x`` over its norm held constant."""
    return _NORMALIZE(_RULE, None, F.normalize(x, p, dim, eps, out), (x, p, dim, eps), {})
