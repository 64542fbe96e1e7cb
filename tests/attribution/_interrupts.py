"""Raising ``KeyboardInterrupt`` at a chosen line of tdhook's own code, through ``sys.settrace``."""

from __future__ import annotations

import dis
import functools
import linecache
import sys
from collections.abc import Callable
from pathlib import Path

import tdhook

SOURCE = str(Path(tdhook.__file__).parent)


@functools.cache
def _inlined_comprehension_lines(code) -> frozenset[int]:
    """The lines of ``code`` that hold a comprehension CPython 3.12+ runs in the function's own frame (PEP 709).

    An exception that a trace function raises at a line event of such a line skips the ``except`` and ``finally``
    blocks around it (seen on CPython 3.12 and 3.13), which a real interrupt does not: a ``KeyboardInterrupt``
    from a signal handler inside the comprehension's loop runs them. Those line events are not counted. CPython
    3.11 runs a comprehension in a frame of its own, whose events are counted.
    """
    if sys.version_info < (3, 12):
        return frozenset()
    lines: set[int] = set()
    inside, loops, line = False, 0, None  # from a comprehension's LOAD_FAST_AND_CLEAR to the end of its loops
    for instruction in dis.get_instructions(code):
        line = instruction.positions.lineno or line
        inside = inside or instruction.opname == "LOAD_FAST_AND_CLEAR"
        if inside and line is not None:
            lines.add(line)
        loops += inside and instruction.opname == "FOR_ITER"
        if inside and instruction.opname == "END_FOR":
            loops -= 1
            inside = loops > 0
    return frozenset(lines)


class Interrupt:
    """Raise ``KeyboardInterrupt`` at the ``at``-th line event of tdhook's source inside the block (never, with
    ``at=None``: then :attr:`count` is the number of line events), and catch it; :attr:`where` says where it was
    raised (``None``: the block ran fewer lines, and ended as it does without an interrupt). Functions named in
    ``skip``, and what they call, are not traced; with ``within``, only the lines of the source file of that name
    are counted."""

    def __init__(self, at: int | None, skip: tuple[str, ...] = (), within: str | None = None) -> None:
        self.at, self.count, self.where, self.skip, self.within = at, 0, None, skip, within

    def _local(self, frame, event, arg):
        if event != "line":
            return self._local
        if self.within is not None and Path(frame.f_code.co_filename).name != self.within:
            return self._local
        lines = self._seen.setdefault(id(frame), set())
        text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        if text.startswith(("with ", "async with ")) and frame.f_lineno in lines:
            return self._local  # leaving a with block: the context manager's __exit__ comes next
        if frame.f_lineno in _inlined_comprehension_lines(frame.f_code):
            return self._local
        if text == "try:":
            # A NOP, outside the exception table of an enclosing ``with`` in CPython 3.11: an exception raised
            # there by a trace function skips that ``__exit__``. A real interrupt arrives only where the
            # interpreter checks for signals (calls, jumps back), never at such a NOP.
            return self._local
        lines.add(frame.f_lineno)
        self.count += 1
        if self.count == self.at:
            sys.settrace(self._previous)
            self.where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} ({frame.f_code.co_name})"
            raise KeyboardInterrupt(self.where)
        return self._local

    def _global(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(SOURCE):
            return None
        caller = frame
        while caller is not None:
            if caller.f_code.co_name in self.skip:
                return None
            caller = caller.f_back
        return self._local

    def __enter__(self) -> Interrupt:
        self._seen: dict[int, set[int]] = {}
        self._previous = sys.gettrace()  # a coverage tool's, put back on the way out
        sys.settrace(self._global)
        return self

    def __exit__(self, kind: type | None, *exc_info: object) -> bool:
        sys.settrace(self._previous)
        return kind is KeyboardInterrupt and self.where is not None  # its own interrupt: raised, and caught here


# Every STRIDE-th line, from a start that differs per test, keeps the suite fast; every line was checked by hand.
STRIDE = 9


def every_line(
    run: Callable[[], object],
    skip: tuple[str, ...] = (),
    start: int = 1,
    stride: int = STRIDE,
    within: str | None = None,
) -> range:
    """The line events of tdhook's code (of the file ``within`` only, if given) that ``run()`` goes through (every
    STRIDE-th, from ``start``)."""
    with Interrupt(None, skip, within) as counting:
        run()
    return range(start, counting.count + 1, stride)
