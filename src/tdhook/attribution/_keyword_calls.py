"""Calls with keyword tensors: a keyword that names no input key is refused with the names the call takes.

A wrapper called as ``lrp(observation=obs)`` (tensordict's ``dispatch``) builds its TensorDict from the keywords
that spell its in_keys (a nested key's parts joined by ``_``). A keyword that spells none (a typo, ``obs=``)
reached ``forward`` itself and failed with Python's "forward() got an unexpected keyword argument 'obs'", which
names neither the wrapper's keys nor how a nested key is spelt.

Examples:
    >>> import torch
    >>> from tdhook.attribution import LRP
    >>> lrp = LRP(torch.nn.Linear(3, 2), in_keys=[("agents", "obs")], out_keys=["y"])
    >>> lrp(agents_obs=torch.ones(4, 3))[1].shape
    torch.Size([4, 3])
    >>> lrp(obs=torch.ones(4, 3))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    TypeError: LRP: keyword 'obs' names no input key; ... names: agents_obs (a nested key's parts joined by '_')
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase, dispatch
from tensordict.utils import unravel_key

__all__ = ["keyword_dispatch"]


def keyword_dispatch(forward: Callable) -> Callable:
    """``forward`` (a ``TensorDictModuleBase`` method) called with a TensorDict or with keyword tensors, as
    ``dispatch(auto_batch_size=False)`` calls it, with a keyword that names no input key refused by name."""

    @functools.wraps(forward)
    def checked(self: TensorDictModuleBase, tensordict: TensorDictBase, **unexpected: object) -> object:
        if unexpected:
            raise _unexpected(self, unexpected)
        return forward(self, tensordict)

    return dispatch(auto_batch_size=False)(checked)


def _unexpected(module: TensorDictModuleBase, keywords: dict) -> TypeError:
    names = ["_".join(key) if isinstance(key, tuple) else key for key in map(unravel_key, module.in_keys)]
    listed = ", ".join(repr(name) for name in keywords)
    return TypeError(
        f"{type(module).__name__}: keyword{'s' if len(keywords) > 1 else ''} {listed} "
        f"name{'' if len(keywords) > 1 else 's'} no input key; called with keyword tensors, it takes its in_keys by "
        f"these names: {', '.join(names)} (a nested key's parts joined by '_')"
    )
