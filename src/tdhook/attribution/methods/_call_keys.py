"""The keys a call explains where ``in_keys`` was left to its default: as LRP, not the flags and masks.

A method built without ``in_keys`` explains the module's inputs, as LRP does:
in a call, not those holding booleans (an action mask, ``is_init``: inputs
that steer the model, not evidence), nor the recurrent states a torchrl
``LSTMModule``/``GRUModule`` does without when the TensorDict lacks them.
Such a call runs on a shallow copy of the wrapper narrowed to the keys it
explains, with the per-key options of those keys.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tensordict.nn import TensorDictModule
    >>> from tdhook.attribution import Saliency
    >>> class Masked(torch.nn.Module):
    ...     def forward(self, obs, mask):
    ...         return obs * mask
    >>> saliency = Saliency(TensorDictModule(Masked(), in_keys=["obs", "mask"], out_keys=["y"]))
    >>> td = TensorDict(obs=torch.ones(2, 3), mask=torch.ones(2, 3, dtype=torch.bool), batch_size=[2])
    >>> keys_explained_in_call(saliency, td)
    [True, False]
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import unravel_key

from tdhook.attribution._inputs import explained_in_call
from tdhook.attribution.methods._options import entries

__all__ = ["keys_explained_in_call", "narrowed"]


def keys_explained_in_call(method: TensorDictModuleBase, tensordict: TensorDictBase) -> list[bool]:
    """Per explained key of ``method`` (a method of this package), whether a call on ``tensordict`` explains it
    (all of them where the caller named ``in_keys``; see :func:`~tdhook.attribution._inputs.explained_in_call`)."""
    return explained_in_call(tensordict, method.explained_keys, method._defaulted_inputs, method._optional_inputs)


def narrowed(method: TensorDictModuleBase, flags: list[bool]) -> TensorDictModuleBase:
    """A shallow copy of ``method`` (the same model, the same options) that explains the flagged keys alone.

    Options given per key (``method._per_key_options``: lists in the order of the explained keys) keep the
    entries of those keys; options resolved at each call (baselines, feature masks) are resolved against them.
    """
    keep = [i for i, flag in enumerate(flags) if flag]
    copied = copy.copy(method)
    copied.explained_keys = [method.explained_keys[i] for i in keep]
    if len(method.relevance_keys) == len(method.explained_keys):  # GradCAM writes them only when it upsamples
        copied.relevance_keys = [method.relevance_keys[i] for i in keep]
    for name in method._per_key_options:
        values = getattr(method, name)
        setattr(copied, name, [values[i] for i in keep])
    for name in method._per_call_options:  # a dict's entries for keys the call leaves out are not used
        value = getattr(method, name)
        if isinstance(value, Mapping):
            kept = {k: v for k, v in entries(value).items() if unravel_key(k) in copied.explained_keys}
            setattr(copied, name, kept)
    copied._defaulted_inputs = False
    return copied
