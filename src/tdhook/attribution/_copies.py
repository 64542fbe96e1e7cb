"""Copies of a model made inside an LRP context leave the context's hooks out.

Inside ``with lrp:`` the model's modules carry the rules' hooks. A
``copy.deepcopy`` of the model, or a pickle of it (``torch.save``), would copy
those hooks along: the copy would run the rules of the original's context,
with the original's modified weights, and write into its records. While the
context is open, each module gets a ``__getstate__`` of its own that hands
copies its state without the context's hooks, nor any hook of tdhook's made
since (those a call in flight in another thread has on the model); the module
itself keeps them, and the ``__getstate__`` goes when the context closes. A module whose class
copies itself by a protocol of its own, which reads ``__dict__`` and not
``__getstate__`` (a parametrized module's ``__deepcopy__``, as
``weight_norm`` and ``spectral_norm`` make it; a traced ``GraphModule``'s
``__reduce__``), also gets a ``__deepcopy__`` or ``__reduce_ex__`` of its own
that runs the class's protocol on a stand-in holding that state. Every module
gets the ``__deepcopy__``, which looks at the class when a copy is made: a
parametrization registered while the context is open gives the module a class
with a ``__deepcopy__`` of its own.

Examples:
    >>> import copy
    >>> from torch import nn
    >>> layer = nn.Linear(2, 2)
    >>> handle = layer.register_forward_hook(lambda module, args, output: None)
    >>> hidden = hide_from_copies([layer], {handle.id})
    >>> len(copy.deepcopy(layer)._forward_hooks), len(layer._forward_hooks)
    (0, 1)
    >>> hidden.remove()
    >>> len(copy.deepcopy(layer)._forward_hooks), "__getstate__" in vars(layer), "__deepcopy__" in vars(layer)
    (1, False, False)
"""

from __future__ import annotations

import copy
import copyreg
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from tdhook.attribution._orphan_hooks import is_ours
from tdhook.attribution._quiet_modules import QuietCall

__all__ = ["hide_from_copies", "wrapper_copy", "wrapper_state"]

_GETSTATE = "__getstate__"


def _state_without(state: dict, hook_ids: set[int], since: int) -> dict:
    """``state``, a module's ``__dict__`` or ``__getstate__``, without the context's entries: the hooks with
    ``hook_ids`` and tdhook's hooks with an id from ``since`` on (a call's, made while it runs), the copy methods
    :class:`HiddenFromCopies` sets, and the call step a plan's call sets on a quiet module for the call (a copy made
    in it would keep it)."""
    state = {
        name: value
        for name, value in state.items()
        if not isinstance(value, _OWN_METHODS) and not (name == "_call_impl" and isinstance(value, QuietCall))
    }
    dicts = [name for name, value in state.items() if "hooks" in name and isinstance(value, dict)]
    # _forward_hooks, _forward_pre_hooks and their companions (always-called, with-kwargs: ``True`` under the hook's
    # id) share the ids: a hook made since is left out where its callable is tdhook's, and so are its companions.
    left_out = set(hook_ids)
    for name in dicts:
        left_out.update(
            key
            for key, hook in state[name].items()
            if isinstance(key, int) and key >= since and key not in left_out and callable(hook) and is_ours(hook)
        )
    for name in dicts:
        if any(key in left_out for key in state[name]):
            state[name] = type(state[name])((key, hook) for key, hook in state[name].items() if key not in left_out)
    return state


class _StateWithoutHooks:
    """A module's ``__getstate__`` that leaves out the hooks with the given ids."""

    def __init__(self, module: nn.Module, hook_ids: set[int], since: int) -> None:
        self._module = weakref.ref(module)
        self._hook_ids = hook_ids
        self._since = since

    def __call__(self) -> Any:
        module = self._module()
        state = type(module).__getstate__(module)
        return _state_without(state, self._hook_ids, self._since) if isinstance(state, dict) else state


class _StandInCopies:
    """The class's own ``__deepcopy__`` or ``__reduce_ex__`` of a module, run on a stand-in: an instance of the
    module's class whose ``__dict__`` is the module's without the context's entries (its children are the module's
    own, copied by their own ``__getstate__``). A ``__deepcopy__`` of a module whose class has none (now) copies the
    module as ``copy.deepcopy`` does, through its ``__getstate__``."""

    def __init__(self, module: nn.Module, hook_ids: set[int], since: int, method: str) -> None:
        self._module = weakref.ref(module)
        self._hook_ids = hook_ids
        self._since = since
        self._method = method

    def _stand_in(self) -> nn.Module:
        module = self._module()
        cls = type(module)
        stand_in = cls.__new__(cls)
        object.__setattr__(stand_in, "__dict__", _state_without(vars(module), self._hook_ids, self._since))
        for slot in copyreg._slotnames(cls):  # type: ignore[attr-defined]
            if hasattr(module, slot):
                object.__setattr__(stand_in, slot, getattr(module, slot))
        return stand_in

    def __call__(self, argument: Any) -> Any:
        if self._method == _DEEPCOPY and _DEEPCOPY not in _own_protocols(self._module()):
            # No ``__deepcopy__`` of the class (now): ``copy.deepcopy``'s way, which reads ``__getstate__``.
            module, memo = self._module(), {} if argument is None else argument
            return copy._reconstruct(module, memo, *module.__reduce_ex__(4))  # type: ignore[attr-defined]
        stand_in = self._stand_in()
        if self._method == _DEEPCOPY:
            memo = {} if argument is None else argument
            memo.setdefault(id(memo), []).append(stand_in)  # alive while the copy runs: its id stays its own
            replica = type(stand_in).__deepcopy__(stand_in, memo)
            memo[id(self._module())] = replica
            return replica
        return type(stand_in).__reduce_ex__(stand_in, argument)


_OWN_METHODS = (_StateWithoutHooks, _StandInCopies)
_DEEPCOPY, _REDUCE_EX = "__deepcopy__", "__reduce_ex__"


def _own_protocols(module: nn.Module) -> list[str]:
    """The copy methods of ``module``'s class that bypass ``__getstate__``: a ``__deepcopy__``, and a ``__reduce__``
    or ``__reduce_ex__`` other than ``object``'s."""
    cls = type(module)
    methods = [_DEEPCOPY] if callable(getattr(cls, _DEEPCOPY, None)) else []
    if cls.__reduce__ is not object.__reduce__ or cls.__reduce_ex__ is not object.__reduce_ex__:
        methods.append(_REDUCE_EX)
    return methods


class HiddenFromCopies:
    """The modules whose copies leave hooks out; :meth:`remove` ends that (a hook handle's interface)."""

    def __init__(self, modules: Iterable[nn.Module], hook_ids: set[int]) -> None:
        self.hook_ids = hook_ids  # a hook of the context's added later is left out once its id is added here
        since = RemovableHandle.next_id  # and so is every hook of tdhook's made from now on (a call's)
        self._installed: list[tuple[weakref.ref, str, Callable]] = []
        try:
            for module in modules:  # each listed before it is installed, so that remove() finds it
                methods = {_GETSTATE: _StateWithoutHooks(module, hook_ids, since)}
                # Every module's __deepcopy__: a parametrization registered later gives the class one of its own.
                protocols = {_DEEPCOPY, *_own_protocols(module)}
                methods.update({name: _StandInCopies(module, hook_ids, since, name) for name in sorted(protocols)})
                for name, method in methods.items():
                    self._installed.append((weakref.ref(module), name, method))
                    module.__dict__[name] = method
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Give the modules back their own copy methods (each listed until it is given back)."""
        installed = self._installed
        while installed:
            ref, name, method = installed[-1]
            module = ref()
            if module is not None and module.__dict__.get(name) is method:
                del module.__dict__[name]
            installed.pop()


def hide_from_copies(modules: Iterable[nn.Module], hook_ids: set[int]) -> HiddenFromCopies:
    """Make copies (``copy.deepcopy``, ``copy.copy``, pickle) of ``modules`` leave out the hooks with ``hook_ids``,
    and the hooks of tdhook's made from now on (a call's, which a copy made while it runs in another thread sees).

    Args:
        modules: the model's modules.
        hook_ids: the ``id`` of each hook handle to leave out.

    Returns:
        What undoes it, with a ``remove()`` method like a hook handle's.
    """
    return HiddenFromCopies(modules, hook_ids)


def wrapper_state(wrapper: Any, module_state: Callable[[], dict]) -> dict:
    """The state a copy or a pickle of an LRP ``wrapper`` gets (its ``__getstate__``): ``module_state()`` without the
    lock, taken once a call of another thread (which enters a context for its length) has ended; and with the rules
    on, since an ``inactive()`` block is the original's.

    Args:
        wrapper: the LRP wrapper.
        module_state: its ``nn.Module`` state.

    Raises:
        RuntimeError: the wrapper's context is open.

    Examples:
        >>> import threading
        >>> class Wrapper:
        ...     _lock, _handles = threading.RLock(), None
        >>> wrapper_state(Wrapper(), lambda: {"_lock": None, "_inactive": True, "module": "net"})
        {'_inactive': False, 'module': 'net'}
    """
    with wrapper._lock:
        if wrapper._handles is not None:
            raise RuntimeError("LRP: leave the wrapper's context before copying or pickling it")
        state = {name: value for name, value in module_state().items() if name != "_lock"}
    state["_inactive"] = False
    return state


def wrapper_copy(wrapper: Any, memo: dict) -> Any:
    """A deep copy of an LRP ``wrapper`` (its ``__deepcopy__``), made holding its lock: a call of another thread
    ends first, and none starts while the model is copied.

    Examples:
        >>> import threading
        >>> class Wrapper:
        ...     _lock, _handles = threading.RLock(), None
        ...     def __getstate__(self):
        ...         return {"weights": [1.0]}
        ...     def __setstate__(self, state):
        ...         self.__dict__.update(state)
        >>> wrapper = Wrapper()
        >>> copied = wrapper_copy(wrapper, {})
        >>> type(copied).__name__, copied.weights
        ('Wrapper', [1.0])
    """
    with wrapper._lock:
        state = wrapper.__getstate__()
        copied = type(wrapper).__new__(type(wrapper))
        memo[id(wrapper)] = copied
        copied.__setstate__(copy.deepcopy(state, memo))
        return copied
