"""The mean of ``torch.var_mean`` and ``torch.std_mean``, its gradient passed on apart from the statistic's.

A layer norm written out may take its mean and its variance from one call, ``var, mean = torch.var_mean(h, -1,
keepdim=True)``, then compute ``(h - mean) * torch.rsqrt(var + eps)``. Both outputs come from one autograd node, so
a relevance pass that holds the variance constant (the function modes hold a statistic that scales an activation,
see :mod:`~tdhook.attribution.rules._held_statistics` and :mod:`~tdhook.attribution.rules._written_norms`) still
reaches that node through the mean, and the coverage report, which names the calls of a nonlinear function that the
relevance pass reaches, named ``var_mean`` though its statistic is held. :func:`mean_apart` gives the mean a node of
its own, a plain mean's: the centring is linear, and the call's node is reached only where its statistic keeps its
gradient. The mean's node carries :data:`~tdhook.attribution.rules._statistics.MEAN_APART`, so that ``h - mean``
is still told for a centred ``h`` (see :func:`~tdhook.attribution.rules._statistics.is_statistic_of`).

Examples:
    >>> h = torch.randn(2, 3, requires_grad=True) * 1
    >>> var, mean = mean_apart(torch.var_mean, (h, -1), {"keepdim": True})
    >>> torch.equal(mean, torch.var_mean(h, -1, keepdim=True)[1]), type(var.grad_fn).__name__
    (True, 'VarMeanBackward0')
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tdhook.attribution.rules._autograd import redirect
from tdhook.attribution.rules._statistics import MEAN_APART

__all__ = ["STATISTICS_AND_MEANS", "mean_apart"]

#: calls that return a statistic and a mean from one autograd node
STATISTICS_AND_MEANS = frozenset({torch.var_mean, torch.std_mean})


def mean_apart(func: Callable, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.var_mean`` or ``torch.std_mean`` of an activation, its values unchanged, with the mean's gradient
    passed on by a mean's own node: the centring by the mean is linear, and the wrapper's warning names the call
    only where its statistic keeps its gradient (one that scales an activation is held there).

    Examples:
        >>> h = torch.randn(2, 3, requires_grad=True) * 1
        >>> var, mean = mean_apart(torch.var_mean, (h, -1), {"keepdim": True})
        >>> torch.allclose(mean, h.mean(-1, keepdim=True)), type(var.grad_fn).__name__
        (True, 'VarMeanBackward0')
    """
    statistic, mean = func(*args, **kwargs)
    rest = list(args[1:])
    dim, keepdim = kwargs.get("dim"), kwargs.get("keepdim", False)
    if rest and not isinstance(rest[0], bool):  # (input, dim, unbiased, keepdim) or (input, unbiased)
        dim = rest.pop(0)
    if rest and isinstance(rest[0], bool):
        rest.pop(0)
    keepdim = rest[0] if rest else keepdim
    plain = args[0].mean() if dim is None and not keepdim else args[0].mean(dim=dim, keepdim=keepdim)
    apart = redirect(mean, [plain], lambda grad: [grad])
    apart.grad_fn.metadata[MEAN_APART] = True
    return statistic, apart
