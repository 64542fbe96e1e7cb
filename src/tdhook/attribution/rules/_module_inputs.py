"""A module call's tensors in the order of its forward's parameters, however the call gave them.

The hooks around a module's forward get its positional arguments and its keyword ones apart. The rules acting inside
the forward, the first call's watch and the modes' checks read the call's input as the first of them: a call that
gives it by keyword (``norm(input=x)``, torchrl's ``BatchRenorm1d(x=h)``, ``lstm(hx=state, input=x)``) puts its
tensors after the positional ones, in the order of the forward's parameters (read once per method), not
in the order the call names them: ``lstm(hx=state, input=x)`` reads ``x`` first, as ``lstm(x, state)`` does.

Examples:
    >>> from torch import nn
    >>> x, mask = torch.ones(2), torch.zeros(2)
    >>> inputs_in_forward(nn.LayerNorm(2), (), {"input": x})[0] is x
    True
    >>> class Masked(nn.Module):
    ...     def forward(self, x, mask=None):
    ...         return x if mask is None else x * mask
    >>> inputs_in_forward(Masked(), (), {"mask": mask, "x": x})[0] is x
    True
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch import nn

__all__ = ["inputs_in_forward"]


def inputs_in_forward(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """What a rule acting inside ``module``'s forward reads of a call's arguments: the positional ones, then the
    tensors given by keyword, in the order of the forward's parameters (names it does not have, taken by a
    ``**kwargs``, last, in the call's order). Other keyword values (flags, sizes, a state tuple) are no input of the
    norm or activation the rule follows.

    Examples:
        >>> x = torch.ones(2)
        >>> len(inputs_in_forward(nn.ReLU(), (x,), {"inplace": True}))
        1
        >>> lstm, state = nn.LSTM(2, 3), (torch.zeros(1, 3), torch.zeros(1, 3))
        >>> inputs_in_forward(lstm, (), {"hx": state, "input": x[None]})[0].shape
        torch.Size([1, 2])
    """
    if not kwargs:
        return args
    named = [name for name, value in kwargs.items() if isinstance(value, torch.Tensor)]
    if len(named) > 1:
        forward = module.forward  # the instance's own where one replaced it (a dispatch hook's partial)
        function = getattr(forward, "__func__", None)  # a method's function: kept, it holds no module
        places = _parameter_places(function) if function is not None else _places(forward)
        named.sort(key=lambda name: places.get(name, len(places)))  # stable: unknown names keep the call's order
    return (*args, *(kwargs[name] for name in named))


def _places(forward: Callable) -> dict[str, int]:
    """The place of each named parameter of ``forward`` (``{}`` where it has no signature to read)."""
    try:
        parameters = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return {}
    return {name: place for place, name in enumerate(parameters)}


_parameter_places = functools.lru_cache(maxsize=256)(_places)
