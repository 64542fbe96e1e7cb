"""Faithfulness correlation (Bhatt et al., 2020): does a random subset's attribution predict its removal's effect?"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution.methods._accumulation import accumulation_dtype
from tdhook.attribution.targets import Target
from tdhook.metrics._batch_statistics import keeps_running_statistics
from tdhook.metrics._features import Baseline, Features
from tdhook.metrics._positions_read_across import warn_for_positions_read_across
from tdhook.metrics._random import generator, keeps_global_rng
from tdhook.metrics._scoring import Scorer, chunks, progress_bar
from tdhook.metrics._similarity import pearson
from tdhook.metrics._stable_order import stable_order

__all__ = ["faithfulness_correlation"]


@keeps_running_statistics
@keeps_global_rng
def faithfulness_correlation(
    module: TensorDictModuleBase | nn.Module,
    td: TensorDictBase,
    *,
    n_runs: int = 100,
    subset_size: int = 224,
    seed: int | None = None,
    subsets: torch.Tensor | None = None,
    in_keys: Sequence[NestedKey] | None = None,
    out_keys: Sequence[NestedKey] | None = None,
    target_key: NestedKey | None = None,
    target: Target = None,
    relevance_key: NestedKey = "attribution",
    baseline: Baseline = 0.0,
    steps_per_forward: int | None = None,
    progress: bool | None = None,
) -> torch.Tensor:
    """The Pearson correlation, over random subsets of features, of their attribution sum and the score drop.

    Each run draws ``subset_size`` distinct features per sample (features as in
    :func:`~tdhook.metrics.pixel_flipping`), sets them to the baseline, and records the drop of the target score
    and the sum of the subset's attributions; the result is the correlation of the two over the runs.

    Args:
        module: the model: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        td: inputs and attributions (left unchanged).
        n_runs: how many subsets per sample.
        subset_size: how many features per subset.
        seed: the seed of the subsets' draws (``None``: fresh entropy); the global random state is not used.
        subsets: the subsets instead of random ones: distinct feature indices ``batch + [n_runs, subset_size]``
            (``n_runs`` and ``subset_size`` are then read from its shape).
        in_keys, out_keys, target_key, target, relevance_key, baseline, steps_per_forward, progress: as for
            :func:`~tdhook.metrics.pixel_flipping`.

    Returns:
        ``batch``: the correlation per sample (NaN where the drops or the sums do not vary).

    Raises:
        ValueError: ``subset_size`` exceeds the number of features, or ``subsets`` has the wrong shape or values.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Linear(6, 1, bias=False)
        >>> x = torch.randn(2, 6)
        >>> exact = x * net.weight.detach()  # gradient x input of a linear model: a perfect attribution
        >>> td = TensorDict(x=x, attribution=TensorDict(x=exact), batch_size=[2])
        >>> r = faithfulness_correlation(net, td, n_runs=20, subset_size=3, seed=0, in_keys=["x"], out_keys=["y"])
        >>> torch.allclose(r, torch.ones(2))
        True
    """
    scorer = Scorer(
        module,
        td,
        in_keys=in_keys,
        out_keys=out_keys,
        target_key=target_key,
        target=target,
        steps_per_forward=steps_per_forward,
    )
    features = Features.read(td, scorer.keys, relevance_key)
    features.refuse_nan("faithfulness_correlation")
    features.baselines(baseline)
    batch, n_features = td.batch_size, features.n_features
    values = features.values
    if subsets is not None:
        if (
            not isinstance(subsets, torch.Tensor)
            or subsets.is_floating_point()
            or subsets.dtype == torch.bool
            or subsets.dim() != len(batch) + 2
            or subsets.shape[: len(batch)] != batch
        ):
            raise ValueError(
                f"faithfulness_correlation: subsets must be integer feature indices of shape batch + [n_runs, "
                f"subset_size] = {list(batch)} + [n_runs, subset_size], got "
                f"{getattr(subsets, 'dtype', type(subsets).__name__)} {list(getattr(subsets, 'shape', []))}"
            )
        if subsets.numel() and (int(subsets.min()) < 0 or int(subsets.max()) >= n_features):
            raise ValueError(
                f"faithfulness_correlation: subsets must index the {n_features} features, in [0, {n_features})"
            )
        ordered = subsets.sort(-1).values
        repeated = (ordered[..., 1:] == ordered[..., :-1]).any(-1)
        if bool(repeated.any()):
            *sample, run = (int(i) for i in repeated.nonzero()[0])
            raise ValueError(
                f"faithfulness_correlation: subsets must name distinct features in each run: sample {tuple(sample)}, "
                f"run {run} names a feature twice"
            )
        subsets = subsets.to(values.device).long().movedim(-2, 0)
        n_runs, subset_size = subsets.shape[0], subsets.shape[-1]
    if isinstance(subset_size, bool) or not isinstance(subset_size, int) or not 1 <= subset_size <= n_features:
        raise ValueError(
            f"faithfulness_correlation: subset_size must be an int in [1, {n_features}] (the number of features of "
            f"{scorer.keys}), got {subset_size!r}"
        )
    if isinstance(n_runs, bool) or not isinstance(n_runs, int) or n_runs < 2:
        raise ValueError(f"faithfulness_correlation: n_runs must be an int of at least 2, got {n_runs!r}")
    rng = generator(seed) if subsets is None else None
    size = scorer.chunk_size(features.inputs)
    update = progress_bar(-(-n_runs // size), "faithfulness correlation", progress)
    drops, sums = [], []
    wide = accumulation_dtype(values.dtype)
    for start, stop in chunks(n_runs, size):
        if subsets is None:
            draws = torch.rand(stop - start, *batch, n_features, generator=rng, dtype=torch.float64)
            chosen = stable_order(draws)[..., :subset_size].to(values.device)
        else:
            chosen = subsets[start:stop]
        mask = torch.zeros(stop - start, *batch, n_features, dtype=torch.bool, device=values.device)
        mask.scatter_(-1, chosen, True)
        # The subset's own attributions summed, not a masked sum over every feature: where the zeros fall changes
        # the rounding of a masked sum, and equal attributions would then give sums that differ in the last bits
        # (a correlation of rounding noise where the sums do not vary).
        # In float32 at least (rounded to the result's dtype by pearson): in float16 a subset of finite attributions
        # sums past 65504 to inf, and the correlation to NaN.
        sums.append(values.expand(stop - start, *values.shape).gather(-1, chosen).to(wide).sum(-1))
        drops.append(scorer.reference.unsqueeze(0) - scorer.scores(features.perturb(mask, baseline)))
        update(1)
    update(0)
    warn_for_positions_read_across(scorer, features, features.baselines(baseline), "faithfulness_correlation")
    drops = torch.cat(drops)
    dtype = torch.result_type(values, drops)
    return pearson(torch.cat(sums).movedim(0, -1), drops.movedim(0, -1)).to(dtype)
