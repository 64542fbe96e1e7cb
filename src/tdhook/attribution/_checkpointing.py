"""Modules that recompute their forward pass in the backward pass (gradient checkpointing in training mode).

A checkpointed block keeps no activations: the backward pass runs its forward again to rebuild them. That second
forward runs after the explained call, outside the rules' function modes, so it computes other tensors than the
ones the rules saved (torch then stops with a ``CheckpointError``), or, where their shapes happen to match,
gives relevance with rules missing. The LRP wrapper refuses such a model before running it, naming the module.
Hugging Face marks a checkpointed module with a boolean ``gradient_checkpointing`` attribute, which it honours in
training mode only.

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

from collections.abc import Mapping, Sequence

from torch import nn

__all__ = ["checkpointing_modules", "raise_for_checkpointing"]


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
