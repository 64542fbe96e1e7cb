"""Turning a ``target`` into the gradient that starts the relevance backward pass."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, Union

import torch
from tensordict.utils import NestedKey

__all__ = ["Target", "initial_gradient"]

Target = Union[None, int, torch.Tensor, Callable[[torch.Tensor], torch.Tensor], Literal["all"]]


def _one_hot(output: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(output).scatter_(-1, index.unsqueeze(-1), 1.0)


def initial_gradient(output: torch.Tensor, target: Target, key: NestedKey, batch_dims: int) -> torch.Tensor:
    """The gradient ``g`` such that ``output * g`` is the initial relevance.

    Args:
        output: the explained output, of shape ``batch + [n]`` (or ``batch`` alone).
        target: see :class:`~tdhook.attribution.LRP`.
        key: the output's key, for error messages.
        batch_dims: the number of batch dimensions.

    Returns:
        A tensor shaped like ``output``; for ``target="all"`` a stack of ``n`` of them.

    Examples:
        >>> out = torch.tensor([[1.0, 3.0], [4.0, 2.0]])
        >>> initial_gradient(out, None, "q", 1)
        tensor([[0., 1.],
                [1., 0.]])
        >>> initial_gradient(out, torch.tensor([0, 0]), "q", 1)
        tensor([[1., 0.],
                [1., 0.]])
        >>> initial_gradient(out, 2, "q", 1)
        Traceback (most recent call last):
        ...
        IndexError: LRP: target 2 is out of range for output 'q' with 2 units in its last dimension
    """
    out = output.detach()
    has_units = out.dim() > batch_dims
    n_units = out.shape[-1] if has_units else 1
    if callable(target):
        relevance = target(out)
        if not isinstance(relevance, torch.Tensor) or relevance.shape != out.shape:
            raise ValueError(
                f"LRP: a callable target must return a tensor shaped like output {key!r} {tuple(out.shape)}, "
                f"got {getattr(relevance, 'shape', type(relevance).__name__)}"
            )
        return torch.where(out != 0, relevance / torch.where(out != 0, out, 1), 0).to(out.dtype)
    if isinstance(target, str):
        if target != "all":
            raise ValueError(f"LRP: target must be None, an int, a LongTensor, a callable or 'all', got {target!r}")
        if not has_units:
            return torch.ones_like(out).unsqueeze(0)
        eye = torch.eye(n_units, dtype=out.dtype, device=out.device)
        return eye.view(n_units, *([1] * (out.dim() - 1)), n_units).expand(n_units, *out.shape).clone()
    if target is None:
        if not has_units or n_units == 1:
            return torch.ones_like(out)
        return _one_hot(out, out.argmax(-1))
    if not has_units:
        raise ValueError(f"LRP: output {key!r} has no unit dimension to index with target {target!r}")
    if isinstance(target, int) and not isinstance(target, bool):
        if not -n_units <= target < n_units:
            raise IndexError(
                f"LRP: target {target} is out of range for output {key!r} with {n_units} units in its last dimension"
            )
        index = torch.full(out.shape[:-1], target % n_units, dtype=torch.long, device=out.device)
        return _one_hot(out, index)
    if isinstance(target, torch.Tensor) and not target.is_floating_point() and target.dtype != torch.bool:
        index = target.to(out.device)
        if index.shape == (*out.shape[:-1], 1):
            index = index.squeeze(-1)
        if index.shape != out.shape[:-1]:
            index = index.expand(out.shape[:-1]) if index.dim() == 0 else index
        if index.shape != out.shape[:-1]:
            raise ValueError(
                f"LRP: target indices of shape {tuple(target.shape)} do not match output {key!r} "
                f"of shape {tuple(out.shape)}; expected {tuple(out.shape[:-1])}"
            )
        if ((index < 0) | (index >= n_units)).any():
            raise IndexError(
                f"LRP: target indices must lie in [0, {n_units}) for output {key!r}, "
                f"got values from {int(index.min())} to {int(index.max())}"
            )
        return _one_hot(out, index.long())
    raise TypeError(f"LRP: target must be None, an int, a LongTensor, a callable or 'all', got {type(target).__name__}")
