"""The tables of a model's embeddings: which tensors an ``nn.Embedding`` or ``nn.EmbeddingBag`` looks its rows up
in, and whether a table a lookup reads is one of them, a view of one, or computed from one.

Examples:
    >>> from torch import nn
    >>> embedding = nn.Embedding(5, 3)
    >>> own = {id(table) for table in own_tables(embedding)}
    >>> made_of(embedding.weight[:, :2], own), made_of(nn.Embedding(5, 3).weight, own)
    (True, False)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["embedding_weights", "embeddings_at_or_under", "made_of", "own_tables"]

_EMBEDDINGS = (nn.Embedding, nn.EmbeddingBag)


def embedding_weights(modules: Mapping[str, nn.Module]) -> frozenset[int]:
    """The ids of the weights of the ``nn.Embedding`` and ``nn.EmbeddingBag`` layers among ``modules``.

    Examples:
        >>> embedding = nn.Embedding(4, 2)
        >>> id(embedding.weight) in embedding_weights({"embedding": embedding, "head": nn.Linear(2, 4)})
        True
    """
    return frozenset(
        id(module.weight) for module in modules.values() if isinstance(module, (nn.Embedding, nn.EmbeddingBag))
    )


def embeddings_at_or_under(modules: Mapping[str, nn.Module], name: str) -> list[nn.Module]:
    """The ``nn.Embedding`` and ``nn.EmbeddingBag`` modules of ``modules`` (by name) at ``name`` or inside it.

    Examples:
        >>> words, inner, other = nn.Embedding(3, 2), nn.Embedding(3, 2), nn.Embedding(3, 2)
        >>> found = embeddings_at_or_under({"words": words, "words.inner": inner, "wordsmith": other}, "words")
        >>> [module is words for module in found], [module is inner for module in found]
        ([True, False], [False, True])
    """
    prefix = f"{name}." if name else ""
    return [
        module
        for module_name, module in modules.items()
        if (module_name == name or module_name.startswith(prefix)) and isinstance(module, _EMBEDDINGS)
    ]


def own_tables(module: nn.Module) -> list[torch.Tensor]:
    """The tensors an ``nn.Embedding`` or ``nn.EmbeddingBag`` builds its table from: its weight, or, where the weight
    is parametrized (weight norm), the parameters it is computed from, as the table it looks up is a fresh tensor on
    each access; none for another module.

    Examples:
        >>> embedding = nn.Embedding(5, 3)
        >>> [tuple(table.shape) for table in own_tables(embedding)]
        [(5, 3)]
        >>> _ = nn.utils.parametrizations.weight_norm(embedding)
        >>> sorted(tuple(table.shape) for table in own_tables(embedding))
        [(5, 1), (5, 3)]
        >>> own_tables(nn.Linear(2, 2))
        []
    """
    if not isinstance(module, _EMBEDDINGS):
        return []
    if nn.utils.parametrize.is_parametrized(module, "weight"):
        return list(module.parametrizations.weight.parameters())
    return [module.weight]


def made_of(table: torch.Tensor, weights: set[int]) -> bool:
    """Whether ``table`` is one of ``weights`` (by ``id``), a view of one, or computed from one: an embedding's own
    table, which an ``nn.Embedding`` subclass may scale or view before its lookup.

    Examples:
        >>> embedding = nn.Embedding(5, 3)
        >>> own = {id(embedding.weight)}
        >>> made_of(embedding.weight, own), made_of(embedding.weight.T, own), made_of(2 * embedding.weight, own)
        (True, True, True)
        >>> made_of(nn.Parameter(torch.ones(5, 3)).T, own)
        False
    """
    if id(table) in weights or id(table._base) in weights:
        return True
    pending, seen = [table.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf itself
        if variable is not None and id(variable) in weights:
            return True
        pending.extend(next_node for next_node, _ in node.next_functions)
    return False
