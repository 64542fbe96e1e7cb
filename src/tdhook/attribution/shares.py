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
    the actor's logits and the critic's value do not add up.

    The relevance of inner layers (``LRP(..., layers=[...])``, written beside
    the inputs' under the same prefix) is another split of the same total, not
    a share of it: by default only the keys whose input the TensorDict holds
    are shared, or every key where it holds none of their inputs (a TensorDict
    of relevance alone). ``keys`` names the keys to share explicitly.

    Args:
        tensordict: a TensorDict written by :class:`~tdhook.attribution.LRP`.
        relevance_key: the prefix of the relevance keys, nested for one target of several.
        signed: use signed rather than absolute relevance.
        keys: the keys under ``relevance_key`` to share the total among (by default, as above).

    Returns:
        A TensorDict with the same keys as ``tensordict[relevance_key]``, each of
        the batch shape.

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
        keys = [key for key in found if key in inputs] or found
    else:
        keys = [unravel_key(key) for key in keys]
        missing = [key for key in keys if key not in found]
        if missing:
            raise KeyError(f"relevance_shares: {relevance_key!r} holds no relevance at {missing}; it holds {found}")
    totals = {}
    for key in keys:
        value = relevance.get(key)
        value = value if signed else value.abs()
        totals[key] = value.reshape(*value.shape[:batch_dims], -1).sum(-1)
    if not totals:
        raise KeyError(f"relevance_shares: {relevance_key!r} holds no relevance keys")
    total = torch.stack(list(totals.values())).sum(0)
    shares = {key: safe_divide(part, total) for key, part in totals.items()}
    out = TensorDict(batch_size=tensordict.batch_size, device=tensordict.device)
    for key, share in shares.items():
        out.set(key, share)
    return out
