"""Activation functions called in place (``F.elu(h, inplace=True)``, ``F.hardswish(h, True)``): the rule on a copy.

The identity rule of an activation called as a function passes ``grad · f(x) / x`` (see
:class:`~tdhook.attribution.rules.functional.FunctionalRules`). Called in place, the call writes ``f(x)`` over ``x``
before the rule reads it: the rule's ratio is then ``f(x) / f(x)``, and the relevance was neither the identity rule's
nor the plain gradient's (11 % off the same call made out of place for ``F.elu``, 24 % for ``F.hardswish``, with no
warning). As for a clip in place (see :func:`~tdhook.attribution.rules._clips.clip_passing`), the activation is
computed out of place from a copy of the input, the rule applied to it, and the result copied into the argument.
The in-place functions and methods (``h.sigmoid_()``, ``torch.tanh_``, ``F.elu_``, ``torch.selu_``,
``torch.celu_``) are the same calls: they kept their plain gradient (11-109 % off the call made out of place, with a
warning) and now get the rule of their out-of-place form in the same way.

Examples:
    >>> import torch.nn.functional as F
    >>> from tdhook.attribution.rules.transformer import PseudoIdentityRule
    >>> x = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
    >>> h = x * 1
    >>> rule = PseudoIdentityRule()
    >>> z = activation_in_place(F.elu, (h,), {"inplace": True}, rule.apply, rule)
    >>> z is h, torch.allclose(x.detach() * torch.autograd.grad(z.sum(), x)[0], F.elu(x.detach()))
    (True, True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tdhook.attribution.rules._autograd import call_argument
from tdhook.attribution.rules._in_place_writes import GATE_MARKS, mark_written_in_place
from tdhook.attribution.rules._zero_input_calls import watch_zero_inputs
from tdhook.attribution.rules.gates import GATE_FUNCTIONS, mark_gate

__all__ = ["IN_PLACE_FORMS", "activation_in_place", "calls_in_place", "out_of_place"]

# The position of the ``inplace`` argument of the activation functions that take one.
_IN_PLACE_POSITIONS = {F.elu: 2, F.celu: 2, F.leaky_relu: 2, F.selu: 1, F.silu: 1, F.mish: 1}
_IN_PLACE_POSITIONS |= {F.hardswish: 1, F.hardsigmoid: 1}
#: in-place functions and methods → their out-of-place forms, which take the same arguments (``F.elu_(h, alpha)``)
IN_PLACE_FORMS = {torch.Tensor.sigmoid_: torch.sigmoid, torch.sigmoid_: torch.sigmoid}
IN_PLACE_FORMS |= {torch.Tensor.tanh_: torch.tanh, torch.tanh_: torch.tanh}
IN_PLACE_FORMS |= {F.elu_: F.elu, torch.selu_: F.selu, torch.celu_: F.celu}


def out_of_place(func: Callable) -> Callable:
    """The out-of-place form of an in-place activation function or method; any other function itself.

    Examples:
        >>> out_of_place(torch.Tensor.sigmoid_) is torch.sigmoid, out_of_place(F.gelu) is F.gelu
        (True, True)
    """
    return IN_PLACE_FORMS.get(func, func)


def calls_in_place(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether this activation call writes its output over its input (``inplace=True``, by keyword or position, or
    an in-place function or method such as ``h.tanh_()``).

    Examples:
        >>> calls_in_place(F.elu, (torch.ones(1), 1.0, True), {}), calls_in_place(F.gelu, (torch.ones(1),), {})
        (True, False)
        >>> calls_in_place(torch.Tensor.tanh_, (torch.ones(1),), {})
        True
    """
    if func in IN_PLACE_FORMS:
        return True
    position = _IN_PLACE_POSITIONS.get(func)
    return position is not None and bool(call_argument(args, kwargs, position, "inplace", False))


def activation_in_place(
    func: Callable,
    args: tuple,
    kwargs: dict,
    apply: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    rule: Any,
) -> torch.Tensor:
    """The in-place activation call ``func(*args, **kwargs)``, with ``apply(output, x)`` (the identity rule, of
    ``rule``) on its input ``x`` as it was: computed out of place from a copy of ``x``, and the rule's output copied
    into ``x``; and that copy, the input the activation was computed from. Inputs at exactly 0 whose output is not
    are watched for, as for a call out of place (see
    :func:`~tdhook.attribution.rules._zero_input_calls.watch_zero_inputs`). A sigmoid-like gate (``h.sigmoid_()``)
    is written as one, and ``x`` marked one, computed from the copy."""
    sigmoid = out_of_place(func) in GATE_FUNCTIONS
    x = args[0]
    source = x.clone()
    if func in IN_PLACE_FORMS:  # ``h.sigmoid_()``, ``F.elu_(h, alpha)``: its out-of-place form, same arguments
        func = IN_PLACE_FORMS[func]
        output = func(source, *args[1:], **kwargs)
    else:
        options = {key: value for key, value in kwargs.items() if key != "inplace"}
        output = func(source, *args[1 : _IN_PLACE_POSITIONS[func]], **options)
    ruled = apply(output, source)
    # Written as a write of the rule's output (a gate's values, of its kind) into ``x``: a view of a tensor whose
    # other elements are another activation's (``c[:, :3].tanh_()``) is then that tensor's gate in part.
    with torch._C.DisableTorchFunction():
        base = x._base
        if sigmoid and GATE_MARKS[0] in ruled.__dict__:
            ruled.__dict__[GATE_MARKS[1]] = True
    result = x.copy_(ruled) if base is None else mark_written_in_place(torch.Tensor.copy_, (x, ruled), {})
    watch_zero_inputs(rule, func, source, output, result)
    return mark_gate(result, source, sigmoid=True) if sigmoid else result
