"""Shapley value sampling: each feature group's mean marginal gain over orders of adding groups to the baseline."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution.methods._accumulation import accumulation_dtype
from tdhook.attribution.methods._base import Call
from tdhook.attribution.methods._options import Baselines, seeded_generator
from tdhook.attribution.methods._perturbation import FeatureMasks, PerturbationMethod, feature_groups, spread
from tdhook.attribution.methods._settable_options import CheckedOption, positive_int, seed_value
from tdhook.attribution.targets import Target

__all__ = ["ShapleyValueSampling", "permutations"]


def permutations(groups: int, n_samples: int, seed: int | None) -> list[list[int]]:
    """The orders in which groups are added: every one once if there are at most ``n_samples``, else a sample.

    Args:
        groups: the number of groups.
        n_samples: the number of orders asked for.
        seed: the seed of the sample (a generator of its own; ``None`` for a nondeterministic one).

    Returns:
        ``groups!`` orders (all of them) when ``n_samples >= groups!``, else
        ``n_samples`` orders drawn with ``torch.randperm``.

    Examples:
        >>> permutations(3, 6, seed=None)
        [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]]
        >>> len(permutations(5, 4, seed=0)), permutations(5, 4, seed=0) == permutations(5, 4, seed=0)
        (4, True)
    """
    if groups <= 20 and math.factorial(groups) <= n_samples:
        return [list(order) for order in itertools.permutations(range(groups))]
    generator = seeded_generator(seed)
    return [torch.randperm(groups, generator=generator).tolist() for _ in range(n_samples)]


class ShapleyValueSampling(PerturbationMethod):
    """Shapley values of feature groups, estimated over orders of adding them, written on the groups' elements.

    Every order starts from all groups at their baseline and adds the groups
    one at a time (one forward pass over the whole batch per step, the last
    step being the unperturbed input); a group's attribution is the mean over
    the orders of the gain of the explained output when it was added, written
    on each of its elements. With ``n_samples >= groups!`` every order is used
    once, which gives the exact Shapley values. Feature masks are those of
    :class:`~tdhook.attribution.FeatureAblation` (ids span keys; ``None``: one
    group per key).

    Args:
        module: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        in_keys: see :class:`~tdhook.attribution.methods._base.AttributionMethod`.
        out_keys: the output keys of a plain module.
        target_key: the output to explain.
        target: ``None``, an int, a LongTensor, a callable or ``"all"`` (as for LRP), resolved on the input.
        relevance_key: the prefix of the attribution keys.
        n_samples: the number of orders.
        feature_masks: integer group ids broadcasting to each input's shape, one tensor or a dict keyed by in_key.
        baselines: a number, a tensor with one sample's shape, or a dict keyed by in_key.
        seed: the seed of the orders (see :func:`permutations`).
        progress: whether to show a progress bar over the forward passes.
        perturbations_per_eval: how many steps one forward pass evaluates (each in its own copy of the batch).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import ShapleyValueSampling
        >>> class Product(torch.nn.Module):
        ...     def forward(self, x):
        ...         return x.prod(-1, keepdim=True)
        >>> shapley = ShapleyValueSampling(Product(), in_keys=["x"], out_keys=["v"], feature_masks=torch.arange(2))
        >>> shapley(TensorDict(x=torch.tensor([2.0, 3.0]), batch_size=[]))["attribution", "x"]  # the gain 6, shared
        tensor([3., 3.])
    """

    _per_call_options = ("baselines", "feature_masks")
    tunables = {"n_samples": (int, {"low": 5, "high": 200, "log": True})}

    n_samples = CheckedOption(positive_int)  # checked whenever set, as the constructor checks it
    seed = CheckedOption(seed_value)

    def __init__(
        self,
        module: TensorDictModuleBase | nn.Module,
        *,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
        target_key: NestedKey | None = None,
        target: Target = None,
        relevance_key: str = "attribution",
        n_samples: int = 25,
        feature_masks: FeatureMasks = None,
        baselines: Baselines = 0.0,
        seed: int | None = None,
        progress: bool = False,
        perturbations_per_eval: int = 1,
    ) -> None:
        super().__init__(
            module,
            in_keys=in_keys,
            out_keys=out_keys,
            target_key=target_key,
            target=target,
            relevance_key=relevance_key,
            baselines=baselines,
            progress=progress,
            perturbations_per_eval=perturbations_per_eval,
        )
        self.n_samples = n_samples
        self.feature_masks = feature_masks
        self.seed = seed

    def _attribute(self, call: Call) -> list[torch.Tensor]:
        baselines = self._baselines(call)
        masks, ids = feature_groups(
            self.feature_masks, self.explained_keys, call.inputs, call.batch_dims, "ShapleyValueSampling"
        )
        orders = permutations(len(ids), self.n_samples, self.seed)
        # The gains summed over the orders in float32 at least (see accumulation_dtype), rounded once to the input's
        # dtype.
        wide = accumulation_dtype(call.output.dtype)
        unperturbed = self._unperturbed(call).to(wide)
        empty = self._at(call, baselines).to(wide)
        gains = unperturbed.new_zeros(len(ids), *unperturbed.shape)
        group_ids = torch.tensor(ids, dtype=torch.long, device=masks[0].device)

        def added(step: tuple[int, int]) -> list[torch.Tensor]:
            order, position = step
            present = group_ids[orders[order][: position + 1]]
            return [
                torch.where(torch.isin(m, present), x, b) for m, x, b in zip(masks, call.inputs, baselines, strict=True)
            ]

        # Every order's steps but its last, which adds the last group: the unperturbed input.
        steps = [(order, position) for order in range(len(orders)) for position in range(len(ids) - 1)]
        values = dict(self._values(call, steps, added))
        for order, groups in enumerate(orders):
            before = empty
            for position, group in enumerate(groups):
                after = unperturbed if position == len(groups) - 1 else values[order, position].to(wide)
                gains[group] += after - before
                before = after
        gains /= len(orders)
        totals = [x.new_zeros(call.seeds.shape[0], *x.shape) for x in call.inputs]
        for group, gain in zip(ids, gains, strict=True):
            for total, mask in zip(totals, masks, strict=True):
                total += spread(gain.to(total.dtype), mask == group, call.batch_dims)
        return totals
