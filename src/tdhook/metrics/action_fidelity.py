"""Action fidelity for policies: does removing the most relevant features change the greedy action more than chance?"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict, TensorDictBase
from tensordict.nn import CompositeDistribution, ProbabilisticTensorDictModule, TensorDictModuleBase
from tensordict.utils import NestedKey, unravel_key, unravel_key_list
from torch import nn
from torchrl.modules import Actor, TanhModule

from tdhook.attribution._policy_targets import distributional_module, ordinal_logits, ordinal_sampler
from tdhook.metrics._batch_statistics import keeps_running_statistics
from tdhook.metrics._features import Baseline, Features, sort_positions
from tdhook.metrics._positions_read_across import warn_for_positions_read_across
from tdhook.metrics._random import generator, keeps_global_rng
from tdhook.metrics._scoring import Scorer, chunks, progress_bar

__all__ = ["action_fidelity"]

# Distributions whose sample is the index (or one-hot vector) of an argmax-able output.
_CATEGORICAL = (torch.distributions.Categorical, torch.distributions.OneHotCategorical)


@keeps_running_statistics
@keeps_global_rng
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

    The greedy action is the argmax of the last dimension of the output at ``target_key`` (the action values or a
    categorical policy's logits; for a torchrl policy that masks actions, the highest allowed logit; for the action
    values of a torchrl ``DistributionalQValueActor``, the action whose expected return over the support is highest,
    as the actor chooses it; for the scores of an ``Ordinal`` or ``OneHotOrdinal`` distribution, the argmax of its
    log-probabilities). An output
    ``batch + [heads..., actions]`` gives one action per head, and a state's action changes when that of any head
    does. A continuous action (the parameters of a non-categorical distribution or of such a part of a
    ``CompositeDistribution``, an action whose torchrl spec is continuous, the action of a torchrl ``Actor`` without
    a spec or of a ``TanhModule``) has no argmax and is refused.
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
        ValueError: ``k`` or ``n_random`` is out of range, the output has fewer than two actions or is a continuous
            action, or an attribution holds NaN.

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
    continuous = _continuous_action(scorer.module, scorer.target_key)
    if continuous is not None:
        raise ValueError(
            f"action_fidelity: output {scorer.target_key!r} is {continuous}: a continuous action is not the argmax "
            "of an output, so whether it changes is not defined here; score the policy with pixel_flipping or "
            "faithfulness_correlation on that output, or pass target_key= the action values of a discrete policy"
        )
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n_features:
        raise ValueError(f"action_fidelity: k must be an int in [1, {n_features}] (the number of features), got {k!r}")
    if isinstance(n_random, bool) or not isinstance(n_random, int) or n_random < 1:
        raise ValueError(f"action_fidelity: n_random must be a positive int, got {n_random!r}")
    rng = generator(seed)
    allowed = scorer.allowed  # a masked policy's greedy action is its highest allowed logit
    # A distributional Q-value actor's greedy action has the highest expected return over its support.
    distributional = distributional_module(scorer.module, scorer.target_key)
    ordinal = ordinal_sampler(scorer.module, scorer.target_key)  # an ordinal policy's: of its log-probabilities

    def greedy(values: torch.Tensor) -> torch.Tensor:
        if distributional is not None:
            values = distributional._support_expected(values)  # [*batch, atoms, actions] -> [*batch, actions]
        elif ordinal is not None:
            values = ordinal_logits(ordinal, values)
        return (values if allowed is None else values.masked_fill(~allowed, float("-inf"))).argmax(-1)

    action = greedy(output)
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
        flipped = greedy(scorer.outputs(features.perturb(mask, baseline))) != action
        heads = flipped.dim() - 1 - len(batch)  # a state's action is that of every head together
        changed.append(flipped.flatten(-heads).any(-1) if heads else flipped)
        update(1)
    update(0)
    warn_for_positions_read_across(scorer, features, features.baselines(baseline), "action_fidelity")
    changed = torch.cat(changed).reshape(n_total, -1).to(output.dtype).mean(-1)
    return TensorDict(relevant=changed[0], random=changed[1:].mean(), batch_size=[])


def _continuous_action(module: TensorDictModuleBase, key: NestedKey) -> str | None:
    """What makes the output at ``key`` a continuous action, or ``None``: it is a parameter of a distribution that
    is not categorical (a part of a ``CompositeDistribution`` included), the torchrl spec of a module says that the
    key is continuous, or it is the action of a torchrl ``Actor`` without a spec or of a ``TanhModule``."""
    key = unravel_key(key)
    for sub in module.modules():
        if isinstance(sub, ProbabilisticTensorDictModule):
            found = _distribution_of(sub, key)
            if found is not None:
                dist, what = found
                if not (isinstance(dist, type) and issubclass(dist, _CATEGORICAL)):
                    return f"a parameter of the {getattr(dist, '__name__', dist)} distribution{what}"
        if isinstance(sub, TanhModule) and key in unravel_key_list(list(sub.out_keys)):
            return "the bounded action of a TanhModule (tanh scaled to its bounds)"
        spec = getattr(sub, "spec", None)
        if spec is not None and callable(getattr(spec, "keys", None)) and key in spec.keys(True, True):
            leaf = spec[key]
            if getattr(leaf, "domain", None) == "continuous":
                return f"an action whose spec is continuous ({type(leaf).__name__})"
            if leaf is None and isinstance(sub, Actor) and key in unravel_key_list(list(sub.out_keys)):
                return (
                    "the action of a torchrl Actor with no spec (a deterministic actor's action is continuous; give "
                    "it a Categorical or OneHot spec if its output holds action values)"
                )
    return None


def _distribution_of(module: ProbabilisticTensorDictModule, key: tuple | str) -> tuple[object, str] | None:
    """The distribution class whose parameter ``key`` is, and where it sits, or ``None`` where ``key`` is none of
    ``module``'s: an in key, or a key under the in key of a ``CompositeDistribution`` (its part named by the keys
    between, as its ``distribution_map`` names them; a part it does not name is reported as the composite)."""
    dist = getattr(module, "distribution_class", None)
    where = f" of {type(module).__name__}"
    in_keys = unravel_key_list(list(module.in_keys))
    if key in in_keys:
        return dist, where
    if not (isinstance(dist, type) and issubclass(dist, CompositeDistribution)):
        return None
    path = key if isinstance(key, tuple) else (key,)
    for in_key in in_keys:
        prefix = in_key if isinstance(in_key, tuple) else (in_key,)
        if path[: len(prefix)] != prefix or len(path) <= len(prefix) + 1:
            continue
        rest = path[len(prefix) : -1]  # the part's name: the keys between the in key and the parameter's name
        parts = {
            unravel_key(name): part for name, part in module.distribution_kwargs.get("distribution_map", {}).items()
        }
        for name, part in parts.items():
            if (name if isinstance(name, tuple) else (name,)) == rest:
                return part, f" {name!r} of the CompositeDistribution of {type(module).__name__}"
        return dist, where
    return None
