"""Feature ablation: how much the explained output drops when a group of features is set to its baseline."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution.methods._base import Call
from tdhook.attribution.methods._options import Baselines
from tdhook.attribution.methods._perturbation import FeatureMasks, PerturbationMethod, feature_groups, spread
from tdhook.attribution.targets import Target

__all__ = ["FeatureAblation"]


class FeatureAblation(PerturbationMethod):
    """``f(x) − f(x with the group at its baseline)`` for every feature group, written on the group's elements.

    Each group (see :func:`~tdhook.attribution.methods._perturbation.feature_groups`)
    is set to its baseline in every explained key at once, in one forward pass
    over the whole batch; every element of the group gets the drop of the
    explained output. Keys not explained stay fixed.

    Args:
        module: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        in_keys: see :class:`~tdhook.attribution.methods._base.AttributionMethod`.
        out_keys: the output keys of a plain module.
        target_key: the output to explain.
        target: ``None``, an int, a LongTensor, a callable or ``"all"`` (as for LRP), resolved on the input.
        relevance_key: the prefix of the attribution keys.
        feature_masks: integer group ids broadcasting to each input's shape, one
            tensor or a dict keyed by in_key; ``None``: one group per key.
        baselines: a number, a tensor with one sample's shape, or a dict keyed by in_key.
        progress: whether to show a progress bar over the forward passes.
        perturbations_per_eval: how many groups one forward pass ablates (each in its own copy of the batch).

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> from tdhook.attribution import FeatureAblation
        >>> net = torch.nn.Linear(4, 1, bias=False)
        >>> with torch.no_grad():
        ...     _ = net.weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
        >>> ablation = FeatureAblation(net, in_keys=["x"], out_keys=["v"], feature_masks=torch.tensor([0, 0, 1, 1]))
        >>> ablation(TensorDict(x=torch.ones(4), batch_size=[]))["attribution", "x"]
        tensor([3., 3., 7., 7.])
    """

    _per_call_options = ("baselines", "feature_masks")

    def __init__(
        self,
        module: TensorDictModuleBase | nn.Module,
        *,
        in_keys: Sequence[NestedKey] | None = None,
        out_keys: Sequence[NestedKey] | None = None,
        target_key: NestedKey | None = None,
        target: Target = None,
        relevance_key: str = "attribution",
        feature_masks: FeatureMasks = None,
        baselines: Baselines = 0.0,
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
        self.feature_masks = feature_masks

    def _attribute(self, call: Call) -> list[torch.Tensor]:
        baselines = self._baselines(call)
        masks, ids = feature_groups(
            self.feature_masks, self.explained_keys, call.inputs, call.batch_dims, "FeatureAblation"
        )
        unperturbed = self._unperturbed(call)
        totals = [x.new_zeros(call.seeds.shape[0], *x.shape) for x in call.inputs]

        def ablated(group: int) -> list[torch.Tensor]:
            return [torch.where(m == group, b, x) for m, b, x in zip(masks, baselines, call.inputs, strict=True)]

        for group, value in self._values(call, ids, ablated):
            drop = unperturbed - value
            for total, mask in zip(totals, masks, strict=True):
                total += spread(drop, mask == group, call.batch_dims)
        return totals
