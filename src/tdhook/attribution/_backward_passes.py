"""The backward passes of one target: one seed, one per output unit (``target="all"``), one per position
along ``split_dim``, or both, over a single forward pass.

Examples:
    >>> x = torch.tensor([[1.0, 2.0, 3.0]], requires_grad=True)
    >>> y = x.cumsum(-1)  # [1, 3]: position t depends on x[..., :t + 1]
    >>> def relevance_of(seed, retain):
    ...     return [x.detach() * torch.autograd.grad(y, x, seed, retain_graph=retain)[0]]
    >>> (relevance,) = backward_passes(relevance_of, y, torch.ones(1, 3), split_dim=1, retain=False)
    >>> relevance  # [batch, target position, input position]
    tensor([[[1., 0., 0.],
             [1., 2., 0.],
             [1., 2., 3.]]])
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from tensordict.utils import NestedKey

from tdhook.attribution.targets import raise_for_unreached

__all__ = ["backward_passes", "check_split_dim", "target_relevance"]

RelevanceOf = Callable[[torch.Tensor, bool], list[torch.Tensor]]


def check_split_dim(split_dim: int | None, output: torch.Tensor, key: NestedKey, batch_dims: int) -> int | None:
    """``split_dim`` as a non-negative dimension of ``output`` before its units' dimension, or ``None``.

    Raises:
        TypeError: ``split_dim`` is not an int.
        ValueError: it is not such a dimension of the target output.

    Examples:
        >>> check_split_dim(-2, torch.zeros(4, 7, 3), "logits", 1)
        1
        >>> check_split_dim(2, torch.zeros(4, 7, 3), "logits", 1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: LRP: split_dim=2 must be a dimension of target 'logits' (shape [4, 7, 3]) before its units' ...
    """
    if split_dim is None:
        return None
    if not isinstance(split_dim, int) or isinstance(split_dim, bool):
        raise TypeError(f"LRP: split_dim must be an int or None, got {type(split_dim).__name__}")
    positions = output.dim() - (1 if output.dim() > batch_dims else 0)
    dim = split_dim + output.dim() if split_dim < 0 else split_dim
    if not 0 <= dim < positions:
        raise ValueError(
            f"LRP: split_dim={split_dim} must be a dimension of target {key!r} (shape {list(output.shape)}) before "
            f"its units' dimension, from 0 to {positions - 1} (or {-output.dim()} to {positions - 1 - output.dim()})"
        )
    return dim


def _at_position(seed: torch.Tensor, dim: int, position: int) -> torch.Tensor:
    masked = torch.zeros_like(seed)
    masked.select(dim, position).copy_(seed.select(dim, position))
    return masked


def backward_passes(
    relevance_of: RelevanceOf,
    output: torch.Tensor,
    grad_outputs: torch.Tensor,
    split_dim: int | None,
    retain: bool,
) -> list[torch.Tensor | None]:
    """Every relevance of one target, one backward pass per seed.

    Args:
        relevance_of: runs one backward pass from a seed (``retain``: keep the graph) and returns the relevances.
        output: the target output.
        grad_outputs: its initial gradient; with a leading dimension of units for ``target="all"``.
        split_dim: a dimension of ``output`` (checked by :func:`check_split_dim`) whose positions are explained
            one by one, or ``None``.
        retain: keep the graph after the last pass (another target follows).

    Returns:
        The relevances (``None`` for an input the call does not explain), each with the units
        (``target="all"``) in a dimension right after the batch dimensions of ``output``; with ``split_dim``, a
        new dimension of the positions right before ``split_dim``, and the units right after it.
    """
    per_unit = grad_outputs.dim() > output.dim()
    seeds = grad_outputs if per_unit else grad_outputs.unsqueeze(0)
    positions: list[int | None] = [None] if split_dim is None else list(range(output.shape[split_dim]))
    if not per_unit and split_dim is None:
        return relevance_of(grad_outputs, retain)
    unit_dim = output.dim() - 1 if split_dim is None else split_dim
    total, done = len(positions) * seeds.shape[0], 0
    # Each pass is written into its place in the result: no more than the result and one pass are held at a time.
    results: list[torch.Tensor | None] | None = None
    for p, position in enumerate(positions):
        for k, seed in enumerate(seeds):
            done += 1
            seed = seed if position is None else _at_position(seed, split_dim, position)
            relevances = relevance_of(seed, retain or done < total)
            if results is None:
                results = [
                    None if r is None else _allocate(r, per_unit, len(seeds), unit_dim, split_dim, len(positions))
                    for r in relevances
                ]
            for into, r in zip(results, relevances, strict=True):
                if r is not None:
                    view = into if position is None else into.select(split_dim, p)
                    (view.select(unit_dim, k) if per_unit else view).copy_(r)
            del relevances
    return results


def _allocate(
    like: torch.Tensor, per_unit: bool, n_units: int, unit_dim: int, split_dim: int | None, n_positions: int
) -> torch.Tensor:
    shape = list(like.shape)
    if per_unit:
        shape.insert(unit_dim, n_units)
    if split_dim is not None:
        shape.insert(split_dim, n_positions)
    return like.new_empty(shape)


def target_relevance(
    one_pass: Callable[[list, bool], tuple[list, list[bool]]],
    output: torch.Tensor,
    grad_outputs: torch.Tensor,
    extra: list[tuple[torch.Tensor, torch.Tensor]],
    key: NestedKey,
    split_dim: int | None,
    retain: bool,
    explained_keys: list[NestedKey],
    leaves: list[torch.Tensor | None],
) -> list[torch.Tensor | None]:
    """Every relevance of one target: :func:`backward_passes` over ``one_pass``, which takes the seeds
    ``[(output, seed), *extra]`` and whether to keep the graph, and returns the relevances and which leaves it
    reached. Raises where an explained input is reached by no pass (see ``raise_for_unreached``)."""
    if extra and split_dim is not None:
        raise ValueError(
            f"LRP: target {key!r}: split_dim cannot split relevance a callable target puts on outputs that are "
            "exactly 0 (they are carried by the layers before the output); use target=None, an index or 'all'"
        )
    reached = [leaf is None for leaf in leaves]  # an input the call does not explain needs no path

    def relevance_of(seed: torch.Tensor, keep: bool) -> list[torch.Tensor | None]:
        relevances, used = one_pass([(output, seed), *extra], keep)
        reached[:] = [a or b for a, b in zip(reached, used, strict=True)]
        return relevances

    stacked = backward_passes(relevance_of, output, grad_outputs, split_dim, retain)
    raise_for_unreached(key, explained_keys, reached)
    return stacked
