"""The backward passes of one target: one seed, one per output unit (``target="all"``), one per position
along ``split_dim``, or both, over a single forward pass.

The units' seeds are built in chunks of at most ``memory_budget`` bytes (see :func:`units_per_chunk`), so
that besides the forward pass's graph and the result the call holds one chunk of seeds and one pass.

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

from tdhook.attribution.targets import EveryUnit, raise_for_unreached

__all__ = [
    "DEFAULT_MEMORY_BUDGET",
    "InputsReached",
    "backward_passes",
    "check_memory_budget",
    "check_split_dim",
    "target_relevance",
    "units_per_chunk",
]

DEFAULT_MEMORY_BUDGET = 32 * 2**20
"""The bytes the seeds of ``target="all"`` may take at once: 32 MiB."""

RelevanceOf = Callable[[torch.Tensor, bool], list[torch.Tensor]]


def check_split_dim(split_dim: int | None, output: torch.Tensor, key: NestedKey, batch_dims: int) -> int | None:
    """``split_dim`` as a non-negative dimension of ``output`` before its units' dimension, or ``None``.

    Raises:
        TypeError: ``split_dim`` is not an int.
        ValueError: it is not such a dimension of the target output, or it is a batch dimension before the last.

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
    if dim < batch_dims - 1:  # the new dimension, right before dim, would take the place of a batch dimension
        raise ValueError(
            f"LRP: split_dim={split_dim} is a batch dimension before the last of the TensorDict's batch "
            f"(target {key!r}, shape {list(output.shape)}, batch dimensions {batch_dims}): the positions' dimension "
            f"goes right before it, where the batch would index it; split the last batch dimension "
            f"(split_dim={batch_dims - 1}), after moving the one to split there (TensorDict.transpose)"
        )
    return dim


def check_memory_budget(memory_budget: int) -> int:
    """``memory_budget``, checked: a positive number of bytes.

    Raises:
        TypeError: it is not an int.
        ValueError: it is not positive.

    Examples:
        >>> check_memory_budget(2**20)
        1048576
        >>> check_memory_budget(0)
        Traceback (most recent call last):
        ...
        ValueError: LRP: memory_budget must be a positive number of bytes, got 0
    """
    if not isinstance(memory_budget, int) or isinstance(memory_budget, bool):
        raise TypeError(f"LRP: memory_budget must be an int (bytes), got {type(memory_budget).__name__}")
    if memory_budget <= 0:
        raise ValueError(f"LRP: memory_budget must be a positive number of bytes, got {memory_budget}")
    return memory_budget


def units_per_chunk(seeds: EveryUnit, memory_budget: int) -> int:
    """How many units' seeds :func:`backward_passes` builds at once: as many as ``memory_budget`` bytes hold,
    at least one.

    Examples:
        >>> every = EveryUnit(torch.zeros(256, 1000), batch_dims=1)  # a seed is 256 x 1000 x 4 bytes
        >>> units_per_chunk(every, DEFAULT_MEMORY_BUDGET), units_per_chunk(every, 2**20), units_per_chunk(every, 1)
        (32, 1, 1)
    """
    return max(1, min(len(seeds), memory_budget // max(seeds.seed_bytes(), 1)))


def _at_position(seed: torch.Tensor, dim: int, position: int, into: torch.Tensor | None) -> torch.Tensor:
    masked = torch.zeros_like(seed) if into is None else into.zero_()
    masked.select(dim, position).copy_(seed.select(dim, position))
    return masked


def backward_passes(
    relevance_of: RelevanceOf,
    output: torch.Tensor,
    grad_outputs: torch.Tensor | EveryUnit,
    split_dim: int | None,
    retain: bool,
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> list[torch.Tensor | None]:
    """Every relevance of one target, one backward pass per seed.

    Args:
        relevance_of: runs one backward pass from a seed (``retain``: keep the graph) and returns the relevances.
        output: the target output.
        grad_outputs: its initial gradient, or for ``target="all"`` the units' gradients (:class:`EveryUnit`).
        split_dim: a dimension of ``output`` (checked by :func:`check_split_dim`) whose positions are explained
            one by one, or ``None``.
        retain: keep the graph after the last pass (another target follows).
        memory_budget: the bytes the units' seeds may take at once (see :func:`units_per_chunk`).

    Returns:
        The relevances (``None`` for an input the call does not explain), each with the units
        (``target="all"``) in a dimension right after the batch dimensions of ``output``; with ``split_dim``, a
        new dimension of the positions right before ``split_dim``, and the units right after it.
    """
    per_unit = isinstance(grad_outputs, EveryUnit)
    if not per_unit and split_dim is None:
        return relevance_of(grad_outputs, retain)
    positions: list[int | None] = [None] if split_dim is None else list(range(output.shape[split_dim]))
    n_units = len(grad_outputs) if per_unit else 1
    chunk = units_per_chunk(grad_outputs, memory_budget) if per_unit else 1
    # The units go right after the batch dimensions (before an output's other dimensions: a sequence's steps).
    unit_dim = (grad_outputs.batch_dims if per_unit else 0) if split_dim is None else split_dim
    total, done = len(positions) * n_units, 0
    # Each pass is written into its place in the result: no more than the result, one chunk of seeds and one
    # pass are held at a time.
    results: list[torch.Tensor | None] | None = None

    masked = None  # one buffer for the seed of one position, refilled for each
    # Relevance that keeps its graph (create_graph=True) keeps the seed it was computed from: no seed buffer is
    # refilled then, each pass gets its own.
    graph = False

    def explain(seed: torch.Tensor, k: int, p: int, position: int | None) -> None:
        nonlocal results, done, masked, graph
        done += 1
        if position is not None:
            seed = masked = _at_position(seed, split_dim, position, None if graph else masked)
        relevances = relevance_of(seed, retain or done < total)
        graph = graph or any(r is not None and r.requires_grad for r in relevances)
        if results is None:
            results = [
                None if r is None else _allocate(r, per_unit, n_units, unit_dim, split_dim, len(positions))
                for r in relevances
            ]
        for into, r in zip(results, relevances, strict=True):
            if r is not None:
                view = into if position is None else into.select(split_dim, p)
                (view.select(unit_dim, k) if per_unit else view).copy_(r)

    held = None  # one buffer of seeds, refilled for each chunk: a new one each time could leave two resident
    for start in range(0, n_units, chunk):
        stop = min(start + chunk, n_units)
        seeds = grad_outputs.seeds(start, stop, None if graph else held) if per_unit else grad_outputs.unsqueeze(0)
        held = seeds if held is None else held
        for p, position in enumerate(positions):
            for k in range(len(seeds)):
                explain(seeds[k], start + k, p, position)
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


class InputsReached:
    """Which explained inputs the targets of one call reached, checked after the last target.

    A target (or, with several, every one: the actor and the critic of an actor-critic) must depend on each
    explained input. With several targets, each head may read inputs of its own (a critic reading a state its
    actor does not see): a head gets zero relevance on an input it does not read, and only an input that no head
    reads is refused.

    Args:
        keys: the explained inputs.
        targets: how many targets the call explains.

    Examples:
        >>> reach = InputsReached(["obs", "state"], targets=2)
        >>> reach.record("logits", [True, False])  # the actor reads the observation alone
        >>> reach.record("value", [False, True])  # the critic the state: every input is read by a head
    """

    def __init__(self, keys: list[NestedKey], targets: int = 1) -> None:
        self.keys, self.left = keys, targets
        self.reached, self.targets = [False] * len(keys), []

    def record(self, key: NestedKey, reached: list[bool]) -> None:
        """Record which inputs target ``key`` reached; after the last target, raise for an input none reached."""
        self.reached = [a or b for a, b in zip(self.reached, reached, strict=True)]
        self.targets.append(key)
        self.left -= 1
        if self.left == 0:
            raise_for_unreached(self.targets[0] if len(self.targets) == 1 else self.targets, self.keys, self.reached)


def target_relevance(
    one_pass: Callable[[list, bool], tuple[list, list[bool]]],
    output: torch.Tensor,
    grad_outputs: torch.Tensor | EveryUnit,
    extra: list[tuple[torch.Tensor, torch.Tensor]],
    key: NestedKey,
    split_dim: int | None,
    retain: bool,
    reach: InputsReached,
    leaves: list[torch.Tensor | None],
    memory_budget: int = DEFAULT_MEMORY_BUDGET,
) -> list[torch.Tensor | None]:
    """Every relevance of one target: :func:`backward_passes` over ``one_pass``, which takes the seeds
    ``[(output, seed), *extra]`` and whether to keep the graph, and returns the relevances and which leaves it
    reached, recorded in ``reach`` (which raises, after the call's last target, where an explained input is
    reached by no target's pass)."""
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

    stacked = backward_passes(relevance_of, output, grad_outputs, split_dim, retain, memory_budget)
    reach.record(key, reached)
    return stacked
