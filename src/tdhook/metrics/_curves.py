"""Perturbation curves: the target score as more and more features go to the baseline, a stack of steps per pass.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> from tdhook.metrics._features import Features
    >>> from tdhook.metrics._scoring import Scorer
    >>> net = torch.nn.Linear(3, 1, bias=False)
    >>> with torch.no_grad():
    ...     _ = net.weight.fill_(1.0)
    >>> td = TensorDict(x=torch.tensor([[1.0, 2.0, 3.0]]), attribution=TensorDict(x=torch.ones(1, 3)), batch_size=[1])
    >>> scorer = Scorer(net, td, in_keys=["x"], out_keys=["y"])
    >>> features = Features.read(td, ["x"], "attribution")
    >>> perturbation_curve(scorer, features, torch.tensor([[2, 0, 1]]), torch.tensor([1, 3]), 0.0)
    tensor([[6., 4., 0.]])
"""

from __future__ import annotations

import torch

from tdhook.metrics._features import Baseline, Features
from tdhook.metrics._scoring import Scorer, chunks, progress_bar

__all__ = ["perturbation_curve"]


def perturbation_curve(
    scorer: Scorer,
    features: Features,
    positions: torch.Tensor,
    thresholds: torch.Tensor,
    baseline: Baseline,
    progress: bool | None = None,
    description: str = "perturbation curve",
) -> torch.Tensor:
    """The scores ``batch + [1 + len(thresholds)]``: unperturbed, then with features at positions below each threshold.

    A model that starts with a linear layer (see :class:`~tdhook.metrics._leading_affine.LeadingAffine`) has that
    layer's output updated from step to step; any other runs on stacks of perturbed inputs.

    Args:
        scorer: the model's target score.
        features: the explained keys and their attributions.
        positions: ``batch + [n_features]``: the step order of every feature (its rank).
        thresholds: step ``k`` (from 1) sets the features with ``positions < thresholds[k - 1]`` to the baseline;
            increasing.
        baseline: the value the perturbed features take.
        progress: show a progress bar (``None``: for runs of at least 20 forward passes).
        description: the progress bar's label.
    """
    baselines = features.baselines(baseline)  # checked before any forward pass, and resolved once
    # Each key's feature positions, shaped like its attribution (split once, not per stack of steps), in the
    # narrowest integer type that holds them: comparing them with the thresholds builds each stack's masks.
    small = torch.int32 if positions.shape[-1] < 2**31 else torch.int64
    per_key = features.split(positions.to(small))
    thresholds = thresholds.to(device=positions.device, dtype=small)
    affine = scorer.leading_affine()
    if affine is not None and affine.fits(features.inputs[0], len(features.batch_size), baselines[0]):
        x, n = features.inputs[0], features.batch_size.numel()
        size = scorer.steps_per_forward or affine.stack_size(n)
        # The unperturbed output comes from the stack of the first steps, but where one step per pass is asked: the
        # model then sees the TensorDict's own batch in every pass (a layer of the caller's may read the whole batch).
        folded = scorer.pending and scorer.steps_per_forward != 1
        if scorer.pending and not folded:
            scorer.resolve()
        stacks = affine.outputs(
            x.reshape(n, *x.shape[len(features.batch_size) :]),
            baselines[0].expand_as(x).reshape(n, *x.shape[len(features.batch_size) :]),
            per_key[0].reshape(n, *per_key[0].shape[len(features.batch_size) :]),
            thresholds,
            size,
            features.batch_size,
            unperturbed=folded,
        )
        update = progress_bar(-(-len(thresholds) // size), description, progress)
        outputs = {}  # the stacks come from the last to the first
        for start, output in stacks:
            outputs[start] = output
            update(1)
        steps = torch.cat([outputs[start] for start in sorted(outputs)]) if len(outputs) > 1 else output
        if folded:
            scorer.resolve(steps[0])
        columns = [scorer.reference.unsqueeze(0), scorer.scores_of(steps[int(folded) :])]
    else:
        scorer.resolve()
        columns = [scorer.reference.unsqueeze(0)]
        size = scorer.chunk_size(features.inputs)
        update = progress_bar(-(-len(thresholds) // size), description, progress)
        for start, stop in chunks(len(thresholds), size):
            limit = thresholds[start:stop]
            perturbed = {
                key: torch.where(p.unsqueeze(0) < limit.view(-1, *[1] * p.dim()), b, x)
                for key, p, b, x in zip(features.keys, per_key, baselines, features.inputs, strict=True)
            }
            columns.append(scorer.scores(perturbed))
            update(1)
    update(0)
    return torch.cat(columns, dim=0).movedim(0, -1)
