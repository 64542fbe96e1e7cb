"""Norms written out in a forward that is no norm module's: the function modes hold their statistic constant.

A norm module's rule (:class:`~tdhook.attribution.rules.normalization.NormRule`) holds its normalising scale
constant, so that the norm is linear in its input and conserves relevance. The same norm written out where no norm
module runs it (in a model's or an attention module's own forward: ``h * rsqrt((h * h).mean(-1, keepdim=True) +
ε)``, ``h / h.norm(dim=-1, keepdim=True)``, a query and a key normalised before their product) got the plain
gradient of its statistic and AttnLRP's uniform rule on ``h * scale`` (a quarter to half of the logit's relevance
left, or almost none, by spelling). The function modes now hold a statistic (see
:func:`~tdhook.attribution.rules._statistics.is_statistic`) constant where it scales an activation: a factor of an
element-wise product (:func:`statistic_factors`), or a divisor (:func:`divides_by_statistic`). Norms called as
functions (``F.normalize``, ``F.group_norm``, ``F.instance_norm``, ``F.local_response_norm``) get the norm rule's
gradient (:func:`norm_call`), as in a norm module; the mean of ``torch.var_mean`` passes its gradient on as a mean
does, apart from the variance (:func:`mean_apart`). A statistic that scales nothing (a norm that is an output) keeps
its plain gradient, and the wrapper's warning names it.

Examples:
    >>> h = torch.randn(2, 3, requires_grad=True) * 1
    >>> scale = torch.rsqrt((h * h).mean(-1, keepdim=True) + 1e-6)
    >>> statistic_factors(torch.Tensor.__mul__, (h, scale)), divides_by_statistic((h, h.norm(dim=-1, keepdim=True)))
    ([False, True], True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tdhook.attribution.rules._autograd import is_activation
from tdhook.attribution.rules._means_apart import STATISTICS_AND_MEANS, mean_apart
from tdhook.attribution.rules._statistics import is_statistic
from tdhook.attribution.rules.gates import ELEMENTWISE_PRODUCTS
from tdhook.attribution.rules.normalization import NormRule

__all__ = [
    "DIVISIONS",
    "NORM_CALLS",
    "STATISTICS_AND_MEANS",
    "divides_by_statistic",
    "mean_apart",
    "norm_call",
    "statistic_factors",
]

# Divisions of one tensor by another (no rounding: ``floor_divide`` is piecewise constant).
DIVISIONS = frozenset(
    {torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.true_divide, torch.Tensor.true_divide}
    | {torch.divide, torch.Tensor.divide}
)

# The norm rule of these calls, as a norm module gets it (ε of an instance norm's running statistics: the presets').
_RULE = NormRule()
NORM_CALLS = {func: NormRule.functions[func] for func in (F.normalize, F.group_norm, F.local_response_norm)}
NORM_CALLS[F.instance_norm] = NormRule.functions[F.instance_norm]


def statistic_factors(func: Callable, args: tuple) -> list[bool] | None:
    """Which factors of an element-wise product of two activations are statistics to hold constant, or ``None``
    where none is (a ``matmul`` takes no scale)."""
    if func not in ELEMENTWISE_PRODUCTS or len(args) != 2:
        return None
    held = [is_statistic(arg) for arg in args]
    return held if any(held) else None


def divides_by_statistic(args: tuple, kwargs: dict | None = None) -> bool:
    """Whether a division's divisor is an activation that is a statistic (``h / h.norm(...)``), without rounding."""
    if len(args) != 2 or not is_activation(args[1]) or (kwargs and kwargs.get("rounding_mode") is not None):
        return False
    return is_statistic(args[1])


def norm_call(func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)``, a norm called as a function on an activation, with the norm rule's gradient (its
    statistic held constant)."""
    return NORM_CALLS[func](_RULE, None, func(*args, **kwargs), args, kwargs)
