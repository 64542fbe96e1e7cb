"""The explained inputs of one call: checked, then fed to the model as copies of the leaves the relevance is taken for.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tdhook.attribution._tokens import TokenInputs
    >>> td = TensorDict(x=torch.ones(2, 3), batch_size=[2])
    >>> validate_inputs(td, ["x"])
    >>> work = td.copy()
    >>> with torch.enable_grad():
    ...     leaves, fed = feed_inputs(work, ["x"], TokenInputs(["x"]))
    >>> leaves[0].requires_grad, work["x"] is fed[0], describe(td["x"])
    (True, True, 'torch.float32 [2, 3]')
    >>> validate_inputs(td, ["y"])
    Traceback (most recent call last):
    ...
    KeyError: "LRP: input key 'y' is missing from the TensorDict (keys: ['x'])"
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDictBase, is_tensorclass
from tensordict.utils import NestedKey

from tdhook.attribution._tokens import TokenInputs

__all__ = ["describe", "feed_inputs", "validate_inputs"]


def validate_inputs(tensordict: TensorDictBase, keys: Sequence[NestedKey]) -> None:
    """Check that every explained input is there and can receive relevance.

    Args:
        tensordict: the caller's TensorDict.
        keys: the explained input keys.

    Raises:
        KeyError: an input is missing.
        TypeError: an input is not a floating-point or integer tensor (a tensorclass or TensorDict is named
            with its entries' keys), or the TensorDict is a tensorclass (its fields cannot take the results).
        RuntimeError: ``torch.inference_mode()`` is active: no gradient, so no relevance.
    """
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            "LRP: torch.inference_mode() is active around the call; inference mode blocks the gradients that "
            "relevance is computed from: call the wrapper outside it (torch.no_grad() around it is fine)"
        )
    if is_tensorclass(tensordict):
        raise TypeError(
            f"LRP: the input is a tensorclass ({type(tensordict).__name__}), whose fields are fixed, so the outputs "
            "and relevance keys cannot be written into it; pass a TensorDict (tc.to_tensordict(), or a TensorDict "
            "holding the tensorclass)"
        )
    for key in keys:
        value = tensordict.get(key, None)
        if value is None:
            raise KeyError(
                f"LRP: input key {key!r} is missing from the TensorDict "
                f"(keys: {sorted(map(str, tensordict.keys(include_nested=True, leaves_only=True)))})"
            )
        if is_tensorclass(value) or isinstance(value, TensorDictBase):
            fields = sorted(map(str, value.keys(include_nested=True, leaves_only=True)))[:4]
            raise TypeError(
                f"LRP: input key {key!r} holds a {type(value).__name__}, not a tensor; explain its floating-point "
                f"entries by their nested keys, for example in_keys={[(key, f) for f in fields]!r}"
            )
        if not isinstance(value, torch.Tensor) or value.dtype == torch.bool or value.is_complex():
            dtype = getattr(value, "dtype", type(value).__name__)
            raise TypeError(
                f"LRP: input key {key!r} must be a floating-point tensor (or integer tokens read by an "
                f"nn.Embedding) to receive relevance, got {dtype}; pass in_keys=[...] to explain only those inputs"
            )


def feed_inputs(
    work: TensorDictBase, keys: Sequence[NestedKey], tokens: TokenInputs
) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Replace each explained input in ``work`` by what the model is to see, with gradients enabled.

    A floating-point input becomes a copy of a fresh leaf: in-place operations
    on it are legal and never reach the caller's data. Integer tokens go to
    ``tokens``, whose embedding hooks fill their places later.

    Args:
        work: the copy of the caller's TensorDict that the model runs on.
        keys: the explained input keys.
        tokens: the wrapper's token inputs, cleared for this call.

    Returns:
        The leaves the relevance is taken for and the tensors fed to the
        model, one per key (``None`` for tokens until embedded).
    """
    leaves: list[torch.Tensor | None] = []
    fed: list[torch.Tensor | None] = []
    for i, key in enumerate(keys):
        value = work.get(key)
        if not value.is_floating_point():
            work.set(key, tokens.feed(i, value, leaves, fed))
            continue
        if value.is_inference():  # made under torch.inference_mode(): a normal copy can require grad
            value = value.clone()
        leaf = value.detach().requires_grad_(True)
        fed.append(leaf.clone())
        work.set(key, fed[-1])
        leaves.append(leaf)
    return leaves, fed


def describe(value: Any) -> str:
    """``value`` for an error message: a tensor's dtype and shape, or the type's name.

    Args:
        value: a tensor or any other value.

    Returns:
        For example ``"torch.float32 [2, 3]"`` or ``"TensorDict"``.
    """
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return type(value).__name__
