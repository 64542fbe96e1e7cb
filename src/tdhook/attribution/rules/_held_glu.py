"""A gated linear unit (``F.glu``) with its sigmoid gate held constant."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tdhook.attribution.rules._autograd import hold, redirect

__all__ = ["held_glu"]


def held_glu(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``F.glu(x, dim)``, ``a · sigmoid(b)`` of ``x``'s halves ``a`` and ``b``, with its sigmoid gate held constant
    (as a squeeze-excite gate is, under every preset): ``a`` gets all the relevance, ``b`` none. The values are
    ``F.glu``'s own.

    Examples:
        >>> x = torch.tensor([[1.0, -2.0, 0.5, 3.0]], requires_grad=True)
        >>> y = held_glu(x * 1, -1)
        >>> torch.equal(y, F.glu(x, -1))
        True
        >>> relevance = x * torch.autograd.grad(y.sum(), x)[0]
        >>> torch.allclose(relevance, torch.cat([y, torch.zeros(1, 2)], -1))
        True
    """
    gate = hold(torch.sigmoid(x.chunk(2, dim)[1]))

    def backward(grad: torch.Tensor) -> list[torch.Tensor]:
        return [torch.cat([grad * gate, torch.zeros_like(grad)], dim)]

    return redirect(F.glu(x, dim), [x], backward)
