"""Calls with keyword tensors: a keyword that names no input key is refused with the names the call takes.

A wrapper called as ``lrp(observation=obs)`` (tensordict's ``dispatch``) builds its TensorDict from the keywords
that spell its in_keys (a nested key's parts joined by ``_``). A keyword that spells none (a typo, ``obs=``)
reached ``forward`` itself and failed with Python's "forward() got an unexpected keyword argument 'obs'", which
names neither the wrapper's keys nor how a nested key is spelt. A keyword that is an argument of the wrapper's
constructor (``target=``, given per call as captum's ``attribute`` takes it) is named as one.

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
import inspect
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
    owner = type(module).__name__
    options = [name for name in keywords if name in _constructor_arguments(type(module))]
    if options:  # captum's attribute(inputs, target=...) takes them per call
        given = ", ".join(f"{name}=..." for name in options)
        return TypeError(
            f"{owner}: {', '.join(map(repr, options))} {'is an argument' if len(options) == 1 else 'are arguments'} "
            f"of {owner}(...), not of its call: build the wrapper with {'it' if len(options) == 1 else 'them'}, "
            f"{owner}(module, ..., {given}), and call it on the inputs alone"
        )
    names = ["_".join(key) if isinstance(key, tuple) else key for key in map(unravel_key, module.in_keys)]
    listed = ", ".join(repr(name) for name in keywords)
    return TypeError(
        f"{owner}: keyword{'s' if len(keywords) > 1 else ''} {listed} "
        f"name{'' if len(keywords) > 1 else 's'} no input key; called with keyword tensors, it takes its in_keys by "
        f"these names: {', '.join(names)} (a nested key's parts joined by '_')"
    )


@functools.cache
def _constructor_arguments(cls: type) -> frozenset[str]:
    """The keyword arguments of ``cls``'s constructor (``target``, ``n_steps``, ...), but the module itself."""
    parameters = inspect.signature(cls).parameters.values()
    keywords = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in parameters if p.kind in keywords and p.name != "module")
