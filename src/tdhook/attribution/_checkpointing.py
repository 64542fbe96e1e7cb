"""Modules that recompute their forward pass in the backward pass (gradient checkpointing in training mode).

A checkpointed block keeps no activations: the backward pass runs its forward again to rebuild them. That second
forward runs after the explained call, outside the rules' function modes, so it computes other tensors than the
ones the rules saved (torch then stops with a ``CheckpointError``), or, where their shapes happen to match,
gives relevance with rules missing. The LRP wrapper refuses such a model before running it, naming the module.
Hugging Face marks a checkpointed module with a boolean ``gradient_checkpointing`` attribute, which it honours in
training mode only.

``torch.utils.checkpoint`` called by a model's own code is seen while the model runs: with ``use_reentrant=False``
the module rules run again in the recomputation and the relevance is exact, and the function rules refuse a
checkpointed region (see :mod:`~tdhook.attribution.rules._recomputed`); with ``use_reentrant=True`` the region
runs without gradients and its backward cannot be taken by ``torch.autograd.grad``, which torch refuses in the
backward pass: :func:`reentrant_checkpoint_error` names the checkpointed module in that error.

Examples:
    >>> from torch import nn
    >>> block = nn.Linear(2, 2)
    >>> block.gradient_checkpointing = True
    >>> candidates = checkpointing_modules({"block": block})
    >>> raise_for_checkpointing("LRP", candidates)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: LRP: module 'block' (Linear) has gradient checkpointing on in training mode: ...
    >>> raise_for_checkpointing("LRP", checkpointing_modules({"block": block.eval()}))  # eval mode: no checkpoint
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from tdhook.attribution.rules._autograd import relevance_pass_edges

__all__ = ["checkpointing_modules", "raise_for_checkpointing", "reentrant_checkpoint_error"]


def checkpointing_modules(modules: Mapping[str, nn.Module]) -> list[tuple[str, nn.Module]]:
    """The modules among ``modules`` that can switch gradient checkpointing on (a boolean
    ``gradient_checkpointing`` attribute, as Hugging Face models and layers have), by name."""
    return [(name, m) for name, m in modules.items() if isinstance(getattr(m, "gradient_checkpointing", None), bool)]


def raise_for_checkpointing(who: str, candidates: Sequence[tuple[str, nn.Module]]) -> None:
    """Raise if one of ``candidates`` checkpoints its forward pass now (the flag on, in training mode).

    Raises:
        ValueError: naming the module and how to switch checkpointing off.
    """
    for name, module in candidates:
        if module.gradient_checkpointing and module.training:
            raise ValueError(
                f"{who}: module {name or 'the model'!r} ({type(module).__name__}) has gradient checkpointing on in "
                "training mode: its forward pass would be recomputed in the backward pass, outside the rules. Call "
                "model.activation_checkpointing_disable() (gradient_checkpointing_disable() in older transformers "
                "releases) or model.eval() before explaining it"
            )


def reentrant_checkpoint_error(
    err: RuntimeError, outputs: Sequence[torch.Tensor], modules: Mapping[str, nn.Module]
) -> ValueError | None:
    """The error to raise instead of torch's where the backward pass from ``outputs`` stopped at a region
    checkpointed with ``use_reentrant=True``, naming the checkpointed module; ``None`` for any other error.

    Examples:
        >>> from torch.utils.checkpoint import checkpoint
        >>> block = nn.Linear(2, 2)
        >>> x = torch.ones(1, 2, requires_grad=True)
        >>> y = checkpoint(block, x, use_reentrant=True)
        >>> try:
        ...     torch.autograd.grad(y.sum(), x)
        ... except RuntimeError as err:
        ...     print(reentrant_checkpoint_error(err, [y], {"block": block}))  # doctest: +ELLIPSIS
        LRP: module 'block' (Linear) runs in a region checkpointed with torch.utils.checkpoint(..., ...
    """
    if "use_reentrant=True" not in str(err):
        return None
    function = _checkpointed_function(outputs)
    names = {id(m): n for n, m in modules.items()}
    # A container built in the forward (``self.net[:4]``) is not the model's: its first module that is named.
    found = [s for m in _modules_in(function) for s in m.modules() if id(s) in names]
    where = f"module {names[id(found[0])] or 'the model'!r} ({type(found[0]).__name__})" if found else "a module"
    return ValueError(
        f"LRP: {where} runs in a region checkpointed with torch.utils.checkpoint(..., use_reentrant=True), which "
        "runs it without gradients, and its backward cannot be taken by torch.autograd.grad. Pass "
        "use_reentrant=False (the module rules then apply in its recomputation), or explain the model without "
        "checkpointing"
    )


def _checkpointed_function(outputs: Sequence[torch.Tensor]) -> Any:
    """The function a reentrant checkpoint region of the graph behind ``outputs`` runs, or ``None``."""
    seen: set = set()
    stack = [t.grad_fn for t in outputs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if getattr(getattr(node, "_forward_cls", None), "__name__", None) == "CheckpointFunction":
            return getattr(node, "run_function", None)
        stack.extend(relevance_pass_edges(node))
    return None


def _modules_in(function: Any) -> list[nn.Module]:
    """The modules a checkpointed ``function`` runs: itself, the module of a bound method or of a
    ``functools.partial``, or those its closure holds (``checkpoint_sequential``'s segments)."""
    if isinstance(function, nn.Module):
        return [function]
    if isinstance(function, functools.partial):
        return _modules_in(function.func) + [a for a in function.args if isinstance(a, nn.Module)]
    owner = getattr(function, "__self__", None)
    if isinstance(owner, nn.Module):
        return [owner]
    found = []
    for cell in getattr(function, "__closure__", None) or ():
        content = _content(cell)
        found += [m for m in (content if isinstance(content, (list, tuple)) else [content]) if isinstance(m, nn.Module)]
    return found


def _content(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None
