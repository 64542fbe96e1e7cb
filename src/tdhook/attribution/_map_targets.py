"""Targets on a map: an output with two or more dimensions between the batch's and its last.

A target picks units of the output's last dimension: ``None`` the unit with the largest value, an int ``i`` unit
``i``, ``"all"`` each unit on its own, at every position of the dimensions between the batch's and the last, whose
explanations are summed. On action values ``[B, A]``, or a sequence's or the agents' rows ``[B, T, A]``, each
position is a row of units. On a map with its channels first (a segmentation's ``[B, C, H, W]``, whose classes are
at dimension 1), the last dimension is the map's width: each "unit" is a pixel of a row, and ``target=3`` explains
the fourth column of every channel, not class 3, which no one asks for. Such an output gets a warning that says what
the target picked and what to pass instead. A LongTensor shaped like the output without its last dimension names a
unit at each position itself, and a callable puts the relevance where it says: neither is warned of. A map of one
spatial dimension (``[B, C, L]``) has the shape of a sequence's rows and gets no warning; an unbatched TensorDict
holding a sequence's ``[1, T, V]`` gets one.

Examples:
    >>> import warnings
    >>> import torch
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warn_for_rows_of_a_map(torch.zeros(2, 4, 6, 7), None, "y", batch_dims=1)
    ...     warn_for_rows_of_a_map(torch.zeros(2, 5, 3), 1, "logits", batch_dims=1)  # rows of a sequence
    >>> [str(warning.message)[:65] for warning in caught]
    ["LRP: target=None on 'y' (shape [2, 4, 6, 7], batch [2]) explains,"]
"""

from __future__ import annotations

import math

import torch
from tensordict.utils import NestedKey

from tdhook.attribution.rules._caller import warn_at_caller

__all__ = ["warn_for_rows_of_a_map"]


def warn_for_rows_of_a_map(
    output: torch.Tensor, target: int | str | None, key: NestedKey, batch_dims: int, owner: str = "LRP"
) -> None:
    """Warn where ``target`` (``None``, an int or ``"all"``) picks units of the last dimension of an output with two
    or more dimensions between the batch's and its last (a map, ``[B, C, H, W]``), more than one position there and
    more than one unit in its last dimension.

    Args:
        output: the explained output.
        target: the target given.
        key: the output's key, for the message.
        batch_dims: how many leading dimensions are the batch's.
        owner: who explains or scores, for the message (LRP and the methods, the metrics).
    """
    between = output.shape[batch_dims:-1]
    if len(between) < 2 or math.prod(between) < 2 or output.shape[-1] < 2:
        return
    shape, batch = list(output.shape), list(output.shape[:batch_dims])
    picked = {None: "the unit of the last dimension with the largest value", "all": "each unit of the last dimension"}
    warn_at_caller(
        f"{owner}: target={target!r} on {key!r} (shape {shape}, batch {batch}) explains, at each of the "
        f"{math.prod(between)} positions {list(between)} between the batch's dimensions and the last, "
        f"{picked.get(target, f'unit {target} of the last dimension')} ({shape[-1]} units), and sums them; in a map "
        "with its channels first (a segmentation's classes at dimension 1) those units are the pixels of a row, not "
        "the classes. Pass a callable that puts the relevance on the units to explain (each pixel's class: "
        "lambda y: y * (y == y.amax(1, keepdim=True)); class c: "
        "lambda y: y * (torch.arange(y.shape[1], device=y.device) == c)[:, None, None]), or return an output "
        "whose last dimension holds the units"
    )
