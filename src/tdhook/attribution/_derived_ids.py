"""The refusal of a lookup of token ids the model computed from an explained input, saying what was computed.

An explained integer input reaches the relevance only through the ``nn.Embedding`` that reads it directly
(:mod:`~tdhook.attribution._tokens`). Ids the model computes from it and looks up elsewhere take their lookup's share
with them: an encoder-decoder's decoder input sliced, shifted or copied from its input, or, where the explained input
is a mask of zeros and ones (an attention mask given among the explained keys), positions counted from it
(``(mask.cumsum(-1) - 1).clamp(min=0)``, as a left-padded batch's position ids) and what is read at them. Its values
alone cannot tell a mask from a binary choice (an action of two values, looked up at ``a % 2``): the message for
zeros and ones says both.
"""

from __future__ import annotations

import torch
from tensordict.utils import NestedKey

__all__ = ["derived_ids_message"]


def derived_ids_message(key: NestedKey, name: str, kind: str, fed: torch.Tensor | None) -> str:
    """The message refusing the lookup by ``name`` (of class ``kind``) of ids computed from input ``key``, whose fed
    values are ``fed``.

    Examples:
        >>> mask = torch.tensor([[0, 1, 1]])
        >>> "positions counted from a mask" in derived_ids_message("attention_mask", "wpe", "Embedding", mask)
        True
        >>> "as a mask does (or a binary choice" in derived_ids_message("action", "table", "Embedding", mask)
        True
        >>> "sliced, shifted or copied" in derived_ids_message("input_ids", "words", "Embedding", mask + 4)
        True
        >>> "arithmetic on it, as a % n" in derived_ids_message("action", "table", "Embedding", mask + 2)
        True
    """
    head = f"LRP: input key {key!r} reaches {name!r} ({kind}) through token ids computed from it"
    if _is_mask(fed):
        return (
            f"{head}: {key!r} holds only zeros and ones, as a mask does (or a binary choice, such as an action of "
            "two values): ids computed from it are not supported, such as positions counted from a mask ("
            "(mask.cumsum(-1) - 1).clamp(min=0) makes a left-padded batch's position ids), values read at such "
            f"positions, or arithmetic on it (a % n), as no relevance reaches {key!r} through them and that "
            "lookup's share would be lost without a word; give the ids as an input of their own (for example "
            "position_ids, as an input key) to explain their lookup, and where "
            f"{key!r} is a mask, leave it out of in_keys (a mask holds no share of the relevance)"
        )
    return (
        f"{head} (sliced, shifted or copied, as an encoder-decoder makes its decoder's input from its input when it "
        "is given no decoder input, or computed by arithmetic on it, as a % n): the relevance of that lookup would "
        "be lost without a word; give those token ids as an input of their own (for example decoder_input_ids, as "
        "an input key), or explain the embeddings (inputs_embeds and decoder_inputs_embeds)"
    )


def _is_mask(fed: torch.Tensor | None) -> bool:
    """Whether ``fed`` holds only zeros and ones (booleans included)."""
    if not isinstance(fed, torch.Tensor) or fed.is_meta or fed.numel() == 0:
        return False
    with torch._C.DisableTorchFunction():  # an inspection, out of the function modes' sight
        try:
            return fed.dtype == torch.bool or bool(((fed == 0) | (fed == 1)).all())
        except RuntimeError:  # values not to be read here
            return False
