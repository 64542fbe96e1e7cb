"""Reads of the explained inputs' values in a recording call: where a forward may take another way on other inputs.

A call of the function mode that records its rules' places (see :mod:`tdhook.attribution._function_rule_plan`)
makes a plan that later calls of the same shapes follow without the mode. A forward that hands the explained
inputs' values to Python (a branch, an index) may take another way on other inputs of the same shapes, with the same
graph and other rules (a product of two activations on one branch, of an activation and a constant on the other),
so a recording call that sees one read them makes no plan. :func:`watch_values` tells the recording where that
happens, and marks the tensors without gradient computed from the inputs, whose values the forward may read later.

Examples:
    >>> x = torch.randn(3, requires_grad=True)
    >>> positive = (x * 2).sum() > 0  # computed from the inputs, without gradient
    >>> from_inputs(x), from_inputs(positive), from_inputs(torch.ones(3))
    (True, False, False)
    >>> watch_values(None, torch.Tensor.__gt__, ((x * 2).sum(), 0), positive)
    >>> from_inputs(positive)
    True
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.nn import Parameter

from tdhook.attribution.rules._autograd import is_activation

if TYPE_CHECKING:
    from tdhook.attribution._function_rule_plan import Recording

__all__ = ["INPUT_VALUES", "VALUE_READS", "from_inputs", "watch_values"]

# Calls that hand a tensor's values to Python (a branch, an index): a forward that reads the explained inputs' values
# may take another way on other inputs of the same shapes, with the same graph and other rules (a product of two
# activations on one branch, of an activation and a constant on the other), so a recording call that sees one read
# them makes no plan (see :mod:`tdhook.attribution._function_rule_plan`).
VALUE_READS = frozenset(
    {torch.Tensor.__bool__, torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__}
    | {torch.Tensor.__complex__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__array__}
    | {torch.equal, torch.Tensor.equal, torch.allclose, torch.Tensor.allclose, torch.is_nonzero}
    | {torch.Tensor.is_nonzero}
)
#: Marks a tensor without gradient computed from the explained inputs' values (``x.sum() > 0``), in a recording call.
INPUT_VALUES = "_tdhook_input_values"


def from_inputs(value: object) -> bool:
    """Whether ``value`` is a tensor computed from the explained inputs: an activation, an input (a leaf with a
    gradient that is no parameter), or a tensor marked as computed from them (without gradient, or from tensors
    held without a detach: constants to the rules, but not in value)."""
    if not isinstance(value, torch.Tensor):
        return False
    if value.requires_grad and (is_activation(value) or (value.is_leaf and not isinstance(value, Parameter))):
        return True
    return getattr(value, INPUT_VALUES, False)


def watch_values(recording: Recording | None, func: Callable, args: tuple, result: object) -> None:
    """In a recording call: tell ``recording`` where the forward reads the explained inputs' values into Python, and
    mark the tensors without gradient computed from them, whose values it may read later."""
    if func in VALUE_READS:
        if recording is not None and args and from_inputs(args[0]):
            recording.read_values()
        return
    # The tensors a call returns: one, or several (the indices of sort, topk and max over a dimension).
    pieces = result if isinstance(result, (tuple, list)) else (result,)
    constants = [piece for piece in pieces if isinstance(piece, torch.Tensor) and not piece.requires_grad]
    if constants and any(from_inputs(a) for a in args):
        for piece in constants:
            setattr(piece, INPUT_VALUES, True)
