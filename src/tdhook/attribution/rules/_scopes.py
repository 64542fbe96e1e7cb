"""What a module's forward pre-hook starts and its forward hook ends, ended on every exit path of a call.

Some rules enter a context in a module's pre-hook and leave it in the module's
forward hook: a ``TorchFunctionMode`` of their own, a ``DisableTorchFunction``
guard that pauses the mapper's function modes, a copy of an in-place module's
input. torch runs a forward hook registered with ``always_call=True`` when the
forward raises an ``Exception``, but not when it raises ``KeyboardInterrupt``,
``SystemExit`` or ``GeneratorExit``: the mode or the guard would then stay on
for the rest of the process.

:func:`push` and :func:`pop` keep such items on a list of the caller's (one per
hook pair, shared by the threads that call the module) and, beside it, on one
stack per thread, which says whose each item is. :func:`closing_scopes`
wraps a call of the model: whatever the call pushed and did not pop is popped
when it ends, however it ends, context managers left in reverse order.

Examples:
    >>> import torch
    >>> pending = []
    >>> with closing_scopes():
    ...     push(pending, torch._C.DisableTorchFunction(), enter=True)
    ...     torch._C._is_torch_function_enabled()
    False
    >>> torch._C._is_torch_function_enabled(), pending
    (True, [])
"""

from __future__ import annotations

import threading
from typing import Any

from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

__all__ = ["push", "pop", "closing_scopes"]

_LOCAL = threading.local()


def _stack() -> list[list]:  # [pending, item, entered] entries
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def push(pending: list, item: Any, enter: bool = False) -> None:
    """Append ``item`` to ``pending``; with ``enter``, ``item`` is a context manager, entered now.

    Args:
        pending: the list of one pre-hook and forward-hook pair.
        item: what the forward hook will :func:`pop` (``None`` included).
        enter: whether ``item`` is a context manager to enter now and leave when popped.
    """
    entry = [pending, item, False]  # recorded before it is entered: an interrupt in between leaves nothing unlisted
    _stack().append(entry)
    pending.append(item)
    if enter and item is not None:
        entry[2] = (item.__enter__(), True)[1]  # entered and marked so in one line (no signal check in between)


def pop(pending: list) -> Any:
    """Remove and return the latest item this thread pushed on ``pending`` (``None`` where it pushed none), leaving it
    if it was entered.

    ``pending`` is shared by the threads that call the module: another thread's item, pushed between this thread's
    push and pop, is left for that thread's pop (it is not this call's mode, guard or snapshot).
    """
    if not pending:
        return None
    stack = _stack()
    for index in range(len(stack) - 1, -1, -1):  # the top, unless a call in between ended abnormally
        if stack[index][0] is pending:
            entry = stack[index]
            break
    else:
        return None
    _close(entry)  # left before it is unlisted: an interrupt in between leaves it for closing_scopes
    del stack[index]
    return entry[1]


def _close(entry: list, checked: bool = False) -> None:
    """Leave ``entry``'s item if it was entered (marked left in the same line), and take it off its list of pending
    items (:func:`_unlist`).

    ``checked`` (what a call's end closes, after an interrupt): a function mode is left where it is on top of torch's
    stack of modes, whatever the mark says, and only there. An interrupt inside torch's own ``__enter__`` or
    ``__exit__`` (after it pushed or popped the mode, before the mark) leaves the mark wrong; leaving the mode again
    would pop another one.
    """
    _, item, entered = entry
    if item is not None and (entered or checked):
        if checked and isinstance(item, TorchFunctionMode):
            modes = _get_current_function_mode_stack()
            entered = bool(modes) and modes[-1] is item
        if entered:
            entry[2] = (item.__exit__(None, None, None), False)[1]
    _unlist(entry)


def _unlist(entry: list) -> None:
    """Take ``entry``'s item off its list of pending items: the last of them, unless another thread pushed since."""
    pending, item, _ = entry
    for index in range(len(pending) - 1, -1, -1):
        if pending[index] is item:
            del pending[index]
            break


class closing_scopes:  # noqa: N801 (used as a function: ``with closing_scopes():``)
    """Run the block; then pop, newest first, what it pushed and did not pop (see the module's docstring).

    A class rather than a generator: it wraps every call of a wrapper, and entering it costs less this way.
    """

    def __enter__(self) -> None:
        self._stack = _stack()
        self._mark = len(self._stack)

    def __exit__(self, *exc_info: object) -> None:
        # The try first: an interrupt at any line of the closing leaves the rest closed all the same.
        try:
            while len(self._stack) > self._mark:
                _close(self._stack[-1], checked=True)
                self._stack.pop()
        except Exception:  # an item's exit that raised: dropped, the rest closed, and the error raised
            if len(self._stack) > self._mark:
                _unlist(self._stack.pop())
            self.__exit__()
            raise
        except BaseException:  # an interrupt: the entry cut short closed again (checked), then the rest
            self.__exit__()
            raise
