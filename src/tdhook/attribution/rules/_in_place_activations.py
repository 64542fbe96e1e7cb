"""Activation functions called in place (``F.elu(h, inplace=True)``, ``F.hardswish(h, True)``): the rule on a copy.

The identity rule of an activation called as a function passes ``grad · f(x) / x`` (see
:class:`~tdhook.attribution.rules.functional.FunctionalRules`). Called in place, the call writes ``f(x)`` over ``x``
before the rule reads it: the rule's ratio is then ``f(x) / f(x)``, and the relevance was neither the identity rule's
nor the plain gradient's (11 % off the same call made out of place for ``F.elu``, 24 % for ``F.hardswish``, with no
warning). As for a clip in place (see :func:`~tdhook.attribution.rules._clips.clip_passing`), the activation is
computed out of place from a copy of the input, the rule applied to it, and the result copied into the argument.

Examples:
    >>> import torch.nn.functional as F
    >>> from tdhook.attribution.rules.transformer import PseudoIdentityRule
    >>> x = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
    >>> h = x * 1
    >>> rule = PseudoIdentityRule()
    >>> z, source = activation_in_place(F.elu, (h,), {"inplace": True}, rule.apply, rule)
    >>> z is h, torch.allclose(x.detach() * torch.autograd.grad(z.sum(), x)[0], F.elu(x.detach()))
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tdhook.attribution.rules._autograd import call_argument
from tdhook.attribution.rules._zero_input_calls import watch_zero_inputs

__all__ = ["activation_in_place", "calls_in_place"]

# The position of the ``inplace`` argument of the activation functions that take one.
_IN_PLACE_POSITIONS = {F.elu: 2, F.celu: 2, F.leaky_relu: 2, F.selu: 1, F.silu: 1, F.mish: 1}
_IN_PLACE_POSITIONS |= {F.hardswish: 1, F.hardsigmoid: 1}


def calls_in_place(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether this activation call writes its output over its input (``inplace=True``, by keyword or position).

    Examples:
        >>> calls_in_place(F.elu, (torch.ones(1), 1.0, True), {}), calls_in_place(F.gelu, (torch.ones(1),), {})
        (True, False)
    """
    position = _IN_PLACE_POSITIONS.get(func)
    return position is not None and bool(call_argument(args, kwargs, position, "inplace", False))


def activation_in_place(
    func: Callable,
    args: tuple,
    kwargs: dict,
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rule: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The in-place activation call ``func(*args, **kwargs)``, with ``apply(output, x)`` (the identity rule, of
    ``rule``) on its input ``x`` as it was: computed out of place from a copy of ``x``, and the rule's output copied
    into ``x``; and that copy, the input the activation was computed from. Inputs at exactly 0 whose output is not
    are watched for, as for a call out of place (see
    :func:`~tdhook.attribution.rules._zero_input_calls.watch_zero_inputs`)."""
    position = _IN_PLACE_POSITIONS[func]
    x = args[0]
    source = x.clone()
    options = {key: value for key, value in kwargs.items() if key != "inplace"}
    output = func(source, *args[1:position], **options)
    result = x.copy_(apply(output, source))
    watch_zero_inputs(rule, func, source, output, result)
    return result, source
