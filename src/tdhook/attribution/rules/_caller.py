"""Warnings shown at the caller's line: the first frame outside tdhook and the libraries it runs the model through.

A warning's location decides what Python's filters match (``warnings.filterwarnings(module=...)``, ``-W``,
pytest's ``filterwarnings``) and what the user reads. tdhook warns from deep inside a call: the wrapper's
``forward``, torch's module call, tensordict's dispatch, the rule's hook, the function mode. The depth differs
from one path to another (a call that enters the context itself, a wrapper inside a ``TensorDictSequential``,
``env.rollout``), so a fixed ``stacklevel`` points into tdhook on some of them. :func:`warn_at_caller` counts
the frames instead.

Examples:
    >>> import warnings
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_at_caller("a warning")
    >>> "tdhook" in caught[0].filename  # never a line of tdhook's own
    False
"""

from __future__ import annotations

import sys
import warnings

__all__ = ["warn_at_caller"]

# The packages a call of the wrapper passes through before the user's own code.
_LIBRARIES = frozenset({"tdhook", "torch", "tensordict", "torchrl", "contextlib", "functools"})


def warn_at_caller(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn(message, category)`` at the first frame outside tdhook, torch, tensordict and torchrl.

    Args:
        message: the warning's text.
        category: the warning's class.
    """
    level, frame = 2, sys._getframe(1)  # stacklevel 2: the frame that called this function
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] in _LIBRARIES:
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level if frame is not None else 2)
