"""Clipping calls (``clamp``, ``clip``, ``F.hardtanh``, ``F.relu6``, …) on activations: relevance passes through them.

A clip is element-wise and piecewise linear but not homogeneous: a unit clipped at a bound other than zero has a
value but no gradient, so its plain gradient drops that unit's relevance. ``nn.Hardtanh`` and ``nn.ReLU6`` modules
get the pass rule (the identity rule under AttnLRP and CP-LRP), and so does the same clip called as a function, in a
module's own forward, whichever spelling: the function modes of the presets hand such calls to
:func:`clip_passing`; an element-wise maximum or minimum of an activation and a constant (``torch.maximum(h, c)``,
``minimum``, ``fmax``, ``fmin``) is such a clip, and gets it from :func:`bound_passing`. Bounds that are
activations (``torch.clamp(x, min=y)``, a maximum of two signals) keep the plain gradient, and so does a clip of a
statistic that normalises, a divisor's guard (see :mod:`~tdhook.attribution.rules._statistics`).

Examples:
    >>> from tdhook.attribution.rules.basic import PassRule
    >>> x = torch.tensor([-3.0, 0.5, 2.0], requires_grad=True)
    >>> h = x * 1
    >>> z = clip_passing(torch.clamp, (h, -1.0, 1.0), {}, PassRule().apply)
    >>> x.detach() * torch.autograd.grad(z.sum(), x)[0]  # each unit's relevance is its clipped value
    tensor([-1.0000,  0.5000,  1.0000])
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn import Parameter

from tdhook.attribution.rules._autograd import (
    call_argument,
    is_activation,
    mark_parameter_derived,
    marked_parameter_derived,
    unwrapped,
)
from tdhook.attribution.rules._statistics import clips_a_statistic
from tdhook.attribution.rules._zero_input_calls import watch_zero_inputs

__all__ = [
    "BOUNDS",
    "CLIPS",
    "CLIPS_IN_PLACE",
    "bound_passing",
    "bounded_signal",
    "clips_a_signal",
    "clips_at_zero_only",
    "clips_nothing",
    "clip_bounds",
    "clips_in_place",
    "clip_passing",
    "is_clipped",
    "mark_clipped",
]

CLIPS = frozenset({torch.clamp, torch.Tensor.clamp, torch.clip, torch.Tensor.clip, F.hardtanh, F.relu6})
CLIPS |= {torch.clamp_min, torch.Tensor.clamp_min, torch.clamp_max, torch.Tensor.clamp_max}
# In place, and the call each clips a copy with.
CLIPS_IN_PLACE = dict.fromkeys((torch.clamp_, torch.Tensor.clamp_, torch.clip_, torch.Tensor.clip_), torch.clamp)
CLIPS_IN_PLACE |= dict.fromkeys((torch.clamp_min_, torch.Tensor.clamp_min_), torch.clamp_min)
CLIPS_IN_PLACE |= dict.fromkeys((torch.clamp_max_, torch.Tensor.clamp_max_), torch.clamp_max)
# Element-wise maxima and minima of two tensors: a clip where one is an activation and the other a constant bound.
BOUNDS = frozenset({torch.maximum, torch.Tensor.maximum, torch.minimum, torch.Tensor.minimum})
BOUNDS |= {torch.fmax, torch.Tensor.fmax, torch.fmin, torch.Tensor.fmin}
# ``torch.max(h, c)`` and ``torch.min(h, c)`` of two tensors are the same (of one tensor, or over a dimension: no
# tensor ``other``, so no bound).
BOUNDS |= {torch.max, torch.Tensor.max, torch.min, torch.Tensor.min}


# The mark of a clipping call's output: where it multiplies another activation's output (a gated unit whose value
# path is clipped, as Gemma 4's vision encoder clips its projections), a product that holds any gate holds the other.
CLIP_MARK = "_tdhook_clipped"


def mark_clipped(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor`` as a clipping call's output (see :func:`is_clipped`), and return it.

    Examples:
        >>> is_clipped(mark_clipped(torch.ones(2))), is_clipped(torch.ones(2))
        (True, False)
    """
    setattr(tensor, CLIP_MARK, True)
    return tensor


def is_clipped(value: Any) -> bool:
    """Whether ``value`` is a tensor marked as a clipping call's output (see :func:`mark_clipped`)."""
    return isinstance(value, torch.Tensor) and getattr(value, CLIP_MARK, False)


def clips_a_signal(func: Callable, args: tuple) -> bool:
    """Whether this call clips an activation that is no statistic (a divisor's guard): one relevance passes
    through."""
    return (
        (func in CLIPS or func in CLIPS_IN_PLACE)
        and bool(args)
        and is_activation(args[0])
        and not clips_a_statistic(args[0])
    )


def _constant(value: object) -> bool:
    """Whether ``value`` is a tensor that is a constant to the rules: without gradient, a parameter, or computed
    from parameters alone (an input leaf, whose relevance is explained, is none)."""
    value = unwrapped(value)
    return isinstance(value, torch.Tensor) and (
        not value.requires_grad or isinstance(value, Parameter) or marked_parameter_derived(value)
    )


def bounded_signal(func: Callable, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """For a maximum or minimum of two tensors (``torch.maximum(h, c)``, ``h.fmin(c)``, ``torch.max(h, c)``, in
    either order): the
    activation it clips at a constant bound, which no statistic is (a divisor's guard); else ``None`` (two
    activations, no activation: the plain gradient). Under ``torch.vmap``, the tensors the transform wraps.

    Examples:
        >>> h, c = torch.randn(3, requires_grad=True) * 1, torch.tensor(-1.0)
        >>> bounded_signal(torch.maximum, (c, h), {}) is h, bounded_signal(torch.maximum, (h, h), {})
        (True, None)
    """
    if func not in BOUNDS or not args:
        return None
    first, second = args[0], call_argument(args, kwargs, 1, "other")
    for signal, bound in ((first, second), (second, first)):
        if is_activation(unwrapped(signal)) and _constant(bound):
            return None if clips_a_statistic(unwrapped(signal)) else signal
    return None


def bound_passing(
    func: Callable,
    args: tuple,
    kwargs: dict,
    signal: torch.Tensor,
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rule: Any = None,
) -> torch.Tensor:
    """A maximum or minimum of the activation ``signal`` and a constant bound (see :func:`bounded_signal`), with
    ``apply(output, x)`` (the pass or identity rule) on ``signal``, broadcast to the output's shape. Where ``rule``
    (the rule ``apply`` is of) is given, a unit whose signal is exactly 0 and whose output is not is watched for in
    a context's first pass (see :func:`~tdhook.attribution.rules._zero_input_calls.watch_zero_inputs`): its
    relevance is lost, and the rule warns of it as it does on a module.

    Examples:
        >>> from tdhook.attribution.rules.basic import PassRule
        >>> x = torch.tensor([-3.0, 0.5, 2.0], requires_grad=True)
        >>> h, c = x * 1, torch.tensor(-1.0)
        >>> z = bound_passing(torch.maximum, (h, c), {}, h, PassRule().apply)
        >>> x.detach() * torch.autograd.grad(z.sum(), x)[0]  # each unit's relevance is its clipped value
        tensor([-1.0000,  0.5000,  2.0000])
    """
    output = func(*args, **kwargs)
    if clips_at_zero_only(func, args, kwargs):  # a ReLU: its plain gradient, exact at any scale
        return output
    x = signal if signal.shape == output.shape else signal.expand(output.shape)
    return _watched(rule, func, x, output, apply(output, x))


def _watched(rule: Any, func: Callable, x: torch.Tensor, output: torch.Tensor, result: torch.Tensor) -> torch.Tensor:
    """``result``, the clip's ``output`` of ``x`` under ``rule``: watched for units of ``x`` at 0 whose output is
    not (their relevance is lost), where ``rule`` is given."""
    if rule is not None:
        watch_zero_inputs(rule, func, x, output, result)
    return result


def _is_zero(value: object) -> bool:
    """Whether ``value`` is the number 0, or a CPU tensor without gradient whose every element is 0 (on another
    device, reading it would wait for the device: not taken for one)."""
    return _is_number(value, 0.0)


def _is_infinite(value: object) -> bool:
    """Whether ``value`` is +inf, as a number or a one-element CPU tensor without gradient."""
    return _is_number(value, float("inf"))


def _is_number(value: object, number: float) -> bool:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == number
    value = unwrapped(value)
    if not isinstance(value, torch.Tensor) or value.requires_grad or value.is_complex() or value.device.type != "cpu":
        return False
    if value.numel() == 1:
        return bool(value == number)
    return number == 0 and value.numel() > 0 and not bool(value.any())


def clips_at_zero_only(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether the clip (see :func:`clips_a_signal`) or bound (see :func:`bounded_signal`) call is a ReLU: a lower
    bound of 0 and no upper one (``clamp(h, min=0)``, ``h.clamp_min(0)``, ``F.hardtanh(h, 0, inf)``,
    ``torch.maximum(h, zeros)``). Positively homogeneous, its plain gradient is its pass rule without a stabiliser,
    which would only move it off by ``stabilizer / |h|`` (LRP-0 stays gradient × input at inputs of any size).

    Examples:
        >>> h = torch.randn(3, requires_grad=True) * 1
        >>> clips_at_zero_only(torch.clamp, (h,), {"min": 0.0}), clips_at_zero_only(torch.clamp, (h, 0.0, 6.0), {})
        (True, False)
        >>> clips_at_zero_only(torch.clamp, (h, 0, float("inf")), {})
        True
        >>> clips_at_zero_only(torch.maximum, (torch.zeros(3), h), {}), clips_at_zero_only(F.relu6, (h,), {})
        (True, False)
    """
    base = CLIPS_IN_PLACE.get(func, func)
    if base in BOUNDS:
        maxima = (torch.maximum, torch.Tensor.maximum, torch.fmax, torch.Tensor.fmax, torch.max, torch.Tensor.max)
        other = call_argument(args, kwargs, 1, "other")  # of two tensors only: ``torch.max(h, 0)`` is a reduction
        return base in maxima and any(isinstance(v, torch.Tensor) and _is_zero(v) for v in (args[0], other))
    if base in (torch.clamp_min, torch.Tensor.clamp_min):
        return _is_zero(call_argument(args, kwargs, 1, "min"))
    if base in (torch.clamp, torch.Tensor.clamp, torch.clip, torch.Tensor.clip):
        low, high = call_argument(args, kwargs, 1, "min"), call_argument(args, kwargs, 2, "max")
        return (high is None or _is_infinite(high)) and _is_zero(low)
    if base is F.hardtanh:
        low, high = call_argument(args, kwargs, 1, "min_val", -1.0), call_argument(args, kwargs, 2, "max_val", 1.0)
        return _is_zero(low) and _is_infinite(high)
    return False


def clips_nothing(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether the clipping call (see :func:`clips_a_signal`) has no finite bound (``torch.clamp(h, -inf, inf)``,
    as Gemma 4's vision encoder clips until a checkpoint sets its bounds): the identity, whose plain gradient passes
    the relevance on exactly, where the pass rule's stabiliser would move it off by ``stabilizer / |h|``.

    Examples:
        >>> h, inf = torch.randn(3, requires_grad=True) * 1, float("inf")
        >>> clips_nothing(torch.clamp, (h, torch.tensor(-inf), torch.tensor(inf)), {}), clips_nothing(F.relu6, (h,), {})
        (True, False)
        >>> clips_nothing(torch.clamp, (h,), {"max": inf}), clips_nothing(torch.clamp, (h, -inf, 1.0), {})
        (True, False)
    """
    base = CLIPS_IN_PLACE.get(func, func)
    if base in (torch.clamp_min, torch.Tensor.clamp_min):
        return _is_number(call_argument(args, kwargs, 1, "min"), -float("inf"))
    if base in (torch.clamp_max, torch.Tensor.clamp_max):
        return _is_infinite(call_argument(args, kwargs, 1, "max"))
    if base in (torch.clamp, torch.Tensor.clamp, torch.clip, torch.Tensor.clip):
        low, high = call_argument(args, kwargs, 1, "min"), call_argument(args, kwargs, 2, "max")
    elif base is F.hardtanh:
        low, high = call_argument(args, kwargs, 1, "min_val", -1.0), call_argument(args, kwargs, 2, "max_val", 1.0)
    else:
        return False
    return (low is None or _is_number(low, -float("inf"))) and (high is None or _is_infinite(high))


def clip_bounds(args: tuple, kwargs: dict) -> list:
    """The bounds a clipping call is given (``inplace`` aside)."""
    return [*args[1:], *(value for key, value in kwargs.items() if key != "inplace")]


def clips_in_place(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether a clipping call changes its first argument."""
    return func in CLIPS_IN_PLACE or bool(
        func in (F.hardtanh, F.relu6) and call_argument(args, kwargs, 3 if func is F.hardtanh else 1, "inplace")
    )


def clip_passing(
    func: Callable,
    args: tuple,
    kwargs: dict,
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rule: Any = None,
) -> torch.Tensor:
    """The clipping call, with ``apply(output, x)`` (the pass or identity rule) on its activation ``x``; with bounds
    that are activations, the plain call. In place, the rule's output is copied into the argument. Where ``rule``
    (the rule ``apply`` is of) is given, a unit of ``x`` at exactly 0 whose output is not (a clip to bounds that
    exclude 0) is watched for, as :func:`bound_passing` does."""
    x = args[0]
    if any(is_activation(bound) for bound in clip_bounds(args, kwargs)):
        return mark_parameter_derived(args, func(*args, **kwargs))
    if clips_at_zero_only(func, args, kwargs) or clips_nothing(func, args, kwargs):  # a ReLU or the identity: its
        return func(*args, **kwargs)  # plain gradient, exact at any scale
    if not clips_in_place(func, args, kwargs):  # a tensor bound may broadcast the output beyond ``x``'s shape
        output = func(*args, **kwargs)
        x = x if x.shape == output.shape else x.expand(output.shape)
        return mark_clipped(_watched(rule, func, x, output, apply(output, x)))
    source = x.clone()  # the clipped values from a copy: the rule keeps the input as it was
    if func in CLIPS_IN_PLACE:
        clipped = CLIPS_IN_PLACE[func](source, *args[1:], **kwargs)
    elif func is F.hardtanh:
        bounds = call_argument(args, kwargs, 1, "min_val", -1.0), call_argument(args, kwargs, 2, "max_val", 1.0)
        clipped = F.hardtanh(source, *bounds)
    else:
        clipped = F.relu6(source)
    return _watched(rule, func, source, clipped, x.copy_(apply(clipped, source)))
