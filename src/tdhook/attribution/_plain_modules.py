"""A plain ``nn.Module`` given to LRP with ``in_keys`` and ``out_keys``: its TensorDict wrapper, and a lean call.

A metric or a method on a plain module wraps it on every call. ``TensorDictModule``'s constructor checks its keys
and sets each attribute through ``nn.Module.__setattr__``, about 25 µs, as long as a metric's whole setup on a small
model. A wrapper for keys wrapped before is built from the attributes the first one got instead (copies of them),
in about 8 µs: the same object, with the same attributes.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> wrapper, plain = as_tensordict_module(torch.nn.Linear(3, 2), ["x"], ["y"])
    >>> plain, wrapper.in_keys, wrapper.out_keys
    (True, ['x'], ['y'])
    >>> call_plain(wrapper, TensorDict(x=torch.ones(4, 3), batch_size=[4]))["y"].shape
    torch.Size([4, 2])
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

__all__ = ["as_tensordict_module", "call_plain"]


def as_tensordict_module(
    module: TensorDictModuleBase | nn.Module,
    in_keys: Sequence[NestedKey] | None,
    out_keys: Sequence[NestedKey] | None,
) -> tuple[TensorDictModuleBase, bool]:
    """``module`` as a TensorDict module, a plain ``nn.Module`` wrapped in a ``TensorDictModule``.

    Args:
        module: a ``TensorDictModuleBase``, or a plain ``nn.Module``.
        in_keys: a plain module's input keys (required for one).
        out_keys: a plain module's output keys (required for one, refused
            for a TensorDict module, which declares its own).

    Returns:
        The TensorDict module, and whether ``module`` was a plain one.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, or the keys do not fit its kind.
    """
    if not isinstance(module, TensorDictModuleBase):
        if not isinstance(module, nn.Module):
            raise TypeError(f"LRP wraps a TensorDictModuleBase or an nn.Module, got {type(module).__name__}")
        if in_keys is None or out_keys is None:
            raise TypeError(
                f"LRP needs in_keys and out_keys to wrap a plain {type(module).__name__}; "
                "give both, the names its inputs and outputs take in the TensorDict (in_keys=['x'], out_keys=['y']: "
                "it is then called as module(td['x']) and its output written at 'y'), or pass a TensorDictModule"
            )
        return _wrapped(module, in_keys, out_keys), True
    if out_keys is not None:
        raise TypeError("out_keys is only for a plain nn.Module: a TensorDict module declares its own")
    return module, False


# The attributes of a TensorDictModule beyond those every nn.Module has (its keys, its options), as the constructor set
# them for each pair of in and out keys seen: a hundred pairs at most.
_WRAPPER_STATE: dict[tuple, dict[str, object]] = {}
_LARGEST_STATE = 100
_MODULE_STATE = frozenset(nn.Module().__dict__)


def _wrapped(module: nn.Module, in_keys: Sequence[NestedKey], out_keys: Sequence[NestedKey]) -> TensorDictModule:
    """``TensorDictModule(module, in_keys=in_keys, out_keys=out_keys)``, from the attributes of the last such wrapper
    made for the same keys where there was one.

    Examples:
        >>> first = _wrapped(torch.nn.Linear(3, 2), ["x"], ["y"])
        >>> second = _wrapped(torch.nn.Linear(3, 2), ["x"], ["y"])
        >>> second.in_keys, second.out_keys, second.in_keys is first.in_keys
        (['x'], ['y'], False)
    """
    try:  # a str or a tuple is one key, a list several: the type tells them apart
        keys = (type(in_keys), tuple(in_keys), type(out_keys), tuple(out_keys))
        state = _WRAPPER_STATE.get(keys)
    except TypeError:  # keys that do not hash (a dict of inputs)
        return TensorDictModule(module, in_keys=in_keys, out_keys=out_keys)
    if state is None:
        wrapper = TensorDictModule(module, in_keys=in_keys, out_keys=out_keys)
        if len(_WRAPPER_STATE) >= _LARGEST_STATE:
            _WRAPPER_STATE.clear()
        _WRAPPER_STATE[keys] = _copied({k: v for k, v in wrapper.__dict__.items() if k not in _MODULE_STATE})
        return wrapper
    wrapper = TensorDictModule.__new__(TensorDictModule)
    nn.Module.__init__(wrapper)
    wrapper.__dict__.update(_copied(state))
    wrapper.module = module
    return wrapper


def _copied(state: dict[str, object]) -> dict[str, object]:
    """``state`` with its lists and dicts copied (a wrapper may change its keys), those it shares shared in the copy
    (its out keys are one list under two names)."""
    copies: dict[int, object] = {}
    copied = {}
    for name, value in state.items():
        if isinstance(value, (list, dict)):
            if id(value) not in copies:
                copies[id(value)] = value.copy() if type(value) in (list, dict) else copy.copy(value)
            value = copies[id(value)]
        copied[name] = value
    return copied


def call_plain(wrapper: TensorDictModule, work: TensorDictBase) -> TensorDictBase:
    """Run the plain module inside ``wrapper`` on ``work`` and write its outputs there.

    The module is called directly, without the generic conversion of every
    output that ``TensorDictModule`` applies (a fixed cost per call, large
    next to a small policy).

    Args:
        wrapper: the ``TensorDictModule`` made by :func:`as_tensordict_module`.
        work: the TensorDict to read the inputs from and write the outputs to.

    Returns:
        ``work``.

    Raises:
        RuntimeError: the module returned a number of outputs other than that
            of its out keys.
    """
    outputs = wrapper.module(*(work.get(key) for key in wrapper.in_keys))
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    if len(outputs) != len(wrapper.out_keys):
        raise RuntimeError(
            f"LRP: the module returned {len(outputs)} outputs for the {len(wrapper.out_keys)} out_keys "
            f"{wrapper.out_keys}"
        )
    for key, value in zip(wrapper.out_keys, outputs, strict=True):
        if key != "_":  # TensorDictModule's placeholder for an output to drop
            work.set(key, value if isinstance(value, torch.Tensor) else TensorDict.from_any(value))
    return work
