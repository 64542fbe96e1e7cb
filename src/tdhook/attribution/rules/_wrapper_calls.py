"""While an LRP context is open, its rules act in the wrapper's calls only; the model's own calls stay plain.

A context registers the rules on the model's modules once, and they stay there until it is left. A call of the
model itself in that time, not through the wrapper (a torchrl loss module calling the actor in a training step,
another attribution method, a comparison), ran with the rules too: its outputs were the model's, but the gradient
it sent back was the rules', and a training step took it, silently (the first layer of a ``Tanh`` MLP got a
gradient 2 % off, under ``EpsilonPlusFlat`` none at all). The wrapper marks its calls on their thread
(:class:`wrapper_call`) and its open contexts (:func:`context_opened`, :func:`context_closed`); a rule applies
where no context is open (a rule registered by hand) or inside a wrapper's call.

Examples:
    >>> class Wrapper:
    ...     pass
    >>> owner = Wrapper()
    >>> rules_act_here()
    True
    >>> context_opened(owner)
    >>> rules_act_here()  # a call of the model itself while a context is open
    False
    >>> with wrapper_call():  # a wrapper's call
    ...     rules_act_here()
    True
    >>> context_closed(owner)
    >>> rules_act_here()
    True
"""

from __future__ import annotations

import threading
import weakref

__all__ = ["context_closed", "context_opened", "in_a_wrapper_call", "rules_act_here", "wrapper_call"]


class _Calls(threading.local):
    depth = 0


_CALLS = _Calls()  # this thread's wrapper calls in progress
_OPEN: weakref.WeakSet = weakref.WeakSet()  # wrappers whose context is open (any thread)


class wrapper_call:  # a class, not a generator: it costs less per call
    """Mark the ``with`` block as a wrapper's call, for this thread."""

    __slots__ = ()

    def __enter__(self) -> None:
        _CALLS.depth += 1

    def __exit__(self, *exc_info: object) -> None:
        _CALLS.depth -= 1


def context_opened(owner: object) -> None:
    """Record that ``owner``'s context is open: its modules' own calls now run without rules."""
    _OPEN.add(owner)


def context_closed(owner: object) -> None:
    """Record that ``owner``'s context is closed."""
    _OPEN.discard(owner)


def in_a_wrapper_call() -> bool:
    """Whether a wrapper's call is in progress on this thread."""
    return _CALLS.depth > 0


def rules_act_here() -> bool:
    """Whether rules act on a module called now: inside a wrapper's call, or where no wrapper's context is open."""
    return _CALLS.depth > 0 or not _OPEN
