"""The grad mode of the code that called a wrapper, for rules on modules whose values depend on it.

A wrapper runs the model with gradient whatever the mode it is called in (a
collector calls its policy under ``torch.no_grad()``). A few torch modules
take another kernel when no gradient is recorded: the float32 ``nn.LSTM`` on
CPU gives values that differ in the last bits, which is enough to change a
recurrent policy's states and, now and then, its action. A rule on such a
module writes the values of the caller's mode (see
:class:`~tdhook.attribution.rules.recurrent.RecurrentRule`).

Examples:
    >>> import torch
    >>> with torch.no_grad(), called_in_grad_mode(torch.is_grad_enabled()), torch.enable_grad():
    ...     torch.is_grad_enabled(), caller_grad_enabled()
    (True, False)
    >>> caller_grad_enabled()
    True
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["called_in_grad_mode", "caller_grad_enabled"]

_LOCAL = threading.local()


@contextmanager
def called_in_grad_mode(enabled: bool) -> Iterator[None]:
    """Record, for this thread and the ``with`` block, the grad mode the wrapper was called in."""
    previous = getattr(_LOCAL, "enabled", True)
    _LOCAL.enabled = enabled
    try:
        yield
    finally:
        _LOCAL.enabled = previous


def caller_grad_enabled() -> bool:
    """Whether the wrapper running now was called with gradient enabled (True outside any wrapper call)."""
    return getattr(_LOCAL, "enabled", True)
