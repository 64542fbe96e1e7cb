"""Positions of a batch's last dimension that the model reads across, perturbed one at a time.

A perturbation method perturbs a group of features in every sample of the batch at once, in one forward pass, and
writes each sample's drop on that sample's own features. That is each sample's drop alone where the model computes
each sample apart. A model that reads across the last dimension of a batch of several dimensions (a transformer
over the time steps of a ``[B, T]`` TensorDict, as torchrl's decision transformers and GTrXL policies run) gives the
output at one step from the features of the others too: with every step perturbed at once, a step's drop holds the
effect of perturbing the other steps, which its own features cannot carry (on a tiny Llama over a ``[2, 6]`` batch,
FeatureAblation with each step's features one group was 52 % off, relative L2, each step's drop alone; the Shapley
values of two halves of them 41 % off).

Such a model is found by one pass more per call, of ``2 ⌈log₂ T⌉`` copies of the batch stacked (``T`` the last
batch dimension's size): in each, a split of the positions at the baseline, the others as given, the splits by the
bits of the positions' indices, so that for any two positions one copy perturbs the first and leaves the second as
given (every other position alone would miss a model whose step ``t`` reads step ``t - 2``, or the last step read by
every other of an odd number). Where the explained output at a position left as given moved by more than
rounding (and does not move on a pass of the unchanged inputs as well, as a model that draws at random does), each
step of the method then runs one copy per position, perturbed at that position alone, the others as the caller
gave them, and each position takes its value from its own copy: the drop of each step alone, at the cost of one
copy per position. A model built only of torch's layers that act on each position's features alone (linear layers,
element-wise activations, layer and RMS norms over the last dimension, dropout, in a plain ``nn.Sequential`` or
torchrl's ``MLP``, with no hook: a torchrl policy's MLP over a ``[B, T]`` rollout) cannot read across the positions,
and takes no such pass (:func:`positions_apart`).

Examples:
    >>> import torch
    >>> x, original = torch.ones(2, 3), torch.zeros(2, 3)  # a [2, 3] batch
    >>> positions_alone(x, original, 2)[:, 0].tolist()  # copy t perturbed at position t alone
    [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    >>> own_positions(torch.arange(9.0).view(1, 3, 1, 3), 2).tolist()  # [units, copies, *batch] -> [units, *batch]
    [[[0.0, 4.0, 8.0]]]
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torchrl.modules import MLP

from tdhook.attribution.methods._mixed_copies import TRAILING_LAYERS

__all__ = [
    "own_positions",
    "position_splits",
    "positions_alone",
    "positions_apart",
    "read_across",
    "split_positions",
]

# torch's layers that compute each position of a batch from its own features alone: those that read only the last
# dimensions, and PReLU (a weight per entry of dimension 1, the positions' own where they are that dimension).
_PER_POSITION = TRAILING_LAYERS | {nn.PReLU}
_HOOKS = ("_forward_hooks", "_forward_pre_hooks")


def positions_apart(module: nn.Module) -> bool:
    """Whether ``module`` is built only of torch's layers that compute each position from its own features (see
    ``_PER_POSITION``), in a plain ``nn.Sequential`` or torchrl's ``MLP`` (which joins its inputs along the last
    dimension), with no forward hook and no forward set on an instance: it cannot read across a batch's positions.

    Examples:
        >>> positions_apart(nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LayerNorm(4)))
        True
        >>> positions_apart(nn.Sequential(nn.Flatten(), nn.Linear(12, 4))), positions_apart(nn.Conv1d(3, 4, 1))
        (False, False)
        >>> positions_apart(nn.LayerNorm((5, 4)))  # over a sample's positions too, on a [B, 5] batch
        False
    """
    if any(getattr(module, name, None) for name in _HOOKS) or "forward" in vars(module):
        return False
    kind = type(module)
    if kind is nn.Sequential or (isinstance(module, MLP) and kind.forward is MLP.forward):
        return all(positions_apart(layer) for layer in module)
    if kind in (nn.LayerNorm, nn.RMSNorm):  # over the last dimension alone: more may reach the positions
        return len(module.normalized_shape) == 1
    return kind in _PER_POSITION


def _selector(length: int, batch_dims: int, rank: int, device: torch.device) -> torch.Tensor:
    """``[length]`` positions of the last batch dimension, shaped to broadcast against a tensor of ``rank``
    dimensions whose batch dimensions come first."""
    return torch.arange(length, device=device).view(length, *[1] * (rank - batch_dims))


def position_splits(length: int, device: torch.device | None = None) -> torch.Tensor:
    """``[splits, length]``: the positions each split perturbs (``True``), the others left as given. Split ``b``
    perturbs the positions whose index has bit ``b`` set, split ``bits + b`` those whose index has it clear: any two
    positions differ in a bit, so for every position ``s`` and every other ``t`` one split perturbs ``s`` and leaves
    ``t`` as given, and a model whose output at ``t`` reads ``s`` moves it there (``2 ⌈log₂ length⌉`` splits).

    Examples:
        >>> position_splits(3).int().tolist()
        [[0, 1, 0], [0, 0, 1], [1, 0, 1], [1, 1, 0]]
    """
    index = torch.arange(length, device=device)
    bits = torch.stack([(index >> bit) & 1 == 1 for bit in range(max(1, (length - 1).bit_length()))])
    return torch.cat([bits, ~bits])


def split_positions(
    inputs: Sequence[torch.Tensor], baselines: Sequence[torch.Tensor], batch_dims: int, splits: torch.Tensor
) -> list[torch.Tensor]:
    """Each input as ``[splits, *input.shape]`` copies, copy ``i`` at the baseline at the positions of the last
    batch dimension that ``splits[i]`` perturbs (see :func:`position_splits`), as given at the others.

    Examples:
        >>> x = split_positions([torch.ones(1, 3, 2)], [torch.zeros(1, 3, 2)], 2, position_splits(3))[0]
        >>> x[:, 0, :, 0].tolist()
        [[1.0, 0.0, 1.0], [1.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
    """
    changed = []
    for x, baseline in zip(inputs, baselines, strict=True):
        at = splits.view(len(splits), *[1] * (batch_dims - 1), splits.shape[1], *[1] * (x.dim() - batch_dims))
        changed.append(torch.where(at, baseline.unsqueeze(0), x.unsqueeze(0)))
    return changed


def positions_alone(x: torch.Tensor, original: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """``[length, *x.shape]``: copy ``t`` holds ``x`` at position ``t`` of the last batch dimension and
    ``original`` at the others (``length`` that dimension's size)."""
    length = x.shape[batch_dims - 1]
    at = _selector(length, batch_dims, x.dim(), x.device)
    own = torch.arange(length, device=x.device).view(length, *[1] * x.dim()) == at.unsqueeze(0)
    return torch.where(own, x.unsqueeze(0), original.unsqueeze(0))


def own_positions(values: torch.Tensor, batch_dims: int) -> torch.Tensor:
    """``values`` of the copies of :func:`positions_alone`, ``[units, length, *batch]``, taken at each position from
    its own copy: ``[units, *batch]``."""
    return torch.diagonal(values, dim1=1, dim2=1 + batch_dims)


def read_across(
    unperturbed: torch.Tensor,
    changed: torch.Tensor,
    splits: torch.Tensor,
    rerun: Callable[[], torch.Tensor],
    batch_dims: int,
) -> float | None:
    """How far the explained output at the positions of the last batch dimension that a split left as given moved
    when the others were perturbed (the largest over the splits, relative to the largest unperturbed value), or
    ``None`` where it did not move by more than rounding (the square root of the dtype's resolution) or moves on a
    pass of the unchanged inputs too.

    Args:
        unperturbed: ``[units, *batch]`` at the caller's inputs.
        changed: ``[units, splits, *batch]`` at the inputs of :func:`split_positions`.
        splits: ``[splits, length]``, the positions each split perturbed (:func:`position_splits`).
        rerun: ``[units, *batch]`` at the caller's inputs again, run only where ``changed`` moved.
        batch_dims: the number of batch dimensions.

    Examples:
        >>> same, splits = torch.ones(1, 2, 4), position_splits(4)
        >>> own = torch.where(splits.view(1, 4, 1, 4), 5.0, 1.0)  # each position reads itself alone
        >>> read_across(same, own, splits, lambda: same, 2) is None
        True
        >>> read_across(same, own * 2, splits, lambda: same, 2)
        1.0
    """
    if not unperturbed.is_floating_point():
        return None
    given = ~splits.view(1, len(splits), *[1] * (batch_dims - 1), splits.shape[1])
    scale = unperturbed.double().abs().nan_to_num(posinf=0.0, neginf=0.0).max().clamp_min(1e-300)

    def apart(value: torch.Tensor, reference: torch.Tensor, where: torch.Tensor | None = None) -> float:
        moved = (value.double() - reference.double()).abs().nan_to_num(nan=0.0)
        return ((moved if where is None else torch.where(where, moved, 0.0)).max() / scale).item()

    tolerance = math.sqrt(torch.finfo(unperturbed.dtype).eps)
    moved = apart(changed, unperturbed.unsqueeze(1), given)
    if moved <= tolerance or apart(rerun(), unperturbed) > tolerance:
        return None
    return moved
