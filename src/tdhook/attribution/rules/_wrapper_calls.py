"""While an LRP context is open, its rules act in the wrapper's calls only; the model's own calls stay plain.

A context registers the rules on the model's modules once, and they stay there until it is left. A call of the
model itself in that time, not through the wrapper (a torchrl loss module calling the actor in a training step,
another attribution method, a comparison), ran with the rules too: its outputs were the model's, but the gradient
it sent back was the rules', and a training step took it, silently (the first layer of a ``Tanh`` MLP got a
gradient 2 % off, under ``EpsilonPlusFlat`` none at all). The wrapper marks its calls on their thread
(:class:`wrapper_call`) and its open contexts with the modules they hold (:func:`context_opened`,
:func:`context_closed`); a rule applies inside a wrapper's call, and outside one on a module that no open context
holds (a rule registered by hand on another model), or where no context is open.

A wrapper's call is marked with the lock the wrapper holds for it, and a mark counts only while this thread holds
that lock: an interrupt (``KeyboardInterrupt``) arriving as the call's ``with`` block ends, before the mark is taken
off, leaves a mark that no longer counts, rather than a thread on which the model's own calls take the rules'
gradient from then on.

Examples:
    >>> class Wrapper:
    ...     pass
    >>> owner = Wrapper()
    >>> rules_act_here()
    True
    >>> held, other = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    >>> context_opened(owner, [held])
    >>> rules_act_here(held), rules_act_here(other)  # calls of the modules themselves while the context is open
    (False, True)
    >>> lock = threading.RLock()
    >>> with lock, wrapper_call(lock):  # a wrapper's call, which holds its lock
    ...     rules_act_here(held)
    True
    >>> mark = wrapper_call(lock)
    >>> mark.__enter__()  # an interrupt kept the mark's end from running ...
    >>> rules_act_here(held)  # ... but the lock is not held: no wrapper's call is in progress
    False
    >>> context_closed(owner, [held])
    >>> rules_act_here(held)
    True
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from tdhook.attribution.rules._identity import IdentityWeakKeyDict

__all__ = [
    "context_closed",
    "context_opened",
    "current_call",
    "in_a_wrapper_call",
    "rules_act_here",
    "wrapper_call",
]


class _Calls(threading.local):
    def __init__(self) -> None:
        self.marks: list = []  # the marks of this thread's wrapper calls in progress, innermost last


_CALLS = _Calls()
_OPEN: weakref.WeakSet = weakref.WeakSet()  # wrappers whose context is open (any thread)
_HELD: IdentityWeakKeyDict = IdentityWeakKeyDict()  # the modules those contexts hold


class wrapper_call:  # a class, not a generator: it costs less per call
    """Mark the ``with`` block as a wrapper's call, for this thread; ``lock`` is the ``threading.RLock`` the
    wrapper holds for the call (the mark counts while this thread holds it)."""

    __slots__ = ("_lock",)

    def __init__(self, lock: Any) -> None:
        self._lock = lock

    def __enter__(self) -> None:
        _CALLS.marks.append(self)

    def __exit__(self, *exc_info: object) -> None:
        marks = _CALLS.marks
        if marks and marks[-1] is self:
            marks.pop()


def current_call() -> wrapper_call | None:
    """The mark of the innermost wrapper's call in progress on this thread (one whose lock this thread holds), or
    ``None``. Marks an interrupt left behind (their lock released since) are dropped."""
    marks = _CALLS.marks
    while marks:
        if marks[-1]._lock._is_owned():
            return marks[-1]
        marks.pop()
    return None


def _in_call() -> bool:
    """Whether a wrapper's call is in progress on this thread."""
    return current_call() is not None


def context_opened(owner: object, modules: Iterable[torch.nn.Module] = ()) -> None:
    """Record that ``owner``'s context is open and holds ``modules``: their own calls now run without rules."""
    _OPEN.add(owner)
    for module in modules:
        _HELD[module] = True


def context_closed(owner: object, modules: Iterable[torch.nn.Module] = ()) -> None:
    """Record that ``owner``'s context, which held ``modules``, is closed."""
    for module in modules:
        _HELD.pop(module, None)
    _OPEN.discard(owner)


def in_a_wrapper_call() -> bool:
    """Whether a wrapper's call is in progress on this thread."""
    return _in_call()


def rules_act_here(module: torch.nn.Module | None = None) -> bool:
    """Whether rules act on ``module`` called now: inside a wrapper's call, where no wrapper's context is open, or
    on a module no open context holds (``None``: any module, as held)."""
    if not _OPEN or _in_call():
        return True
    return module is not None and module not in _HELD
