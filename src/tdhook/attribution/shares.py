"""Per-key shares of relevance: how much each observation key explains, per step."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import NestedKey, TensorDict, TensorDictBase
from tensordict.utils import unravel_key

from tdhook.attribution.rules._numerics import safe_divide

__all__ = ["relevance_shares"]


def relevance_shares(
    tensordict: TensorDictBase,
    relevance_key: NestedKey = "relevance",
    signed: bool = False,
    keys: Sequence[NestedKey] | None = None,
    units: int | None = None,
) -> TensorDict:
    """Each relevance key's share of the total, per batch element (per step of a rollout).

    A key's relevance is summed over its own (non-batch) dimensions; by default
    the absolute relevance is used, so the shares are non-negative and sum to one
    (zero where all relevance is zero). With ``signed=True`` the signed sums are
    divided by the signed total, as conservation accounts for relevance.

    Every relevance key under ``relevance_key`` shares one total: relevance of
    one target. A wrapper that explains several targets at once (a dict
    ``target_key``, or the ``{"actor", "critic"}`` default of an actor-critic
    pipeline) writes each target's relevance under ``(relevance_key, name)``;
    take each target's shares with ``relevance_key=("relevance", name)``, as
    the actor's logits and the critic's value do not add up (their shares
    taken together are refused, where the TensorDict holds their inputs).

    The relevance of inner layers (``LRP(..., layers=[...])``, written beside
    the inputs' under the same prefix) is another split of the same total, not
    a share of it: by default only the keys whose input the TensorDict holds
    are shared, or every key where it holds none of their inputs (a TensorDict
    of relevance alone). ``keys`` names the keys to share explicitly.

    A relevance of several targets at once has dimensions its input does not:
    ``LRP(..., target="all")`` puts the explained units after the batch
    dimensions (``[B, units, F]`` for a ``[B, F]`` input), ``split_dim`` the
    explained positions among them (``[B, T, T, F]`` for a ``[B, T, F]``
    input, the target's step before the input's). Their shapes alone do not
    tell which, so ``units`` says how many dimensions after the batch ones
    index units: each unit gets its own shares (``units=1`` for
    ``target="all"``, shares of shape ``[B, units]``), each explained position
    its own shares over every input step (``units=0`` for ``split_dim``).
    Where the TensorDict holds an input whose relevance has more dimensions
    than it, ``units`` must be given.

    Args:
        tensordict: a TensorDict written by :class:`~tdhook.attribution.LRP`.
        relevance_key: the prefix of the relevance keys, nested for one target of several.
        signed: use signed rather than absolute relevance.
        keys: the keys under ``relevance_key`` to share the total among (by default, as above).
        units: the number of dimensions after the batch dimensions that index explained units, each shared on its
            own (1 for ``target="all"``; 0, the default where no relevance has more dimensions than its input).

    Returns:
        A TensorDict with the same keys as ``tensordict[relevance_key]``, each of
        the batch shape (followed by the units' dimensions).

    Raises:
        ValueError: a relevance has more dimensions than its input (several targets explained at once) and
            ``units`` is not given, naming the key and both shapes; or the keys' units differ; or the relevance keys
            are the inputs' under target names (``("actor", "observation")``) and no ``keys`` are given.

    Examples:
        >>> td = TensorDict(
        ...     relevance=TensorDict(pixels=torch.ones(2, 3, 4, 4), state=torch.full((2, 2), 8.0), batch_size=[2]),
        ...     batch_size=[2],
        ... )
        >>> shares = relevance_shares(td)
        >>> shares["pixels"], shares["state"]
        (tensor([0.7500, 0.7500]), tensor([0.2500, 0.2500]))
        >>> td["state"] = torch.zeros(2, 2)  # the state is an input; the pixels' entry a layer's, say
        >>> relevance_shares(td)["state"]
        tensor([1., 1.])
        >>> every_unit = TensorDict(  # LRP(..., target="all") of a policy with 2 actions
        ...     state=torch.ones(3, 2), relevance=TensorDict(state=torch.ones(3, 2, 2), batch_size=[3]), batch_size=[3]
        ... )
        >>> every_unit["relevance", "goal"] = torch.tensor([[[0.0], [2.0]]]).expand(3, 2, 1)
        >>> every_unit["goal"] = torch.ones(3, 1)
        >>> relevance_shares(every_unit, units=1)["goal"]
        tensor([[0.0000, 0.5000],
                [0.0000, 0.5000],
                [0.0000, 0.5000]])
    """
    if relevance_key not in tensordict.keys(include_nested=True):
        other = "attribution" if relevance_key != "attribution" and "attribution" in tensordict.keys() else None
        advice = (
            f"; it holds {other!r}, where the gradient and perturbation methods write: pass relevance_key={other!r}"
            if other is not None
            else "; run it through LRP first"
        )
        raise KeyError(f"relevance_shares: the TensorDict has no {relevance_key!r} entry{advice}")
    relevance = tensordict.get(relevance_key)
    batch_dims = tensordict.batch_dims
    found = list(relevance.keys(include_nested=True, leaves_only=True))
    if keys is None:
        inputs = tensordict.keys(include_nested=True)
        keys = [key for key in found if key in inputs]
        if not keys:
            _refuse_several_targets(relevance_key, found, inputs)
            keys = found
    else:
        keys = [unravel_key(key) for key in keys]
        missing = [key for key in keys if key not in found]
        if missing:
            raise KeyError(f"relevance_shares: {relevance_key!r} holds no relevance at {missing}; it holds {found}")
    if units is None:
        units = _refuse_units_unsaid(tensordict, relevance, keys)
    totals = {}
    for key in keys:
        value = relevance.get(key)
        value = value if signed else value.abs()
        totals[key] = value.reshape(*value.shape[: batch_dims + units], -1).sum(-1)
    if not totals:
        raise KeyError(f"relevance_shares: {relevance_key!r} holds no relevance keys")
    shapes = {key: list(total.shape) for key, total in totals.items()}
    if len({tuple(shape) for shape in shapes.values()}) > 1:
        raise ValueError(
            f"relevance_shares: with units={units}, the keys' batch and unit dimensions differ ({shapes}): the keys "
            "do not share one total"
        )
    total = torch.stack(list(totals.values())).sum(0)
    shares = {key: safe_divide(part, total) for key, part in totals.items()}
    out = TensorDict(batch_size=tensordict.batch_size, device=tensordict.device)
    for key, share in shares.items():
        out.set(key, share)
    return out


def _refuse_units_unsaid(tensordict: TensorDictBase, relevance: TensorDictBase, keys: Sequence[NestedKey]) -> int:
    """0 where no key's relevance has more dimensions than its input in ``tensordict``; else a ``ValueError``: which of
    those dimensions are units (``target="all"``) or explained positions (``split_dim``) the shapes do not say."""
    inputs = tensordict.keys(include_nested=True)
    for key in keys:
        if key in inputs and isinstance(tensordict.get(key), torch.Tensor):
            value, given = relevance.get(key), tensordict.get(key)
            if value.dim() > given.dim():
                raise ValueError(
                    f"relevance_shares: the relevance at {key!r} has shape {list(value.shape)} for an input of shape "
                    f"{list(given.shape)}: it holds several targets' relevance, whose shares are not one total. Pass "
                    "units=1 for LRP(..., target='all') (each unit's shares), or units=0 for LRP(..., split_dim=...) "
                    "(each explained position's shares)"
                )
    return 0


def _refuse_several_targets(relevance_key: NestedKey, found: list[NestedKey], inputs) -> None:
    """Raise where the relevance keys are inputs' keys under target names (``("actor", "observation")``, the layout
    of a wrapper explaining several targets at once): their shares would split the sum of unrelated totals."""
    named = sorted({key[0] for key in found if isinstance(key, tuple) and unravel_key(key[1:]) in inputs})
    if named:
        prefix = relevance_key if isinstance(relevance_key, tuple) else (relevance_key,)
        names = ", ".join(map(repr, named))
        raise ValueError(
            f"relevance_shares: {relevance_key!r} holds the relevance of several targets ({names}), whose totals "
            "do not add up (an actor's logits and a critic's value); take each target's shares with "
            f"relevance_key={(*prefix, named[0])!r}"
        )
