"""Copies of a model made inside an LRP context leave the context's hooks out.

Inside ``with lrp:`` the model's modules carry the rules' hooks. A
``copy.deepcopy`` of the model, or a pickle of it (``torch.save``), would copy
those hooks along: the copy would run the rules of the original's context,
with the original's modified weights, and write into its records. While the
context is open, each module gets a ``__getstate__`` of its own that hands
copies its state without the context's hooks; the module itself keeps them,
and the ``__getstate__`` goes when the context closes.

Examples:
    >>> import copy
    >>> from torch import nn
    >>> layer = nn.Linear(2, 2)
    >>> handle = layer.register_forward_hook(lambda module, args, output: None)
    >>> hidden = hide_from_copies([layer], {handle.id})
    >>> len(copy.deepcopy(layer)._forward_hooks), len(layer._forward_hooks)
    (0, 1)
    >>> hidden.remove()
    >>> len(copy.deepcopy(layer)._forward_hooks), "__getstate__" in vars(layer)
    (1, False)
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

from torch import nn

from tdhook.attribution._quiet_modules import QuietCall

__all__ = ["hide_from_copies"]

_GETSTATE = "__getstate__"


class _StateWithoutHooks:
    """A module's ``__getstate__`` that leaves out the hooks with the given ids."""

    def __init__(self, module: nn.Module, hook_ids: set[int]) -> None:
        self._module = weakref.ref(module)
        self._hook_ids = hook_ids

    def __call__(self) -> Any:
        module = self._module()
        state = type(module).__getstate__(module)
        if not isinstance(state, dict):
            return state
        # Nor the call step a plan's call sets on a quiet module for the call (a copy made in it would keep it).
        state = {
            name: value
            for name, value in state.items()
            if name != _GETSTATE and not (name == "_call_impl" and isinstance(value, QuietCall))
        }
        for name, value in state.items():
            # _forward_hooks, _forward_pre_hooks and their companions (always-called, with-kwargs) share the ids.
            if "hooks" in name and isinstance(value, dict) and any(key in self._hook_ids for key in value):
                state[name] = type(value)((key, hook) for key, hook in value.items() if key not in self._hook_ids)
        return state


class HiddenFromCopies:
    """The modules whose copies leave hooks out; :meth:`remove` ends that (a hook handle's interface)."""

    def __init__(self, modules: Iterable[nn.Module], hook_ids: set[int]) -> None:
        self.hook_ids = hook_ids  # a hook of the context's added later is left out once its id is added here
        self._installed: list[tuple[weakref.ref, _StateWithoutHooks]] = []
        try:
            for module in modules:  # each listed before it is installed, so that remove() finds it
                getstate = _StateWithoutHooks(module, hook_ids)
                self._installed.append((weakref.ref(module), getstate))
                module.__dict__[_GETSTATE] = getstate
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Give the modules back their own ``__getstate__`` (each listed until it is given back)."""
        installed = self._installed
        while installed:
            ref, getstate = installed[-1]
            module = ref()
            if module is not None and module.__dict__.get(_GETSTATE) is getstate:
                del module.__dict__[_GETSTATE]
            installed.pop()


def hide_from_copies(modules: Iterable[nn.Module], hook_ids: set[int]) -> HiddenFromCopies:
    """Make copies (``copy.deepcopy``, ``copy.copy``, pickle) of ``modules`` leave out the hooks with ``hook_ids``.

    Args:
        modules: the model's modules.
        hook_ids: the ``id`` of each hook handle to leave out.

    Returns:
        What undoes it, with a ``remove()`` method like a hook handle's.
    """
    return HiddenFromCopies(modules, hook_ids)
