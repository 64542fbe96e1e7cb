"""Explained inputs that share memory with another input of the call, and a model that writes into that memory.

A wrapper hands the model a copy of each explained input (see :func:`~tdhook.attribution._inputs.feed_inputs`),
which cuts the link between two keys of the caller's TensorDict that hold the same memory (``TensorDict(x=t, y=t)``,
or ``y=x[:, :2]``). As long as the model writes into neither, that changes nothing. Where it writes into one of them
in place (``y.mul_(2)``, an in-place normaliser), a plain call sees the change under the other key too, and the
wrapper's call does not: its outputs are those of another function, and the relevance, taken on the caller's
memory, mixes the values before and after the write. Such a call is refused by the keys, and the caller's tensors
are put back as they were.

Examples:
    >>> import torch
    >>> from tensordict import TensorDict
    >>> x = torch.ones(2, 3)
    >>> td = TensorDict(x=x, y=x[:, :2], batch_size=[2])
    >>> fed = [x.clone()]
    >>> watch = AliasedInputs.watch(td, ["x"], fed, ["x", "y"])
    >>> watch.check("LRP")  # nothing written in place
    >>> _ = td["y"].mul_(2)  # what the model may do to its input
    >>> watch.check("LRP")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: LRP: the model changed 'y' in place, which shares memory with the explained input 'x'; ...
    >>> td["x"].tolist()  # put back
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
    >>> AliasedInputs.watch(TensorDict(x=x, z=x.clone(), batch_size=[2]), ["x"], fed, ["x", "z"]) is None
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey

__all__ = ["AliasedInputs", "checked_after_run"]

_NOTHING = contextlib.nullcontext()  # reusable: entering it does nothing


def checked_after_run(
    name: str,
    tensordict: TensorDictBase,
    keys: Sequence[NestedKey],
    fed: Sequence[torch.Tensor | None],
    read: Sequence[NestedKey],
) -> contextlib.AbstractContextManager:
    """A block running the model, after which a write into memory an explained input shares with another input is
    refused (see :meth:`AliasedInputs.check`, and :meth:`AliasedInputs.watch` for the arguments); a block that
    raises is left to its error.

    Examples:
        >>> import torch
        >>> from tensordict import TensorDict
        >>> x = torch.ones(2, 3)
        >>> td = TensorDict(x=x, y=x, batch_size=[2])
        >>> with checked_after_run("Saliency", td, ["x"], [x.clone()], ["x", "y"]):
        ...     _ = td["y"].add_(1)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        RuntimeError: Saliency: the model changed 'y' in place, which shares memory with the explained input 'x'; ...
    """
    watch = AliasedInputs.watch(tensordict, keys, fed, read)
    return _NOTHING if watch is None else _Checking(watch, name)


class _Checking:
    """Checks ``watch`` when the block it is entered around ends without an error."""

    __slots__ = ("_name", "_watch")

    def __init__(self, watch: AliasedInputs, name: str) -> None:
        self._watch, self._name = watch, name

    def __enter__(self) -> None:
        return None

    def __exit__(self, error_type: type | None, *rest: object) -> None:
        if error_type is None:
            self._watch.check(self._name)


class AliasedInputs:
    """The explained inputs of one call whose memory another input read by the model shares, watched for writes."""

    __slots__ = ("_kept", "_pairs")

    def __init__(self, pairs: list[tuple[NestedKey, NestedKey, list[tuple[torch.Tensor, int]]]]) -> None:
        self._pairs = pairs
        # The caller's tensors of the pairs, as they were, to put back where the call is refused.
        tensors = {id(t): t for _, _, watched in pairs for t, _ in watched[:2]}
        self._kept = [(t, t.detach().clone()) for t in tensors.values()]

    @classmethod
    def watch(
        cls,
        tensordict: TensorDictBase,
        keys: Sequence[NestedKey],
        fed: Sequence[torch.Tensor | None],
        read: Sequence[NestedKey],
    ) -> AliasedInputs | None:
        """The watch of a call, or ``None`` where no explained input shares memory with another input.

        Args:
            tensordict: the caller's TensorDict, before the model runs.
            keys: the explained input keys.
            fed: per key, the tensor the model is given in its place (``None`` for a key this call does not
                explain, and for integer tokens).
            read: the keys the model reads (its in_keys), the explained ones among them.
        """
        if len(read) < 2:
            return None
        pairs = []
        for key, copy in zip(keys, fed, strict=True):
            if copy is None:
                continue
            value = tensordict.get(key, None)
            if not _watchable(value):
                continue
            for other in read:
                if other == key:
                    continue
                shared = tensordict.get(other, None)
                if _watchable(shared) and _overlap(value, shared):
                    pairs.append(
                        (key, other, [(value, value._version), (shared, shared._version), *_kept(copy, value)])
                    )
        return cls(pairs) if pairs else None

    def check(self, name: str) -> None:
        """Refuse the call where the model wrote in place into memory an explained input shares with another
        input (the caller's, or the copy it was given), after putting the caller's tensors back.

        Raises:
            RuntimeError: naming the key written and the explained input.
        """
        for key, other, watched in self._pairs:
            changed = [tensor for tensor, version in watched if tensor._version != version]
            if not changed:
                continue
            with torch.no_grad():
                for tensor, kept in self._kept:
                    tensor.copy_(kept)
            if len(watched) > 2 and any(tensor is watched[2][0] for tensor in changed):
                what = f"its copy of the explained input {key!r} in place, which shares memory with {other!r}"
            else:
                what = f"{other!r} in place, which shares memory with the explained input {key!r}"
            raise RuntimeError(
                f"{name}: the model changed {what}; {name} gives the model a copy of each explained input, so "
                "the other key would not see the change as in a plain call and the result would explain another "
                f"function: store a copy under one of the keys (td[{other!r}] = td[{other!r}].clone()) or change "
                "it out of place in the model"
            )


def _kept(copy: torch.Tensor, value: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """The copy of ``value`` given to the model with its version, where it is a copy (not ``value``'s memory) that
    can be written in place."""
    return [(copy, copy._version)] if _watchable(copy) and not _overlap(copy, value) else []


def _watchable(value: Any) -> bool:
    """Whether ``value`` is a tensor with memory that can be changed in place (not an inference tensor)."""
    return (
        isinstance(value, torch.Tensor)
        and not value.is_inference()
        and value.numel() > 0
        and value.layout == torch.strided
        and not value.is_meta
    )


def _span(tensor: torch.Tensor) -> tuple[int, int]:
    """The elements of its storage ``tensor`` may touch: from its first one to one past its last."""
    start = tensor.storage_offset()
    return start, start + 1 + sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` share memory: the same storage and, where their spans meet, an element in common
    (two column slices of one matrix interleave without one: ``m[:, :3]`` and ``m[:, 4:]``)."""
    if a.device != b.device or a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a_start, a_end), (b_start, b_end) = _span(a), _span(b)
    if a_start * a.element_size() >= b_end * b.element_size() or b_start * b.element_size() >= a_end * a.element_size():
        return False  # apart in the storage's bytes (the entries of a consolidated TensorDict, whatever their dtypes)
    if a.element_size() != b.element_size():
        return True  # views of one storage as different dtypes that meet: taken as sharing
    if a.is_contiguous() and b.is_contiguous():
        return True
    low = min(a_start, b_start)
    touched = torch.zeros(max(a_end, b_end) - low, dtype=torch.bool)
    touched.as_strided(a.shape, a.stride(), a_start - low).fill_(True)
    return bool(touched.as_strided(b.shape, b.stride(), b_start - low).any())
