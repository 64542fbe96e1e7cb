"""The signature of a wrapper's call: the keys of the TensorDict it is given, with each tensor's shape, dtype and
device.

What a wrapper's first call finds about its model (the nonlinear calls no rule covers, the gates computed with
functions that the CNN presets hold) holds for later calls that run the same code. A forward may branch on what
it is given (a gated path for sequences longer than a window, another for a single image, a key present or not),
and a later call on inputs of another signature may run code the first never ran: a ``tanh(h) * sigmoid(g)``
whose gate no later call held, with no word. So the watch and the gates' probe are decided per signature: a call
whose signature no call of the wrapper completed is watched again (under the function rules alone, whose watch only
reports, where its graph differs from a watched call's: see :func:`~tdhook.attribution._model_run.run_model`). A
branch on the values alone, with the same signature, is not seen (it would take the watch at every call).

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
from tensordict import TensorDictBase

from tdhook.attribution._writes import has_lazy_stack

__all__ = ["LAZY_STACK", "call_signature"]

LAZY_STACK = ("lazy stack",)  # the signature of every call given a lazy stack: one, watched once, as before


def call_signature(tensordict: TensorDictBase) -> Hashable:
    """The keys of ``tensordict``'s tensors with their shapes, dtypes and devices (:data:`LAZY_STACK` for a
    TensorDict that holds a lazy stack, whose entries may have no one shape)."""
    if has_lazy_stack(tensordict):
        return LAZY_STACK
    return tuple(
        (key, value.shape, value.dtype, value.device)
        for key, value in tensordict.items(True, True)
        if isinstance(value, torch.Tensor)
    )
