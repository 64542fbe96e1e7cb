"""Operators called through ``torch.ops``: their names, and the ATen clips whose torch form has a rule.

A model can call an operator directly: ``torch.ops.aten.mul.Tensor(a, b)`` (an ``OpOverload``),
``torch.ops.aten.clamp(h, 0, 1)`` (an ``OpOverloadPacket``), or a custom operator of ``torch.library``
(``torch.ops.mylib.op.default``). A ``TorchFunctionMode`` sees such a call as it sees ``torch.*`` calls, but the
function modes of the presets give their rules to the ``torch.*`` functions themselves: an operator keeps its plain
gradient. :mod:`~tdhook.attribution._nonlinear_calls` judges an ATen operator by the name of the function it
computes (``aten.mul.Tensor`` is ``mul``, a product) and names it in full in its report; a custom operator is none
of torch's functions, whatever its name, and is judged not piecewise linear.

A clip (``clamp``, ``clip``, ``hardtanh``, ``relu6``, a maximum or minimum of an activation and a constant) is
piecewise linear, so its plain gradient is no error of its own, but the presets pass relevance through it where a
``torch.*`` call makes it (the rule ``nn.Hardtanh`` gets: a unit clipped at a bound other than zero keeps its
relevance, where its gradient is zero). :func:`unruled_clip` finds the ATen operators that make such a clip, which
no rule sees; :func:`unruled_sum` those that add two activations, which ``stabilize_additions`` stabilises in their
torch form.

Examples:
    >>> import torch
    >>> operator_name(torch.ops.aten.sin.default), operator_name(torch.ops.aten.clamp), operator_name(torch.sin)
    ('aten.sin.default', 'aten.clamp', None)
    >>> aten_function(torch.ops.aten._softmax.default), aten_function(torch.ops.aten.sin)
    ('_softmax', 'sin')
    >>> h = torch.randn(3, requires_grad=True) * 1
    >>> unruled_clip(torch.ops.aten.clamp.default, (h, -1.0, 1.0), {})
    'torch.clamp'
    >>> unruled_clip(torch.ops.aten.clamp.default, (h, h), {}) is None  # a bound that is an activation: no clip rule
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tdhook.attribution.rules._autograd import is_activation
from tdhook.attribution.rules._clips import bounded_signal, clip_bounds, clips_a_signal

__all__ = ["OPERATOR_FORM", "aten_function", "is_operator", "operator_name", "unruled_clip", "unruled_sum"]

#: what the coverage report puts between an ATen clip's name and its torch form's (``aten.clamp.default (the ATen
#: form of torch.clamp)``)
OPERATOR_FORM = "the ATen form of"

_OPERATORS = (torch._ops.OpOverload, torch._ops.OpOverloadPacket)

# The ATen clips, by operator name (in place too), and the torch function the presets' rules take them as.
_CLIPS: dict[str, Callable] = {"clamp": torch.clamp, "clip": torch.clip, "clamp_min": torch.clamp_min}
_CLIPS |= {"clamp_max": torch.clamp_max, "hardtanh": F.hardtanh, "relu6": F.relu6}
_CLIPS |= {f"{name}_": function for name, function in _CLIPS.items() if name != "relu6"}
# Element-wise maxima and minima: a clip where one tensor is an activation and the other a constant.
_BOUNDS: dict[str, Callable] = {"maximum": torch.maximum, "minimum": torch.minimum, "fmax": torch.fmax}
_BOUNDS |= {"fmin": torch.fmin, "max": torch.max, "min": torch.min}


def is_operator(func: Any) -> bool:
    """Whether ``func`` is an operator called through ``torch.ops`` (an ``OpOverload`` or ``OpOverloadPacket``)."""
    return isinstance(func, _OPERATORS)


def operator_name(func: Any) -> str | None:
    """The full name of an operator called through ``torch.ops`` (``"aten.mul.Tensor"``, ``"mylib.op.default"``,
    ``"aten.mul"`` for a packet); ``None`` for anything else."""
    if isinstance(func, torch._ops.OpOverload):
        return f"{func.namespace}.{func.overloadpacket.__name__}.{func._overloadname}"
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name.replace("::", ".")
    return None


def aten_function(func: Any) -> str | None:
    """The name of the ATen function an operator computes (``"mul"`` for ``aten.mul.Tensor``); ``None`` for a
    custom operator (another namespace) or anything that is no operator."""
    name = operator_name(func)
    if name is None or not name.startswith("aten."):
        return None
    return name.split(".")[1]


def unruled_sum(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Where an ATen operator adds two activations of the same shape, as a residual sum that ``stabilize_additions``
    stabilises would (``a + b``): ``"torch.add"``; else ``None``."""
    if aten_function(func) not in ("add", "add_") or kwargs or len(args) != 2:
        return None
    a, b = args
    return "torch.add" if is_activation(a) and is_activation(b) and a.shape == b.shape else None


def unruled_clip(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Where an ATen operator clips an activation at bounds that are no activations, as a ``torch.*`` clip the
    presets pass relevance through would: the name of that torch function; else ``None``."""
    name = aten_function(func)
    if name in _CLIPS:
        function = _CLIPS[name.rstrip("_")]
        bounds = clip_bounds(args, kwargs)
        if clips_a_signal(function, args) and not any(is_activation(bound) for bound in bounds):
            return f"{function.__module__.replace('torch.nn.functional', 'F')}.{function.__name__}"
    if name in _BOUNDS and bounded_signal(_BOUNDS[name], args, kwargs) is not None:
        return f"torch.{name}"
    return None
