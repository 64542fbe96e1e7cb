"""Action fidelity for policies: does removing the most relevant features change the greedy action more than chance?"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.metrics._batch_statistics import keeps_running_statistics
from tdhook.metrics._features import Baseline, Features, sort_positions
from tdhook.metrics._random import generator
from tdhook.metrics._scoring import Scorer, chunks, progress_bar

__all__ = ["action_fidelity"]


@keeps_running_statistics
def action_fidelity(
    module: TensorDictModuleBase | nn.Module,
    td: TensorDictBase,
    *,
    k: int,
    n_random: int = 10,
    seed: int | None = None,
    in_keys: Sequence[NestedKey] | None = None,
    out_keys: Sequence[NestedKey] | None = None,
    target_key: NestedKey | None = None,
    relevance_key: NestedKey = "attribution",
    baseline: Baseline = 0.0,
    steps_per_forward: int | None = None,
    progress: bool | None = None,
) -> TensorDict:
    """The share of states whose greedy action changes when ``k`` features go to the baseline.

    The greedy action is the argmax of the last dimension of the output at ``target_key`` (the action values).
    Features rank jointly across all explained keys, as in :func:`~tdhook.metrics.pixel_flipping`.

    Args:
        module: the policy: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        td: states and attributions, any batch shape (left unchanged).
        k: how many features to remove per state.
        n_random: how many random draws of ``k`` features per state.
        seed: the seed of the random draws (``None``: fresh entropy); the global random state is not used.
        in_keys, out_keys, relevance_key, baseline, steps_per_forward, progress: as for
            :func:`~tdhook.metrics.pixel_flipping`.
        target_key: the action values (by default the output :class:`~tdhook.attribution.LRP` explains; for a
            torchrl ``QValueActor`` pass ``"action_value"``).

    Returns:
        A TensorDict with ``relevant``: the share of states whose action changes when their ``k`` most relevant
        features are removed, and ``random``: the same for ``k`` random features, averaged over the draws.

    Raises:
        ValueError: ``k`` or ``n_random`` is out of range, the output has fewer than two actions, or an attribution
            holds NaN.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Linear(4, 2, bias=False)
        >>> with torch.no_grad():
        ...     _ = net.weight.copy_(torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.5]]))
        >>> x = torch.tensor([[2.0, 1.0, 1.0, 1.0]])
        >>> td = TensorDict(x=x, attribution=TensorDict(x=torch.tensor([[2.0, 0.0, 0.0, 0.0]])), batch_size=[1])
        >>> fidelity = action_fidelity(net, td, k=1, n_random=8, seed=0, in_keys=["x"], out_keys=["q"])
        >>> fidelity["relevant"].item(), 0.0 <= fidelity["random"].item() <= 1.0
        (1.0, True)
    """
    scorer = Scorer(
        module, td, in_keys=in_keys, out_keys=out_keys, target_key=target_key, steps_per_forward=steps_per_forward
    )
    features = Features.read(td, scorer.keys, relevance_key)
    features.refuse_nan("action_fidelity")
    features.baselines(baseline)
    batch, n_features = td.batch_size, features.n_features
    output = scorer.reference_output
    if output.dim() <= len(batch) or output.shape[-1] < 2:
        raise ValueError(
            f"action_fidelity: output {scorer.target_key!r} of shape {list(output.shape)} has no action dimension "
            "of two or more actions; pass target_key= the action values (for a QValueActor, 'action_value')"
        )
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_features:
        raise ValueError(f"action_fidelity: k must be an int in [1, {n_features}] (the number of features), got {k!r}")
    if isinstance(n_random, bool) or not isinstance(n_random, int) or n_random < 1:
        raise ValueError(f"action_fidelity: n_random must be a positive int, got {n_random!r}")
    rng = generator(seed)
    action = output.argmax(-1)
    relevant_positions = sort_positions(features.values).unsqueeze(0)
    size = scorer.chunk_size(features.inputs)
    n_total = 1 + n_random
    update = progress_bar(-(-n_total // size), "action fidelity", progress)
    changed = []
    for start, stop in chunks(n_total, size):
        positions = []
        if start == 0:
            positions.append(relevant_positions)
        n_draws = stop - max(start, 1)
        if n_draws:
            draws = torch.rand(n_draws, *batch, n_features, generator=rng, dtype=torch.float64)
            positions.append(sort_positions(draws).to(relevant_positions.device))
        mask = torch.cat(positions) < k
        changed.append(scorer.outputs(features.perturb(mask, baseline)).argmax(-1) != action)
        update(1)
    update(0)
    changed = torch.cat(changed).reshape(n_total, -1).to(output.dtype).mean(-1)
    return TensorDict(relevant=changed[0], random=changed[1:].mean(), batch_size=[])
