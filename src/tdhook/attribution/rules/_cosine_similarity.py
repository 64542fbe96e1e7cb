"""``F.cosine_similarity`` of activations: the cosine written out, its norms held and its product under the rules.

``F.cosine_similarity(x1, x2, dim, eps)`` (and ``nn.CosineSimilarity``, whose forward calls it) computes
``Σ (x1 / max(‖x1‖, eps)) · (x2 / max(‖x2‖, eps))`` over ``dim``, each norm clamped at ``eps`` on its own, after
broadcasting the two inputs to one shape. It is invariant to the scale of either input, so its plain gradient
gives each input relevance summing to zero. AttnLRP and CP-LRP hold every norm's scale constant and share a product
of two activations between its factors: the cosine written out (``F.normalize`` of each input, then the product
summed) gets those rules, and each input half of each element's relevance. Under those presets the call is computed
as that written-out form (the same operations as torch's kernel, and the same value), in their function mode, so it
gets the same rules and the same relevance as the cosine written by hand; where one input is a constant (a learned
prototype), the other gets all of it. The CNN presets give the call the same rules in their own mode (see
:mod:`~tdhook.attribution.rules._held_norm_calls`).

Examples:
    >>> import torch
    >>> import torch.nn.functional as F
    >>> a, b = torch.randn(2, 3), torch.randn(1, 3)
    >>> torch.allclose(cosine_as_products(a, b, dim=-1), F.cosine_similarity(a, b, dim=-1))
    True
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["COSINE_SIMILARITY", "cosine_as_products", "cosine_inputs"]

#: ``F.cosine_similarity`` (the same object as ``torch.cosine_similarity``)
COSINE_SIMILARITY = torch.cosine_similarity


def cosine_inputs(x1: torch.Tensor, x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs of ``F.cosine_similarity(x1, x2)`` brought to one dtype and broadcast to one shape, each expanded
    on its own (a constant, a learned prototype, stays one).

    Examples:
        >>> [tuple(x.shape) for x in cosine_inputs(torch.ones(2, 3), torch.ones(1, 3, dtype=torch.float64))]
        [(2, 3), (2, 3)]
    """
    dtype, shape = torch.result_type(x1, x2), torch.broadcast_shapes(x1.shape, x2.shape)
    a, b = (x.to(dtype) if x.shape == shape else x.to(dtype).expand(shape) for x in (x1, x2))
    return a, b


def cosine_as_products(x1: torch.Tensor, x2: torch.Tensor, dim: int = 1, eps: float = 1e-8) -> torch.Tensor:
    """``F.cosine_similarity(x1, x2, dim, eps)`` written out: the inputs brought to one dtype and broadcast to one
    shape, each divided by its norm over ``dim`` clamped at ``eps`` (``F.normalize``), the product summed over
    ``dim``. In a function mode, the norms and the product get the mode's rules."""
    a, b = cosine_inputs(x1, x2)
    return (F.normalize(a, 2.0, dim, eps) * F.normalize(b, 2.0, dim, eps)).sum(dim)
