"""The first forward pass of an LRP context, where rules check what they cannot follow once, at no cost later.

The wrapper watches the first pass of each input signature in a context (see :mod:`tdhook.attribution._rule_use`); a
rule reads :func:`first_pass` to check its call's input then only, and notes in the set it returns what it warned
about, so that a module called several times in that pass, or in the first pass of another signature, warns once.

The pass belongs to the wrapper's call it started in (see
:func:`~tdhook.attribution.rules._wrapper_calls.current_call`): an interrupt (``KeyboardInterrupt``) arriving as it
ends, before the thread's state is put back, leaves a pass that no later call takes for its own.

Examples:
    >>> first_pass() is None
    True
    >>> with watching_first_pass():
    ...     warned = first_pass()
    ...     warned.add("a check")
    >>> sorted(warned), first_pass() is None
    (['a check'], True)
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any

from tdhook.attribution.rules._wrapper_calls import current_call

__all__ = ["first_pass", "watching_first_pass"]

_LOCAL = threading.local()


def first_pass() -> set[Any] | None:
    """In the first forward pass of a context on this thread, the set of what was warned about in it, else ``None``."""
    found = getattr(_LOCAL, "first", None)  # (what was warned about, the wrapper call's mark)
    return found[0] if found is not None and found[1] is current_call() else None


class watching_first_pass:  # noqa: N801 (used as a function: ``with watching_first_pass():``)
    """Run the block as the first forward pass of a context (see :func:`first_pass`), what the passes before it
    warned about being ``warned`` (copied: a pass that fails adds nothing to it).

    A class rather than a generator: the thread's state is put back by ``__exit__`` alone (a generator's
    ``finally``, an interrupt could skip).
    """

    def __init__(self, warned: Iterable[Any] = ()) -> None:
        self._warned = warned

    def __enter__(self) -> None:
        self._previous = getattr(_LOCAL, "first", None)
        _LOCAL.first = set(self._warned), current_call()

    def __exit__(self, *exc_info: object) -> None:
        _LOCAL.first = self._previous
