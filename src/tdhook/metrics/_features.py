"""The features a metric perturbs: attributions read from a TensorDict, flattened in ``in_keys`` order.

A feature is one element of an attribution as stored at ``(relevance_key, *key)``. An attribution must broadcast
to its input key without broadcasting the batch: one the shape of the input makes every input element a feature,
one with a size-1 channel dimension (``[B, 1, H, W]`` for ``[B, 3, H, W]``) makes every pixel one feature that
covers all its channels.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> td = TensorDict(x=torch.zeros(2, 3, 4, 4), attribution=TensorDict(x=torch.ones(2, 1, 4, 4)), batch_size=[2])
    >>> features = Features.read(td, ["x"], "attribution")
    >>> features.values.shape, features.n_features
    (torch.Size([2, 16]), 16)
    >>> mask = torch.zeros(1, 2, 16, dtype=torch.bool)
    >>> mask[..., 0] = True
    >>> features.perturb(mask, 5.0)["x"][0, 0, :, 0, 0]
    tensor([5., 5., 5.])
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Union

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey, unravel_key, unravel_key_list

from tdhook.attribution._keys import is_key
from tdhook.attribution.methods._options import entries
from tdhook.metrics._stable_order import stable_order

__all__ = ["Baseline", "Features", "explained_keys", "positions_of", "sort_positions", "stacked_batch"]

Baseline = Union[float, torch.Tensor, Mapping[NestedKey, Union[float, torch.Tensor]]]


def explained_keys(in_keys: Sequence[NestedKey] | None, default: Sequence[NestedKey]) -> list[NestedKey]:
    """``in_keys`` unravelled, or ``default`` where none were given.

    Examples:
        >>> explained_keys(None, ["x", ("a", "b")])
        ['x', ('a', 'b')]
        >>> explained_keys(["x"], ["y"])
        ['x']
    """
    keys = unravel_key_list(list(in_keys if in_keys is not None else default))
    if not keys:
        raise ValueError("metrics: in_keys is empty; name at least one input key to perturb")
    return keys


def sort_positions(values: torch.Tensor, descending: bool = True) -> torch.Tensor:
    """The position of every entry of the last dimension in a stable sort (ties keep the lower index first).

    Examples:
        >>> sort_positions(torch.tensor([0.5, 2.0, 0.5, 1.0]))
        tensor([2, 0, 3, 1])
        >>> sort_positions(torch.tensor([0.5, 2.0, 0.5, 1.0]), descending=False)
        tensor([0, 3, 1, 2])
    """
    return positions_of(stable_order(values, descending))


def positions_of(order: torch.Tensor) -> torch.Tensor:
    """The position of every entry of the last dimension in ``order`` (each row a permutation): its inverse.

    Examples:
        >>> positions_of(torch.tensor([[1, 3, 0, 2]]))
        tensor([[2, 0, 3, 1]])
    """
    arange = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, arange)


def stacked_batch(n_steps: int, batch: Sequence[int]) -> tuple[int, ...]:
    """The batch shape of ``n_steps`` perturbed copies of a ``batch``, stacked along its first dimension: a
    ``[B, T]`` batch keeps its time dimension (a model may mix along every dimension but the first).

    Examples:
        >>> stacked_batch(3, [2, 5]), stacked_batch(3, [])
        ((6, 5), (3,))
    """
    return (n_steps * batch[0], *batch[1:]) if len(batch) else (n_steps,)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {list(value.shape)}"
    return type(value).__name__


@dataclass
class Features:
    """The explained keys of one TensorDict and their attributions, as one row of features per sample.

    Attributes:
        keys: the explained input keys, in order.
        inputs: the input of each key, ``batch + shape``.
        attributions: the attribution of each key, as stored (it broadcasts to the input).
        batch_size: the TensorDict's batch size.
        prefix: the prefix of the attribution keys, as a tuple.
    """

    keys: list[NestedKey]
    inputs: list[torch.Tensor]
    attributions: list[torch.Tensor]
    batch_size: torch.Size
    prefix: tuple[str, ...] = ("attribution",)

    @classmethod
    def read(
        cls, td: TensorDictBase, in_keys: Sequence[NestedKey], relevance_key: NestedKey, unit_dims: int = 0
    ) -> Features:
        """Read the inputs at ``in_keys`` and their attributions at ``(relevance_key, *key)``.

        ``unit_dims`` dimensions of an attribution between the batch's and the input's hold one attribution per
        explained unit (a method with ``target="all"``, LRP with ``split_dim``); a metric that compares explanations
        with each other reads them so, the others read one attribution per sample.

        Raises:
            TypeError: ``relevance_key`` is no key.
            KeyError: an input or its attribution is missing.
            ValueError: an attribution does not broadcast to its input.
        """
        if not is_key(relevance_key):  # tensordict would read ("attribution", 0) as "attribution"
            raise TypeError(
                "metrics: relevance_key must be a key (a str or a tuple of str), the prefix of the attribution keys, "
                f"got {relevance_key!r}"
            )
        batch = td.batch_size
        inputs, attributions = [], []
        prefix = unravel_key(relevance_key)
        prefix = prefix if isinstance(prefix, tuple) else (prefix,)
        for key in in_keys:
            x = inputs_value(td, key)
            a_key = (*prefix, *(key if isinstance(key, tuple) else (key,)))
            a = td.get(a_key, None)
            if a is None:
                present = sorted(map(str, td.keys(include_nested=True, leaves_only=True)))
                raise KeyError(
                    f"metrics: attribution key {a_key!r} for input {key!r} is missing from the TensorDict "
                    f"(keys: {present}); run an attribution method first, or pass relevance_key= the prefix it "
                    "writes (LRP writes 'relevance')"
                )
            if not isinstance(a, torch.Tensor) or not a.is_floating_point():
                raise TypeError(f"metrics: attribution {a_key!r} must be a floating-point tensor, got {_describe(a)}")
            n = len(batch)
            per_unit = a.shape[n + unit_dims :] if a.dim() >= n + unit_dims else None
            fits = per_unit is not None and len(per_unit) == x.dim() - n
            fits = fits and all(s in (1, t) for s, t in zip(per_unit, x.shape[n:], strict=True))
            if not fits or a.shape[:n] != batch:
                units = " and the explained units' dimensions" if unit_dims else ""
                hint = (
                    " (one dimension more than the input: an attribution per output unit, target='all', or per "
                    "position of LRP's split_dim, which this metric does not score: explain one target)"
                    if not unit_dims and a.dim() == x.dim() + 1 and a.shape[:n] == batch
                    else ""
                )
                raise ValueError(
                    f"metrics: attribution {a_key!r} of shape {list(a.shape)} does not broadcast to input {key!r} "
                    f"of shape {list(x.shape)}; expected the batch {list(batch)}{units} followed by each dimension "
                    f"of the input or 1{hint}"
                )
            inputs.append(x.detach())  # scores carry no graph of the caller's
            attributions.append(a.detach())
        return cls(list(in_keys), inputs, attributions, batch, prefix)

    def refuse_nan(self, metric: str) -> None:
        """Raise where an attribution holds NaN, which has no rank among the features.

        Raises:
            ValueError: naming the metric, the attribution's key and the first NaN's index.
        """
        for key, a in zip(self.keys, self.attributions, strict=True):
            # No index search in the common case: a sum holds NaN where any element does (and where +inf and -inf
            # meet, which the search below tells apart), one reduction instead of a mask and its reduction.
            if not (a.is_floating_point() and bool(a.sum().isnan())):
                continue
            where = a.isnan().nonzero()
            if len(where):
                a_key = (*self.prefix, *(key if isinstance(key, tuple) else (key,)))
                raise ValueError(
                    f"{metric}: attribution {a_key!r} holds NaN (at {tuple(where[0].tolist())}), which has no rank "
                    "among the features; replace it (torch.nan_to_num) or find where the method divided by zero"
                )

    @property
    def sizes(self) -> list[int]:
        """The number of features of each key."""
        n = len(self.batch_size)
        return [math.prod(a.shape[n:]) for a in self.attributions]

    @property
    def n_features(self) -> int:
        """The number of features of all keys together."""
        return sum(self.sizes)

    @property
    def values(self) -> torch.Tensor:
        """The attributions as ``batch + [n_features]``, keys concatenated in order."""
        flat = [a.reshape(*self.batch_size, n) for a, n in zip(self.attributions, self.sizes, strict=True)]
        return flat[0] if len(flat) == 1 else torch.cat(flat, -1)

    def broadcast_values(self) -> list[torch.Tensor]:
        """Each attribution broadcast to its input's shape."""
        return [a.expand_as(x) for a, x in zip(self.attributions, self.inputs, strict=True)]

    def baselines(self, baseline: Baseline) -> list[torch.Tensor]:
        """``baseline`` as one tensor per key that broadcasts to the key's input.

        Raises:
            KeyError: a dict of baselines misses a key.
            ValueError: a baseline does not broadcast to its key, or has the batch's shape and fewer dimensions than
                its key (``[B]`` for ``[B, F]``: per sample or, by broadcasting, per feature?).
        """
        out = []
        for key, x in zip(self.keys, self.inputs, strict=True):
            if isinstance(baseline, Mapping):
                found = {unravel_key(k): v for k, v in entries(baseline).items()}
                if key not in found:
                    raise KeyError(f"metrics: baseline dict has no entry for input {key!r} (keys: {list(found)})")
                value = found[key]
            else:
                value = baseline
            value = torch.as_tensor(value, dtype=x.dtype, device=x.device)
            self._refuse_batch_shaped(key, value, x)
            fits = value.dim() <= x.dim() and all(
                v in (1, s) for v, s in zip(reversed(value.shape), reversed(x.shape), strict=False)
            )
            if not fits:
                raise ValueError(
                    f"metrics: baseline of shape {list(value.shape)} does not broadcast to input {key!r} of shape "
                    f"{list(x.shape)}; give a number or a tensor that broadcasts to it"
                )
            out.append(value)
        return out

    def _refuse_batch_shaped(self, key: NestedKey, value: torch.Tensor, x: torch.Tensor) -> None:
        """Raise where a baseline has the batch's shape and fewer dimensions than its input: torch's broadcasting
        would align it with the input's last dimensions (one value per feature), not one value per sample."""
        batch = tuple(self.batch_size)
        if value.numel() <= 1 or tuple(value.shape) != batch or value.dim() >= x.dim():
            return
        per_sample = ", ".join(map(str, (*batch, *([1] * (x.dim() - len(batch))))))
        per_feature = ", ".join(map(str, (*([1] * (x.dim() - value.dim())), *value.shape)))
        raise ValueError(
            f"metrics: baseline of shape {list(value.shape)} for input {key!r} of shape {list(x.shape)} has the "
            "batch's shape, and broadcasting would align it with the input's last dimensions (one value per "
            f"feature), not one per sample; give one value per sample as baseline.view({per_sample}), or one per "
            f"feature as baseline.view({per_feature})"
        )

    def split(self, mask: torch.Tensor) -> list[torch.Tensor]:
        """A feature mask ``lead + batch + [n_features]`` as one mask per key, each shaped like its attribution."""
        lead = mask.shape[: mask.dim() - len(self.batch_size) - 1]
        parts = torch.split(mask, self.sizes, dim=-1)
        return [p.reshape(*lead, *a.shape) for p, a in zip(parts, self.attributions, strict=True)]

    def perturb(self, mask: torch.Tensor, baseline: Baseline) -> dict[NestedKey, torch.Tensor]:
        """The inputs with the masked features at ``baseline``, one ``lead + input shape`` tensor per key.

        Args:
            mask: boolean, ``lead + batch + [n_features]``: the features to set to the baseline.
            baseline: see :class:`Baseline`.
        """
        return {
            key: torch.where(m, b, x)
            for key, m, b, x in zip(self.keys, self.split(mask), self.baselines(baseline), self.inputs, strict=True)
        }


def inputs_value(td: TensorDictBase, key: NestedKey) -> torch.Tensor:
    """The floating-point input at ``key``.

    Raises:
        KeyError: ``key`` is missing.
        TypeError: it is not a floating-point tensor.
    """
    x = td.get(key, None)
    if x is None:
        present = sorted(map(str, td.keys(include_nested=True, leaves_only=True)))
        raise KeyError(f"metrics: input key {key!r} is missing from the TensorDict (keys: {present})")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"metrics: input key {key!r} must be a floating-point tensor, got {_describe(x)}")
    return x
