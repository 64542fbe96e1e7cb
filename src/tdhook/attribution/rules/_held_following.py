"""Tensors a recording call holds without a detach, followed through the calls made of them.

Under CP-LRP a recording call (see :mod:`tdhook.attribution._function_rule_plan`) may hold attention weights
constant without detaching them, so that later calls can run without the function mode. What is made of held
tensors alone is then a constant to the rules, as what is made of detached tensors is; :func:`follow_held` runs
one call of the mode and tells the recording what it made.

Examples:
    >>> tensors_in((torch.ones(1), [torch.zeros(2), 3], "a"))
    [tensor([1.]), tensor([0., 0.])]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.overrides import TorchFunctionMode

from tdhook.attribution.rules._autograd import PARAMETER_DERIVED, TEMPLATED
from tdhook.attribution.rules._input_values import INPUT_VALUES

if TYPE_CHECKING:
    from tdhook.attribution._function_rule_plan import Recording

__all__ = ["follow_held", "tensors_in"]


def follow_held(
    mode: TorchFunctionMode, func: Callable, types: tuple, args: tuple, kwargs: dict, recording: Recording
) -> object:
    """``func``'s call in the mode, in a recording call that holds tensors without detaching them: what is made of
    held tensors alone (a stack of attention weights, a buffer they are copied into) is a constant to the rules, as
    what is made of detached tensors (which needs no gradient) is; a held tensor that takes other values in place
    tells ``recording`` that the call strayed from a detached one's (it must run again, detached). Whatever is made
    of held tensors has the explained inputs' values (a branch on them is one on the inputs).

    The inputs are the tensors among ``args`` and ``kwargs`` and in the lists and tuples there (the first alone where
    the others give only a shape, dtype or device: ``w.type_as(x)``); the first argument counts as it was before the
    call (an in-place call changes it)."""
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    # What an in-place call may change: the first argument and, for a view, the tensor it views.
    targets = [] if first is None else [first] if first._base is None else [first, first._base]
    inputs = [first] if func in TEMPLATED and first is not None else tensors_in((*args, *kwargs.values()))
    followed, alone = recording.followed, recording.held_alone
    recording.follows = False  # the call itself runs as in any other call
    try:
        if not any(id(tensor) in followed for tensor in (*inputs, *targets)):
            return mode.__torch_function__(func, types, args, kwargs)  # most calls: no held tensor in them
        before = {id(t): (t.requires_grad, id(t) in alone, t._version) for t in targets}
        result = mode.__torch_function__(func, types, args, kwargs)
    finally:
        recording.follows = True
    needing = [
        before[id(tensor)][1] if tensor is first else id(tensor) in alone
        for tensor in inputs
        if (before[id(tensor)][0] if tensor is first else tensor.requires_grad)
    ]
    held = bool(needing) and all(needing)  # every input that needs a gradient is held
    changed = [target for target in targets if target._version != before[id(target)][2]]  # in place
    for output in {id(tensor): tensor for tensor in [*tensors_in((result,)), *changed]}.values():
        setattr(output, INPUT_VALUES, True)
        was = before.get(id(output))
        if not output.requires_grad:
            recording.made_of_held(output, alone=False)
        elif held and (was is None or was[1] or not was[0]):  # made of held tensors alone (an activation stays one)
            setattr(output, PARAMETER_DERIVED, True)
            recording.made_of_held(output, alone=True)
        elif not held and was is not None and was[1]:  # a held tensor that took other values in place
            recording.strayed = True
        else:
            recording.made_of_held(output, alone=False)
    return result


def tensors_in(values: tuple) -> list[torch.Tensor]:
    """The tensors among ``values`` and in the lists and tuples there (one level)."""
    found: list[torch.Tensor] = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(item for item in value if isinstance(item, torch.Tensor))
    return found
