"""A metric on a batch of several dimensions whose last one the model reads across: warned of.

A metric's perturbations (a curve's steps, a random subset, a perturbation function's) change the features of
every sample of the batch at once, and give each sample the scores of its own output. Where the model computes
each position of a ``[B, T]`` batch from its own features, that is each position's score alone. A model that reads
across the last batch dimension (a transformer over the time steps of a rollout, a causal average of the steps)
gives a position's score from the other positions' features too: every perturbation then changes those as well, and
a position's score holds the effect of features its own attribution does not rank (on a causal toy model over a
``[2, 4]`` batch, pixel flipping was 0.85 off the curve of each position perturbed alone, relative to its largest
value). The attribution methods perturb each position alone there
(:mod:`~tdhook.attribution.methods._positions_alone`); a metric warns instead, once it is computed, after one pass
more of ``2 ⌈log₂ T⌉`` copies of the batch, each with a split of the positions at the baseline (the methods' test).
A model built only of torch's layers that act on each position alone
(:func:`~tdhook.attribution.methods._positions_alone.positions_apart`) takes no such pass.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tdhook.metrics import pixel_flipping
    >>> net = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Tanh())  # each position alone: no pass, no word
    >>> td = TensorDict(x=torch.randn(2, 4, 3), attribution=TensorDict(x=torch.randn(2, 4, 3)), batch_size=[2, 4])
    >>> pixel_flipping(net, td, in_keys=["x"], out_keys=["y"]).shape
    torch.Size([2, 4, 4])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict.nn import TensorDictModule

from tdhook.attribution.methods._positions_alone import position_splits, positions_apart, read_across, split_positions
from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.metrics._features import Features
from tdhook.metrics._scoring import Scorer

__all__ = ["warn_for_positions_read_across"]


def warn_for_positions_read_across(
    scorer: Scorer, features: Features, baselines: Sequence[torch.Tensor], metric: str
) -> None:
    """Warn where ``scorer``'s model reads across the last dimension of the batch of ``features`` (of at least two
    dimensions, the last of two positions or more), the positions of each split at ``baselines``."""
    batch = features.batch_size
    if len(batch) < 2 or batch[-1] < 2 or _apart(scorer):
        return
    splits = position_splits(batch[-1], features.inputs[0].device)
    split = split_positions(features.inputs, baselines, len(batch), splits)
    changed = scorer.scores(dict(zip(features.keys, split, strict=True)))  # [splits, *batch]

    def again() -> torch.Tensor:
        return scorer.scores({key: x.unsqueeze(0) for key, x in zip(features.keys, features.inputs, strict=True)})

    moved = read_across(scorer.reference.unsqueeze(0), changed.unsqueeze(0), splits, again, len(batch))
    if moved is not None:
        warn_at_caller(
            f"{metric}: the model reads across the last batch dimension (of {list(batch)}): with some of its "
            f"positions at the baseline, the score at the positions left as given moved ({moved:.2g} apart, "
            "relative to its largest value). Each perturbation changes the features of every position at once, so a "
            "position's score holds the effect of the other positions' features, which its own attribution does not "
            "rank; score each position in a batch of its own where its own score alone is wanted (the attribution "
            "methods perturb each position alone)"
        )


def _apart(scorer: Scorer) -> bool:
    """Whether the scored model is a plain one (or a ``TensorDictModule`` of one, hooked by no one) of torch's layers
    that compute each position from its own features."""
    module = scorer.module
    if type(module) is not TensorDictModule or module._forward_hooks or module._forward_pre_hooks:
        return False
    return positions_apart(module.module)
