"""A plain ``nn.Module`` given to LRP with ``in_keys`` and ``out_keys``: its TensorDict wrapper, and a lean call.

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

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModule, TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution._keys import is_key

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
        TypeError: ``module`` is not an ``nn.Module``, an input key is no key, or the keys do not fit its kind.
    """
    for key in [in_keys] if isinstance(in_keys, str) else in_keys or ():
        if not is_key(key):
            raise TypeError(f"LRP: in_keys must hold keys (a str or a tuple of str), got {key!r} in {in_keys!r}")
    if not isinstance(module, TensorDictModuleBase):
        if not isinstance(module, nn.Module):
            raise TypeError(f"LRP wraps a TensorDictModuleBase or an nn.Module, got {type(module).__name__}")
        if in_keys is None or out_keys is None:
            raise TypeError(
                f"LRP needs in_keys and out_keys to wrap a plain {type(module).__name__}; "
                "give both, the names its inputs and outputs take in the TensorDict (in_keys=['x'], out_keys=['y']: "
                "it is then called as module(td['x']) and its output written at 'y'), or pass a TensorDictModule"
            )
        return TensorDictModule(module, in_keys=in_keys, out_keys=out_keys), True
    if out_keys is not None:
        raise TypeError("LRP: out_keys is only for a plain nn.Module: a TensorDict module declares its own")
    return module, False


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
