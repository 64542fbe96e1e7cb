"""Pixel flipping: the target score as the most relevant features go to the baseline, a few per step.

Bach et al. (2015): a faithful attribution ranks first the features whose removal lowers the score fastest.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution.targets import Target
from tdhook.metrics._batch_statistics import keeps_running_statistics
from tdhook.metrics._curves import perturbation_curve
from tdhook.metrics._features import Baseline, Features
from tdhook.metrics._random import keeps_global_rng
from tdhook.metrics._scoring import Scorer
from tdhook.metrics._stable_order import stable_order

__all__ = ["pixel_flipping"]


@keeps_running_statistics
@keeps_global_rng
def pixel_flipping(
    module: TensorDictModuleBase | nn.Module,
    td: TensorDictBase,
    *,
    in_keys: Sequence[NestedKey] | None = None,
    out_keys: Sequence[NestedKey] | None = None,
    target_key: NestedKey | None = None,
    target: Target = None,
    relevance_key: NestedKey = "attribution",
    baseline: Baseline = 0.0,
    features_per_step: int = 1,
    steps_per_forward: int | None = None,
    progress: bool | None = None,
) -> torch.Tensor:
    """The pixel-flipping curve of the attributions stored in ``td``.

    Features are the elements of the attributions at ``(relevance_key, *key)`` for each key of ``in_keys``,
    concatenated in that order; an attribution broadcasts to its input (a ``[B, 1, H, W]`` map makes each pixel
    one feature over all channels). They are ranked by attribution, highest first, ties to the lower index.

    Args:
        module: the model: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        td: inputs and attributions (left unchanged).
        in_keys: the explained keys (a plain module's inputs; by default those LRP explains by default).
        out_keys: a plain module's output keys.
        target_key: the scored output (by default the one :class:`~tdhook.attribution.LRP` explains).
        target: ``None`` (the argmax of the unperturbed output, or the action explained beside the relevance for
            a sampling policy's logits; kept for every step), an int, a LongTensor of
            per-sample indices, or a callable ``output -> relevance`` giving fixed weights ``relevance / output``
            on the unperturbed output, as for the attribution methods.
        relevance_key: the prefix of the attribution keys (``"relevance"`` for LRP).
        baseline: the value perturbed features take: a number, a tensor that broadcasts to the key (a per-sample
            minimum, say), or a dict ``key -> number or tensor``.
        features_per_step: how many features each step adds.
        steps_per_forward: perturbation steps per forward pass (see :class:`~tdhook.metrics._scoring.Scorer`).
        progress: show a tqdm bar (``None``: for runs of at least 20 forward passes).

    Returns:
        ``batch + [L + 1]`` with ``L = ceil(n_features / features_per_step)``: column 0 is the target score on the
        unperturbed input, column ``k`` the score with the top ``k * features_per_step`` features at the baseline.

    Raises:
        KeyError: an input or attribution key is missing.
        ValueError: ``features_per_step`` is not positive, an attribution or baseline does not fit its key, or an
            attribution holds NaN (it has no rank).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Linear(4, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = net.weight.fill_(1.0)
        >>> x = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
        >>> td = TensorDict(x=x, attribution=TensorDict(x=x), batch_size=[1])
        >>> pixel_flipping(net, td, in_keys=["x"], out_keys=["y"], features_per_step=2)
        tensor([[10.,  3.,  0.]])
    """
    if isinstance(features_per_step, bool) or not isinstance(features_per_step, int) or features_per_step < 1:
        raise ValueError(f"pixel_flipping: features_per_step must be a positive int, got {features_per_step!r}")
    scorer = Scorer(
        module,
        td,
        in_keys=in_keys,
        out_keys=out_keys,
        target_key=target_key,
        target=target,
        steps_per_forward=steps_per_forward,
        defer=True,
    )
    features = Features.read(td, scorer.keys, relevance_key)
    features.refuse_nan("pixel_flipping")
    n_steps = -(-features.n_features // features_per_step)
    order = stable_order(features.values, nan_free=True)
    thresholds = torch.arange(features_per_step, n_steps * features_per_step + 1, features_per_step)
    return perturbation_curve(
        scorer, features, None, thresholds, baseline, progress, "pixel flipping", order=order, metric="pixel_flipping"
    )
