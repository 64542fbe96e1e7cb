"""Whether the function modes are paused where a module's forward ends.

Inside a module whose rule decides its gradient as a whole (a router's held outputs), the wrapper pauses the function
modes (see :func:`~tdhook.attribution._context.suspend_function_modes_in`), and with them the mode a norm's rule
runs its forward in: the norm's calls go unseen there, and its rule has nothing to change, as nothing inside such a
module reaches the relevance. The refusals of a forward the rule cannot read do not apply there.

Examples:
    >>> import torch
    >>> function_modes_paused()
    False
    >>> with torch._C.DisableTorchFunction():
    ...     function_modes_paused()
    True
"""

from __future__ import annotations

import torch

__all__ = ["function_modes_paused"]


def function_modes_paused() -> bool:
    """Whether ``__torch_function__`` handling, the function modes' with it, is off at this point of a forward."""
    return not torch._C._is_torch_function_enabled()
