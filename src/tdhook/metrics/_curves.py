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

from tdhook.attribution.methods._random_draws import random_states
from tdhook.metrics._batch_statistics import StepsMixed
from tdhook.metrics._features import Baseline, Features, positions_of
from tdhook.metrics._positions_read_across import warn_for_positions_read_across
from tdhook.metrics._scoring import Scorer, chunks, progress_bar

__all__ = ["perturbation_curve"]


def perturbation_curve(
    scorer: Scorer,
    features: Features,
    positions: torch.Tensor | None,
    thresholds: torch.Tensor,
    baseline: Baseline,
    progress: bool | None = None,
    description: str = "perturbation curve",
    order: torch.Tensor | None = None,
    metric: str = "metrics",
) -> torch.Tensor:
    """The scores ``batch + [1 + len(thresholds)]``: unperturbed, then with features at positions below each threshold.

    A model that starts with a linear layer (see :class:`~tdhook.metrics._leading_affine.LeadingAffine`) has that
    layer's output updated from step to step; any other runs on stacks of perturbed inputs.

    Args:
        scorer: the model's target score.
        features: the explained keys and their attributions.
        positions: ``batch + [n_features]``: the step order of every feature (its rank); ``None`` where ``order``
            gives it.
        thresholds: step ``k`` (from 1) sets the features with ``positions < thresholds[k - 1]`` to the baseline;
            increasing.
        baseline: the value the perturbed features take.
        progress: show a progress bar (``None``: for runs of at least 20 forward passes).
        description: the progress bar's label.
        order: ``batch + [n_features]``: the features in the order they go, one rank each (each row a permutation,
            ``positions`` its inverse), or ``None``. A first layer updated step by step reads its elements in that
            order without inverting ``positions``.
        metric: the metric's name, in the warning for a model that reads across the positions of the batch's last
            dimension (see :mod:`~tdhook.metrics._positions_read_across`).
    """
    baselines = features.baselines(baseline)  # checked before any forward pass, and resolved once
    affine = scorer.leading_affine()
    given = positions, order  # as given, for a curve run again one step per pass
    lead = len(features.batch_size)
    if affine is not None and affine.fits(features.inputs[0], lead, baselines[0]):
        x, n = features.inputs[0], features.batch_size.numel()
        sample = x.shape[lead:]
        if order is not None and features.attributions[0].shape == x.shape:  # one feature per element
            ranks, order = None, order.reshape(n, -1)
        else:
            positions = positions_of(order) if positions is None else positions
            ranks = features.split(positions)[0]
            ranks = ranks.reshape(n, *ranks.shape[lead:])
        size = scorer.steps_per_forward or affine.stack_size(n)
        # The unperturbed output comes from the stack of the first steps, but where one step per pass is asked: the
        # model then sees the TensorDict's own batch in every pass (a layer of the caller's may read the whole batch).
        folded = scorer.pending and scorer.steps_per_forward != 1
        if scorer.pending and not folded:
            scorer.resolve()
        before = random_states(scorer.module) if folded else None  # the draws of the pass that gives step 0
        stacks = affine.outputs(
            x.reshape(n, *sample),
            baselines[0].expand_as(x).reshape(n, *sample),
            ranks,
            thresholds,
            size,
            features.batch_size,
            unperturbed=folded,
            order=order if ranks is None else None,
        )
        update = progress_bar(-(-len(thresholds) // size), description, progress)
        outputs = {}  # the stacks come from the last to the first
        try:
            for start, output in stacks:
                outputs[start] = output
                update(1)
        except StepsMixed as mixed:  # a layer after the first mixes the steps: each runs in a pass of its own
            update(0)
            scorer.run_steps_alone(mixed.found)
            return perturbation_curve(
                scorer, features, given[0], thresholds, baseline, progress, description, given[1], metric
            )
        steps = torch.cat([outputs[start] for start in sorted(outputs)]) if len(outputs) > 1 else output
        if folded:  # the scores of step 0 and of the others at once
            scorer.resolve(steps[0], before)
            update(0)
            curve = scorer.scores_of(steps).movedim(0, -1)
            warn_for_positions_read_across(scorer, features, baselines, metric)
            return curve
        columns = [scorer.reference.unsqueeze(0), scorer.scores_of(steps)]
    else:
        scorer.resolve()
        positions = positions_of(order) if positions is None else positions
        # Each key's feature positions, shaped like its attribution (split once, not per stack of steps), in the
        # narrowest integer type that holds them: comparing them with the thresholds builds each stack's masks.
        small = torch.int32 if positions.shape[-1] < 2**31 else torch.int64
        per_key = features.split(positions.to(small))
        thresholds = thresholds.to(device=positions.device, dtype=small)
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
    warn_for_positions_read_across(scorer, features, baselines, metric)
    return torch.cat(columns, dim=0).movedim(0, -1)
