"""The signature of a wrapper's call: the keys of the TensorDict it is given, with each tensor's shape, dtype and
device.

What a wrapper's first call finds about its model (the nonlinear calls no rule covers, the gates computed with
functions that the CNN presets hold) holds for later calls that run the same code. A forward may branch on what
it is given (a gated path for sequences longer than a window, another for a single image, a key present or not),
and a later call on inputs of another signature may run code the first never ran: a ``tanh(h) * sigmoid(g)``
whose gate no later call held, with no word. So the watch and the gates' probe are decided per signature: a call
whose signature no call of the wrapper completed is watched again. A branch on the values alone, with the same
signature, is not seen (it would take the watch at every call).

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

from collections.abc import Hashable

import torch
from tensordict import LazyStackedTensorDict, TensorDictBase

from tdhook.attribution._writes import has_lazy_stack

__all__ = ["call_signature"]


def call_signature(tensordict: TensorDictBase) -> Hashable:
    """The keys of ``tensordict``'s tensors with their shapes, dtypes and devices; for a TensorDict that holds a
    lazy stack, whose entries may have no one shape, those of each stacked TensorDict's tensors, with the stack's
    dimension.

    Examples:
        >>> import torch
        >>> from tensordict import LazyStackedTensorDict, TensorDict
        >>> def stack(length):
        ...     return TensorDict(a=LazyStackedTensorDict(*[TensorDict(x=torch.zeros(length)) for _ in range(2)]))
        >>> call_signature(stack(2)) == call_signature(stack(2)), call_signature(stack(2)) == call_signature(stack(4))
        (True, False)
    """
    if has_lazy_stack(tensordict):
        return _nested_signature(tensordict)
    return tuple(
        (key, value.shape, value.dtype, value.device)
        for key, value in tensordict.items(True, True)
        if isinstance(value, torch.Tensor)
    )


def _nested_signature(tensordict: TensorDictBase) -> Hashable:
    """:func:`call_signature` taken level by level, through the TensorDicts a lazy stack holds."""
    if isinstance(tensordict, LazyStackedTensorDict):
        return ("lazy stack", tensordict.stack_dim, tuple(_nested_signature(part) for part in tensordict.tensordicts))
    entries = []
    for key, value in tensordict.items():
        if isinstance(value, TensorDictBase):
            entries.append((key, _nested_signature(value)))
        elif isinstance(value, torch.Tensor):
            entries.append((key, value.shape, value.dtype, value.device))
    return tuple(entries)
