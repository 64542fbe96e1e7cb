"""An ``nn.Embedding`` given an explained input's token ids beside its input and looking its own table up at them
shifted by one constant: OPT's learned positions, called as ``embed_positions(mask, past, position_ids=ids)``, whose
forward looks up ``ids + 2``. Its output is the embedding of those ids, row for row and position for position, as an
embedding's reading them directly would be: it stands in for them, and each position gets the relevance of its row.

Any other lookup of ids computed from the input stays refused (:mod:`~tdhook.attribution._derived_ids`): the
output must be the rows of the table at the fed ids plus one integer, exactly. An ``nn.Embedding`` that reads the ids
as its input and returns rows of its table at other ids does not stand in for them: OPT's learned positions called
without position ids read the attention mask and look up positions counted from it, whose relevance is no mask's.

Examples:
    >>> import torch
    >>> from torch import nn
    >>> class Shifted(nn.Embedding):
    ...     def forward(self, mask, position_ids):
    ...         return super().forward(position_ids + 2)
    >>> table = Shifted(8, 3)
    >>> ids = torch.tensor([[0, 1, 2]])
    >>> output = table(torch.ones(1, 3), position_ids=ids)
    >>> offset_of(table, ids, output)
    2
    >>> offset_of(table, ids, output + 1.0) is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from tdhook.attribution._embedding_tables import made_of, own_tables
from tdhook.attribution._fed_ids import reads_fed_ids

__all__ = ["offset_of", "offset_reader", "rows_elsewhere"]

_CANDIDATES = 16  # rows of the table equal to the first output row tried as its shift (duplicates are rare)


def offset_reader(
    module: nn.Module,
    name: str,
    values: Sequence[object],
    output: object,
    ids: Mapping[int, torch.Tensor],
    tables: Sequence[tuple],
    leaves: Sequence[torch.Tensor | None],
) -> int | None:
    """The explained input whose fed ids ``module`` (an ``nn.Embedding`` named ``name``) was given among ``values``
    (its arguments, keywords included) and whose own table it looked up inside its forward at those ids plus one
    constant, its ``output`` being that lookup; ``None`` where there is none.

    Args:
        module: the module whose forward ended.
        name: its name among the model's modules.
        values: the arguments it was called with, positional and keyword.
        output: what it returned.
        ids: by explained input, the fed token ids.
        tables: the lookups by the ids that the call made: (input, table, embeddings running, ...) each.
        leaves: by explained input, its leaf (``None`` until an embedding stands in for it).

    Returns:
        The input's position among the explained keys, or ``None``.
    """
    if not isinstance(module, nn.Embedding) or not isinstance(output, torch.Tensor) or not torch.is_grad_enabled():
        return None
    own = {id(table) for table in own_tables(module)}
    for index, tokens in ids.items():
        if index < len(leaves) and leaves[index] is not None:
            continue  # embedded already: a second lookup is refused as one beside its embedding
        with torch._C.DisableTorchFunction():  # an inspection, out of the function modes' sight
            if not any(reads_fed_ids(value, tokens) for value in values):
                continue
            looked_up = any(entry[0] == index and name in entry[2] and made_of(entry[1], own) for entry in tables)
            if looked_up and offset_of(module, tokens, output) is not None:
                return index
    return None


def offset_of(embedding: nn.Embedding, ids: torch.Tensor, output: torch.Tensor) -> int | None:
    """The integer ``c`` for which ``output`` is exactly the rows of ``embedding``'s weight at ``ids + c`` (the
    smallest shift tried that fits, where rows repeat); ``None`` where there is none.

    Examples:
        >>> embedding = nn.Embedding(6, 2)
        >>> ids = torch.tensor([1, 3])
        >>> offset_of(embedding, ids, embedding(ids - 1)), offset_of(embedding, ids, embedding(ids.flip(0)))
        (-1, None)
    """
    weight = embedding.weight
    if ids.dtype not in (torch.int32, torch.int64) or ids.numel() == 0 or output.dtype != weight.dtype:
        return None
    if output.shape != (*ids.shape, weight.shape[-1]):
        return None
    with torch.no_grad():
        flat, rows = ids.reshape(-1), output.reshape(-1, weight.shape[-1])
        first = int(flat[0])
        for row in (weight == rows[0]).all(-1).nonzero().flatten()[:_CANDIDATES].tolist():
            shift = row - first
            shifted = flat + shift
            if int(shifted.min()) < 0 or int(shifted.max()) >= weight.shape[0]:
                continue
            if torch.equal(nn.functional.embedding(shifted, weight), rows):
                return shift
    return None


def rows_elsewhere(
    module: nn.Embedding,
    name: str,
    index: int,
    output: torch.Tensor,
    tables: Sequence[tuple],
    derived: list[tuple[int, str, str]],
) -> bool:
    """Whether ``module`` (named ``name``), which read the fed ids of input ``index`` as its input and returned no
    lookup of them, returned rows of its table all the same: rows at other ids, which do not stand in for the input's.
    Where it looked its own table up inside its forward at ids computed from the input (positions counted from a
    mask), that lookup is noted in ``derived``, to be refused by name.

    Examples:
        >>> embedding = nn.Embedding(6, 2)
        >>> mask = torch.tensor([[0, 1, 1]])
        >>> found = []
        >>> rows_elsewhere(embedding, "positions", 0, embedding(mask.cumsum(-1)), [], found), found
        (True, [])
        >>> rows_elsewhere(embedding, "positions", 0, embedding(mask) + 1.0, [], found)
        False
    """
    if not isinstance(output, torch.Tensor) or output.dtype != module.weight.dtype or output.numel() == 0:
        return False
    weight = module.weight
    if output.shape[-1] != weight.shape[-1]:
        return False
    with torch.no_grad():
        if not _rows_of(weight, output.reshape(-1, weight.shape[-1])):
            return False
    own = {id(table) for table in own_tables(module)}
    if any(entry[0] == index and name in entry[2] and made_of(entry[1], own) for entry in tables):
        derived.append((index, name, type(module).__name__))
    return True


def _rows_of(weight: torch.Tensor, rows: torch.Tensor) -> bool:
    """Whether every row of ``rows`` equals a row of ``weight`` exactly: one sort of the table and the distinct rows
    together, where comparing each row with the whole table took a pass over the table per row (48 s for OPT-125m's
    positions, 2050 x 768, read by a mask of 8 x 512 tokens).

    Examples:
        >>> weight = torch.tensor([[0.0, 1.0], [2.0, 3.0]])
        >>> _rows_of(weight, weight[[1, 1, 0]]), _rows_of(weight, torch.tensor([[2.0, 3.5]]))
        (True, False)
    """
    if bool(rows.isnan().any()):
        return False  # a NaN row equals no row
    distinct = rows.unique(dim=0)
    _, inverse = torch.cat((weight, distinct.to(weight.device))).unique(dim=0, return_inverse=True)
    return bool(torch.isin(inverse[weight.shape[0] :], inverse[: weight.shape[0]]).all())
