"""The signature of a wrapper's call: the keys of the TensorDict it is given, with each tensor's shape, dtype and
device, and the values of the non-tensor entries the model reads (a mode flag held as ``NonTensorData``).

What a wrapper's first call finds about its model (the nonlinear calls no rule covers, the gates computed with
functions that the CNN presets hold) holds for later calls that run the same code. A forward may branch on what
it is given (a gated path for sequences longer than a window, another for a single image, a key present or not),
and a later call on inputs of another signature may run code the first never ran: a ``tanh(h) * sigmoid(g)``
whose gate no later call held, with no word. So the watch and the gates' probe are decided per signature: a call
whose signature no call of the wrapper completed is watched again. A branch on the values alone, or on a flag of
the model, with the same signature, is not watched (it would take the watch at every call); under the CNN presets a
later call whose graph differs from those of its signature runs again in the gates' probe (see
:mod:`~tdhook.attribution._function_gates`).

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> short = call_signature(TensorDict(x=torch.zeros(2, 3, 4), batch_size=[2]))
    >>> short == call_signature(TensorDict(x=torch.ones(2, 3, 4), batch_size=[2]))  # values do not count
    True
    >>> short == call_signature(TensorDict(x=torch.zeros(2, 5, 4), batch_size=[2]))
    False
"""

from __future__ import annotations

from collections.abc import Collection, Hashable

import torch
from tensordict import LazyStackedTensorDict, NonTensorData, NonTensorStack, TensorDictBase, is_leaf_nontensor

from tdhook.attribution._writes import has_lazy_stack

__all__ = ["call_signature"]


def call_signature(tensordict: TensorDictBase, read: Collection[Hashable] = ()) -> Hashable:
    """The keys of ``tensordict``'s tensors with their shapes, dtypes and devices, and the values of its non-tensor
    entries at the keys ``read`` (unravelled: the model's inputs; a forward may branch on a flag, as on a shape);
    for a TensorDict that holds a lazy stack, whose entries may have no one shape, those of each stacked
    TensorDict's tensors, with the stack's dimension.

    Examples:
        >>> import torch
        >>> from tensordict import LazyStackedTensorDict, TensorDict
        >>> def stack(length):
        ...     return TensorDict(a=LazyStackedTensorDict(*[TensorDict(x=torch.zeros(length)) for _ in range(2)]))
        >>> call_signature(stack(2)) == call_signature(stack(2)), call_signature(stack(2)) == call_signature(stack(4))
        (True, False)
        >>> from tensordict import NonTensorData
        >>> def flagged(mode):
        ...     return TensorDict(x=torch.zeros(2, 3), mode=NonTensorData(mode, batch_size=[2]), batch_size=[2])
        >>> call_signature(flagged("gated"), read=["x", "mode"]) == call_signature(flagged("plain"), read=["x", "mode"])
        False
        >>> call_signature(flagged("gated"), read=["x"]) == call_signature(flagged("plain"), read=["x"])  # not read
        True
    """
    if has_lazy_stack(tensordict):
        return _nested_signature(tensordict, read)
    return tuple(
        (key, value.shape, value.dtype, value.device) if isinstance(value, torch.Tensor) else (key, _value_of(value))
        for key, value in tensordict.items(True, True, is_leaf=is_leaf_nontensor)
        if isinstance(value, torch.Tensor) or key in read
    )


def _value_of(entry: object) -> Hashable:
    """What a non-tensor entry holds, where it can be hashed (a string, a number, a tuple of them), else its type."""
    if isinstance(entry, NonTensorStack):
        data = tuple(entry.tolist())  # one value per entry of the stack
    elif isinstance(entry, NonTensorData):
        data = entry.data
    else:
        data = entry
    try:
        hash(data)
    except TypeError:
        return type(data)
    return data


def _nested_signature(tensordict: TensorDictBase, read: Collection[Hashable]) -> Hashable:
    """:func:`call_signature` taken level by level, through the TensorDicts a lazy stack holds (the values of its
    non-tensor entries taken wherever their key, at its level, is among ``read``)."""
    if isinstance(tensordict, LazyStackedTensorDict):
        parts = tuple(_nested_signature(part, read) for part in tensordict.tensordicts)
        return ("lazy stack", tensordict.stack_dim, parts)
    entries = []
    for key, value in tensordict.items(is_leaf=is_leaf_nontensor):
        if isinstance(value, torch.Tensor):
            entries.append((key, value.shape, value.dtype, value.device))
        elif isinstance(value, (NonTensorData, NonTensorStack)):
            if key in read:
                entries.append((key, _value_of(value)))
        elif isinstance(value, TensorDictBase):
            entries.append((key, _nested_signature(value, read)))
    return tuple(entries)
