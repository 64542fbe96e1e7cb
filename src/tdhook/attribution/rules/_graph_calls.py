"""What a norm's rule tells a call that records its rules' places in the graph, and which norms run without a mode.

A wrapper's call may record where its rules act in the autograd graph, so that later calls on inputs of the same
shapes run the model without function modes and put the rules there as hooks (see
:mod:`tdhook.attribution._function_rule_plan`). A norm's rule
(:class:`~tdhook.attribution.rules.normalization.NormRule`) holds the normalising scale constant in a function mode
of its own, by detaching it. In a recording call the mode also tells where the scale's autograd node lies: behind
the node of the call that takes the scale (``x * rsqrt(...)``), at the scale's place among that node's inputs. A
later call runs such a norm's forward as it is (this thread reads :func:`runs_plain`) and stops the gradient at the
scale's node, which then passes none, as the detached scale passes none.

Examples:
    >>> import torch
    >>> norm = torch.nn.RMSNorm(3)
    >>> with norms_run_plain({id(norm)}):
    ...     runs_plain(norm)
    True
    >>> runs_plain(norm), recording() is None
    (False, True)
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn

__all__ = ["recording", "runs_plain", "norms_recorded", "norms_run_plain"]

_LOCAL = threading.local()


def recording() -> Any:
    """The recording of this thread's call in the modes, where a later call may run its norms plainly, or ``None``."""
    return getattr(_LOCAL, "recording", None)


def runs_plain(module: nn.Module) -> bool:
    """Whether ``module``'s forward runs in this thread's call without its rule's mode (the call's plan cuts the
    gradient of the scale it holds)."""
    plain = getattr(_LOCAL, "plain", None)
    return plain is not None and id(module) in plain


@contextmanager
def norms_recorded(record: Any) -> Iterator[None]:
    """Norms called in the block tell ``record`` where their scales' nodes are (see the module's docstring)."""
    _LOCAL.recording = record
    try:
        yield
    finally:
        _LOCAL.recording = None


@contextmanager
def norms_run_plain(modules: Collection[int]) -> Iterator[None]:
    """The modules whose ids are in ``modules`` run their forward without their rule's mode in the block."""
    _LOCAL.plain = modules
    try:
        yield
    finally:
        _LOCAL.plain = None
