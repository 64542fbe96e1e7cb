"""The LRP wrapper's options set after it is built: checked as the constructor checks them, or refused as fixed.

The keys the wrapper writes (``relevance_key``, ``token_relevance_key``) and the output it explains (``target_key``)
are settled when it is built: its ``out_keys`` and the targets' keys are derived from them, so setting one afterwards
changed nothing the calls did. ``memory_budget``, ``create_graph`` and ``relevance_check`` are read at each call or
context, and a value the constructor refuses is refused when set (see
:mod:`~tdhook.attribution.methods._settable_options`).

Examples:
    >>> import torch
    >>> from tdhook.attribution import LRP
    >>> lrp = LRP(torch.nn.Linear(3, 2), in_keys=["x"], out_keys=["y"])
    >>> lrp.memory_budget = 0
    Traceback (most recent call last):
    ...
    ValueError: LRP: memory_budget must be a positive number of bytes, got 0
    >>> lrp.relevance_key = "rel"  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    AttributeError: LRP: relevance_key is fixed when the wrapper is built; build a new LRP(..., relevance_key=...)
"""

from __future__ import annotations

from typing import Any

from tdhook.attribution._backward_passes import check_memory_budget
from tdhook.attribution.methods._options import checked_flag
from tdhook.attribution.methods._settable_options import CheckedOption, FixedKeys, FixedOption

__all__ = ["LRPOptions"]


def _memory_budget(value: Any, name: str, owner: str) -> int:
    return check_memory_budget(value)


def _relevance_check(check: Any, name: str, owner: str) -> Any:
    """``check``, a callable ``(name, module, relevance_in, relevance_out)`` or ``None``."""
    if check is not None and not callable(check):
        raise TypeError(
            f"{owner}: relevance_check must be a callable (name, module, relevance_in, relevance_out) or None, got "
            f"{type(check).__name__}"
        )
    return check


class LRPOptions(FixedKeys):
    """The attributes of LRP's options that can be set, or are fixed, after the wrapper is built (a mixin)."""

    token_relevance_key = FixedOption()
    create_graph = CheckedOption(checked_flag)
    memory_budget = CheckedOption(_memory_budget)
    relevance_check = CheckedOption(_relevance_check)
