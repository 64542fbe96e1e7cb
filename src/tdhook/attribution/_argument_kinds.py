"""Calls whose linearity depends on their arguments, not on their name alone.

:class:`~tdhook.attribution._nonlinear_calls.NonlinearCalls` classes a torch call by its name: a sum, a reshape or
a maximum keeps its plain gradient, which is exact LRP-0 where the forward is piecewise linear. A few calls are
piecewise linear or not by what they are given:

* a reduction over groups (``scatter_reduce``, ``index_reduce``, ``torch.segment_reduce``, message passing in a
  graph network) is a sum, a mean or a maximum (piecewise linear) or, with ``reduce="prod"``, a product of the
  activations in each group: gradient × input counts each of a group's ``k`` factors once, ``k`` times its output;
* ``F.grid_sample`` is linear in the sampled input, but not in its grid: bilinear interpolation multiplies the
  weights along each axis, the sampled values are constants of the grid's map, and nearest sampling has a zero
  gradient, so a grid computed from activations (a spatial transformer's) gets no meaningful relevance;
* ``F.prelu`` with a slope computed from activations, ``torch.lerp`` with a weight computed from activations, and
  an eval-mode ``F.batch_norm`` scaled by a weight or variance computed from activations multiply two activations.

:func:`nonlinear_by_arguments` names such a call where it is not piecewise linear, for the coverage report.

Examples:
    >>> import torch
    >>> h = torch.randn(2, 4, requires_grad=True) * 1
    >>> groups = torch.tensor([[0, 0, 1, 1]] * 2)
    >>> product = torch.Tensor.scatter_reduce
    >>> nonlinear_by_arguments("scatter_reduce", product, (torch.zeros(2, 2), 1, groups, h), {"reduce": "prod"})
    "scatter_reduce (reduce='prod')"
    >>> nonlinear_by_arguments("scatter_reduce", product, (torch.zeros(2, 2), 1, groups, h, "amax"), {}) is None
    True
"""

from __future__ import annotations

from typing import Any

import torch

from tdhook.attribution.rules._autograd import call_argument, is_activation

__all__ = ["BY_ARGUMENTS", "nonlinear_by_arguments"]

# Reductions over groups: where their reduction and the reduced tensor are (position, keyword). Only a product of
# the activations in a group is not piecewise linear: a sum, a mean, a maximum or a minimum is.
_REDUCTIONS = {
    "scatter_reduce": ((4, "reduce"), (3, "src")),
    "index_reduce": ((4, "reduce"), (3, "source")),
    "segment_reduce": ((1, "reduce"), (0, "data")),
}
_PRODUCT_REDUCTIONS = frozenset({"prod"})
# Grid samplers: where the grid is. Linear in the sampled input; not piecewise linear in the grid.
_GRIDS = {name: (1, "grid") for name in ("grid_sample", "grid_sampler", "grid_sampler_2d", "grid_sampler_3d")}
_GRID_MESSAGE = "at a grid computed from activations"
# ``torch.batch_norm(input, weight, bias, running_mean, running_var, ...)``: another order than ``F.batch_norm``'s
# ``(input, running_mean, running_var, weight, bias, ...)``; the ATen operator's is ``torch.batch_norm``'s.
_NORM_ARGUMENTS = dict.fromkeys(
    (torch.batch_norm, torch.ops.aten.batch_norm, torch.ops.aten.batch_norm.default),
    ((1, "weight"), (4, "running_var")),
)
_FUNCTIONAL_NORM_ARGUMENTS = ((3, "weight"), (2, "running_var"))

#: the names (as :func:`~tdhook.attribution._function_kinds.function_kind` gives them) whose kind
#: :func:`nonlinear_by_arguments` decides
BY_ARGUMENTS = frozenset(_REDUCTIONS) | frozenset(_GRIDS) | {"prelu", "lerp", "batch_norm"}


def nonlinear_by_arguments(name: str, func: Any, args: tuple, kwargs: dict) -> str | None:
    """What to name a call of ``func`` (named ``name``, one of :data:`BY_ARGUMENTS`) on activations in the
    coverage report where, with these arguments, it is not piecewise linear; ``None`` where it is.

    Examples:
        >>> import torch.nn.functional as F
        >>> image, grid = torch.randn(1, 1, 4, 4), torch.zeros(1, 2, 2, 2)
        >>> nonlinear_by_arguments("grid_sample", F.grid_sample, (image, grid * torch.ones(1, requires_grad=True)), {})
        'grid_sample (at a grid computed from activations)'
        >>> nonlinear_by_arguments("grid_sample", F.grid_sample, (image * torch.ones(1, requires_grad=True), grid), {})
    """
    if name in _REDUCTIONS:
        (position, keyword), (reduced_position, reduced_keyword) = _REDUCTIONS[name]
        reduction = call_argument(args, kwargs, position, keyword)
        if reduction in _PRODUCT_REDUCTIONS and is_activation(
            call_argument(args, kwargs, reduced_position, reduced_keyword)
        ):
            return f"{name} (reduce={reduction!r})"
        return None
    if name in _GRIDS:
        return f"{name} ({_GRID_MESSAGE})" if is_activation(call_argument(args, kwargs, *_GRIDS[name])) else None
    signal = is_activation(call_argument(args, kwargs, 0, "input"))
    if name == "prelu":  # x where x > 0, else a · x: a product of two activations where the slope a is one
        slope = is_activation(call_argument(args, kwargs, 1, "weight"))
        return "prelu (with a slope computed from activations)" if signal and slope else None
    if name == "lerp":  # start + weight · (end - start)
        ends = signal or is_activation(call_argument(args, kwargs, 1, "end"))
        weight = is_activation(call_argument(args, kwargs, 2, "weight"))
        return "lerp (with a weight computed from activations)" if ends and weight else None
    # batch_norm in eval mode: (x - mean) / sqrt(var + eps) · weight + bias
    weight, variance = _NORM_ARGUMENTS.get(func, _FUNCTIONAL_NORM_ARGUMENTS)
    scaled = signal and is_activation(call_argument(args, kwargs, *weight))
    if scaled or is_activation(call_argument(args, kwargs, *variance)):
        return "batch_norm (with a weight or variance computed from activations)"
    return None
