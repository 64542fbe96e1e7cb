"""Keys of a lazily stacked TensorDict whose entries differ in shape: refused by name.

Heterogeneous agents (observations of different sizes) are held in a
``LazyStackedTensorDict``, whose key then reads as no one tensor: tensordict
raises a ``RuntimeError`` that names no key. An explained input or a target
output of that kind cannot receive relevance, which is a tensor of the input's
shape; the wrapper names the key, the shapes of its entries and the way out.

Examples:
    >>> import torch
    >>> from tensordict import LazyStackedTensorDict, TensorDict
    >>> agents = LazyStackedTensorDict.lazy_stack(
    ...     [TensorDict(observation=torch.zeros(3)), TensorDict(observation=torch.zeros(5))]
    ... )
    >>> ragged_entries(TensorDict(agents=agents))
    {('agents', 'observation'): [(3,), (5,)]}
"""

from __future__ import annotations

from collections.abc import Sequence

from tensordict import LazyStackedTensorDict, TensorDictBase
from tensordict.utils import NestedKey, unravel_key

__all__ = ["raise_for_ragged", "ragged_entries"]


def ragged_entries(tensordict: TensorDictBase, prefix: tuple = ()) -> dict[tuple, list[tuple | None]]:
    """The keys under lazy stacks of ``tensordict`` whose entries differ in shape, with each entry's shape (``None``
    where an entry lacks the key)."""
    found: dict[tuple, list[tuple | None]] = {}
    if isinstance(tensordict, LazyStackedTensorDict):
        entries = tensordict.tensordicts
        keys = dict.fromkeys(key for entry in entries for key in entry.keys(True, True))
        for key in keys:
            shapes = [tuple(entry.get(key).shape) if key in entry.keys(True, True) else None for entry in entries]
            if len(set(shapes)) > 1:
                found[(*prefix, *(key if isinstance(key, tuple) else (key,)))] = shapes
        return found
    for key, value in tensordict.items():
        if isinstance(value, TensorDictBase):
            found.update(ragged_entries(value, (*prefix, key)))
    return found


def raise_for_ragged(
    tensordict: TensorDictBase, keys: Sequence[NestedKey], what: str, error: Exception, owner: str = "LRP"
) -> None:
    """Raise a ``ValueError`` naming the ragged keys of ``tensordict`` among ``keys`` (or every ragged key, where
    none of ``keys`` is) when ``error`` came from reading one; return where ``tensordict`` holds none.

    Args:
        tensordict: the TensorDict a key was read from.
        keys: the keys read (``"input"`` or ``"output"``, as ``what`` says).
        what: what the keys are, for the message.
        error: the error the read raised, chained to the one raised here.
        owner: the wrapper that read them (``"LRP"``, ``"Saliency"``, ...), at the head of the message.
    """
    ragged = ragged_entries(tensordict)
    if not ragged:
        return
    wanted = {unravel_key(key) for key in keys}
    named = {key: shapes for key, shapes in ragged.items() if unravel_key(key) in wanted} or ragged
    listed = "; ".join(f"{key!r}: entries of shapes {shapes}" for key, shapes in named.items())
    raise ValueError(
        f"{owner}: the {what} {listed} is held by a lazily stacked TensorDict whose entries differ in shape (agents "
        "with observations or actions of different sizes), which reads as no one tensor, so it cannot be explained "
        "or take a relevance of its shape; put the agents of each shape in a group of their own (torchrl's "
        "group_map) and explain each group's keys, or pad the entries to one shape"
    ) from error
