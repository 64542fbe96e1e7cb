"""Outputs that score every sample of a batch against every other: their shape after the batch grows with it.

The methods and the metrics stack perturbed copies of a batch along its first dimension and run them in one pass.
A model that scores samples against each other (CLIP's ``logits_per_image``, a similarity matrix
``f(a) @ g(b).T``) returns ``[B, B]`` for a batch of ``B``, and ``[S * B, S * B]`` for ``S`` stacked copies: every
copy is then scored against the samples of every other copy, and a target index below ``B`` picks a sample of the
first copy, not of its own. Such an output shows itself by its shape: its dimensions after the stacked batch differ
from those after the model's own batch. The copies then run one per pass, as the model on one batch runs.

Examples:
    >>> import torch
    >>> own = torch.zeros(3, 3)  # a batch of 3 scored against itself
    >>> scored_across_copies(torch.zeros(12, 12), 1, own, 1), scored_across_copies(torch.zeros(12, 3), 1, own, 1)
    (True, False)
    >>> scored_across_copies(torch.zeros(()), 1, torch.zeros(()), 0)  # a mean over the batch: the copies' mean
    True
"""

from __future__ import annotations

import torch

__all__ = ["scored_across_copies"]


def scored_across_copies(stacked: torch.Tensor, stacked_dims: int, own: torch.Tensor, batch_dims: int) -> bool:
    """Whether an output of stacked copies of the batch has other dimensions after its batch than the model's
    output on the batch itself: the model scored the copies against each other, or reduced them together (its
    output has no dimension for the stacked copies).

    Args:
        stacked: the output of the stacked copies, ``stacked batch + rest``.
        stacked_dims: the number of dimensions of the stacked batch.
        own: the model's output on the batch itself, ``batch + rest``.
        batch_dims: the number of batch dimensions.
    """
    if stacked.dim() < stacked_dims:  # the copies reduced together, to fewer dimensions than they were stacked in
        return True
    return tuple(stacked.shape[stacked_dims:]) != tuple(own.shape[batch_dims:])
