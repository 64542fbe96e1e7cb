"""Calls inside ``torch.utils.checkpoint`` regions, which the backward pass runs again: where a function rule stops.

A checkpointed region (``checkpoint(fn, x, use_reentrant=False)``, ``checkpoint_sequential``) keeps none of the
tensors its operations save for their backward; the backward pass runs the region's forward again and hands each
operation the tensors of that second run, matched by their order. Module rules are registered with hooks, which
run in that second forward too: their operations and the tensors they save are the same, and the relevance is
exact. A torch function mode (AttnLRP's and CP-LRP's rules on products and softmax, the gates held by function,
the stabilised additions) is on during the wrapper's forward pass only. The second run computes the plain
functions, which save other tensors: torch stops with a ``CheckpointError`` where their shapes differ, and where
they agree the rules' backward computes with the wrong tensors and the relevance is silently wrong. So a function
mode refuses to change a call inside such a region, naming the module that makes it.

Examples:
    >>> import torch
    >>> from torch.utils.checkpoint import checkpoint
    >>> class Scaled(torch.nn.Module):
    ...     def forward(self, x):
    ...         raise_for_checkpoint("a product's rule")
    ...         return 2 * x
    >>> x = torch.ones(2, requires_grad=True)
    >>> Scaled()(x).shape  # not checkpointed: nothing to refuse
    torch.Size([2])
    >>> try:
    ...     checkpoint(Scaled(), x, use_reentrant=False)
    ... except ValueError as err:
    ...     print(str(err)[:60])
    LRP: module Scaled runs inside torch.utils.checkpoint, whose
"""

from __future__ import annotations

import sys

import torch
from torch import nn

__all__ = [
    "in_checkpoint",
    "saved_tensors_hooked",
    "raise_for_checkpoint",
    "innermost_module",
    "error_in_running_module",
]

_TOP_HOOKS = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
_CALL_CODES = frozenset(
    getattr(nn.Module, name).__code__ for name in ("_call_impl", "_wrapped_call_impl") if hasattr(nn.Module, name)
)


def in_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are those of a ``torch.utils.checkpoint`` region (its tensors are
    recomputed in the backward pass)."""
    hooks = _TOP_HOOKS(False) if _TOP_HOOKS is not None else None
    return hooks is not None and getattr(hooks[0], "__module__", None) == "torch.utils.checkpoint"


def saved_tensors_hooked() -> bool:
    """Whether saved-tensor hooks are on (a checkpoint region's, an offload's): a saved tensor read in the forward
    pass goes through them (a checkpoint region runs its forward again to give it, an offload copies it back)."""
    return _TOP_HOOKS is not None and _TOP_HOOKS(False) is not None


def innermost_module() -> nn.Module | None:
    """The module whose call is running innermost on this thread's Python stack, or ``None``."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _CALL_CODES:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                return module
        frame = frame.f_back
    return None


def raise_for_checkpoint(what: str) -> None:
    """Raise where the current call runs inside a ``torch.utils.checkpoint`` region (see the module's docstring).

    Args:
        what: the rule that would change the call, for the message.

    Raises:
        ValueError: naming the module (its path is added by the LRP wrapper through the error's ``module``).
    """
    if not in_checkpoint():
        return
    raise error_in_running_module(
        ValueError,
        "runs inside torch.utils.checkpoint, whose backward pass recomputes the forward without the function rules "
        f"({what}), so the relevance would be computed with the plain functions' tensors. Explain the model "
        "without checkpointing (call the checkpointed block directly, or switch its checkpointing off), or use "
        "rules that are registered on modules only",
    )


def error_in_running_module(kind: type[Exception], what: str) -> Exception:
    """A ``kind`` error saying that the innermost running module ``what``; the module is kept on the error's
    ``module``, where the LRP wrapper reads it to name its path.

    Examples:
        >>> error_in_running_module(ValueError, "runs where no rule reaches")
        ValueError('LRP: a call runs where no rule reaches')
    """
    module = innermost_module()
    where = f"module {type(module).__name__}" if module is not None else "a call"
    error = kind(f"LRP: {where} {what}")
    error.module = module  # type: ignore[attr-defined]
    return error
