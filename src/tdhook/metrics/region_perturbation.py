"""Region perturbation: the target score as square patches go to the baseline, most (or least) relevant first.

Samek et al. (2017): patches of ``patch_size x patch_size`` over the last two dimensions of each key, across all
its leading dimensions (the channels), ranked by the sum of the attribution over the patch (in float32 at least).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
from tensordict import TensorDictBase
from tensordict.nn import TensorDictModuleBase
from tensordict.utils import NestedKey
from torch import nn

from tdhook.attribution.methods._accumulation import accumulation_dtype
from tdhook.attribution.targets import Target
from tdhook.metrics._batch_statistics import keeps_running_statistics
from tdhook.metrics._curves import perturbation_curve
from tdhook.metrics._features import Baseline, Features, sort_positions
from tdhook.metrics._random import keeps_global_rng
from tdhook.metrics._scoring import Scorer

__all__ = ["patch_grid", "region_perturbation"]


def patch_grid(height: int, width: int, patch_size: int) -> torch.Tensor:
    """The patch of every position of a ``height x width`` plane, numbered row by row.

    The grid has ``ceil(height / patch_size)`` rows; when the size does not divide, the patches on the border are
    cut, the first row (column) by half the shortfall rounded down and the last by the rest.

    Examples:
        >>> patch_grid(3, 4, 2)
        tensor([[0, 0, 1, 1],
                [0, 0, 1, 1],
                [2, 2, 3, 3]])
    """
    rows = (torch.arange(height) + (-height % patch_size) // 2) // patch_size
    cols = (torch.arange(width) + (-width % patch_size) // 2) // patch_size
    n_cols = -(-width // patch_size)
    return rows[:, None] * n_cols + cols[None, :]


@keeps_running_statistics
@keeps_global_rng
def region_perturbation(
    module: TensorDictModuleBase | nn.Module,
    td: TensorDictBase,
    *,
    patch_size: int,
    order: Literal["morf", "lerf"] = "morf",
    n_regions: int | None = None,
    in_keys: Sequence[NestedKey] | None = None,
    out_keys: Sequence[NestedKey] | None = None,
    target_key: NestedKey | None = None,
    target: Target = None,
    relevance_key: NestedKey = "attribution",
    baseline: Baseline = 0.0,
    steps_per_forward: int | None = None,
    progress: bool | None = None,
) -> torch.Tensor:
    """The region-perturbation curve of the attributions stored in ``td``.

    Each explained key (at least two dimensions after the batch) is cut into ``patch_size x patch_size`` patches of
    its last two dimensions (see :func:`patch_grid`), each across all leading dimensions. Patches of all keys are
    ranked together by the sum of the attribution broadcast to the input over the patch: highest first for
    ``"morf"`` (most relevant first), lowest first for ``"lerf"``; ties go to the lower patch (keys in order, then
    row by row).

    Args:
        module: the model: a ``TensorDictModuleBase``, or a plain ``nn.Module`` with ``in_keys`` and ``out_keys``.
        td: inputs and attributions (left unchanged).
        patch_size: the side of a patch.
        order: ``"morf"`` or ``"lerf"``.
        n_regions: how many patches to perturb, one per step (all by default).
        in_keys, out_keys, target_key, target, relevance_key, baseline, steps_per_forward, progress: as for
            :func:`~tdhook.metrics.pixel_flipping`.

    Returns:
        ``batch + [n_regions + 1]``: column 0 is the target score on the unperturbed input, column ``k`` the score
        with the first ``k`` patches at the baseline.

    Raises:
        ValueError: a bad ``patch_size``, ``order`` or ``n_regions``, a key with fewer than two dimensions, or an
            attribution holding NaN or summing to NaN over a patch.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(16, 1, bias=False))
        >>> with torch.no_grad():
        ...     _ = net[1].weight.fill_(1.0)
        >>> x = torch.arange(16.0).view(1, 1, 4, 4)
        >>> td = TensorDict(x=x, attribution=TensorDict(x=x), batch_size=[1])
        >>> region_perturbation(net, td, patch_size=2, in_keys=["x"], out_keys=["y"])
        tensor([[120.,  70.,  28.,  10.,   0.]])
    """
    if isinstance(patch_size, bool) or not isinstance(patch_size, int) or patch_size < 1:
        raise ValueError(f"region_perturbation: patch_size must be a positive int, got {patch_size!r}")
    if order not in ("morf", "lerf"):
        raise ValueError(f"region_perturbation: order must be 'morf' or 'lerf', got {order!r}")
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
    features.refuse_nan("region_perturbation")
    batch = td.batch_size
    sums, feature_regions, offset = [], [], 0
    parts = zip(features.keys, features.inputs, features.attributions, features.broadcast_values(), strict=True)
    for key, x, a, full in parts:
        if x.dim() - len(batch) < 2:
            raise ValueError(
                f"region_perturbation: input {key!r} of shape {list(x.shape)} needs two dimensions after the batch "
                f"{list(batch)} to cut into patches"
            )
        height, width = x.shape[-2:]
        if a.shape[-2:] != x.shape[-2:]:
            raise ValueError(
                f"region_perturbation: attribution of {key!r} of shape {list(a.shape)} must keep the last two "
                f"dimensions of the input {list(x.shape[-2:])}"
            )
        grid = patch_grid(height, width, patch_size).to(x.device)
        n_patches = int(grid.max()) + 1
        # Summed in float32 at least: in float16 a patch of finite attributions sums past 65504 to inf, a tie.
        wide = accumulation_dtype(a.dtype)
        plane = full.to(wide).reshape(*batch, math.prod(x.shape[len(batch) : -2]), height * width).sum(-2)
        patch_sums = torch.zeros(*batch, n_patches, dtype=wide, device=a.device)
        sums.append(patch_sums.index_add_(-1, grid.flatten(), plane))
        if bool(sums[-1].isnan().any()):  # +inf and -inf in one patch
            where = tuple(sums[-1].isnan().nonzero()[0].tolist())
            raise ValueError(
                f"region_perturbation: the attribution of {key!r} sums to NaN over a patch (sample and patch "
                f"{where}: +inf and -inf in one patch), which has no rank; make the attributions finite first"
            )
        feature_regions.append((grid + offset).expand(a.shape[len(batch) :]).flatten())
        offset += n_patches
    n_total = offset
    if n_regions is None:
        n_regions = n_total
    if isinstance(n_regions, bool) or not isinstance(n_regions, int) or not 1 <= n_regions <= n_total:
        raise ValueError(f"region_perturbation: n_regions must be an int in [1, {n_total}], got {n_regions!r}")
    region_positions = sort_positions(torch.cat(sums, dim=-1), descending=order == "morf")
    positions = region_positions.index_select(-1, torch.cat(feature_regions))
    thresholds = torch.arange(1, n_regions + 1)
    description, metric = "region perturbation", "region_perturbation"
    return perturbation_curve(scorer, features, positions, thresholds, baseline, progress, description, metric=metric)
