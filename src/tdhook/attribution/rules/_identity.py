"""A weak-keyed mapping that compares keys by identity, never by ``==``.

``weakref.WeakKeyDictionary`` compares its keys with ``==`` when their hashes
meet. Modules that define ``==`` element-wise, as tensordict's
``TensorDictParams`` does (torchrl's multi-agent networks hold one), then
raise "Converting a tensordict to boolean value is not permitted". Modules are
told apart by identity here.

Examples:
    >>> from tensordict import TensorDict
    >>> from tensordict.nn import TensorDictParams
    >>> params = TensorDictParams(TensorDict(w=torch.ones(2), batch_size=[]))
    >>> owners = IdentityWeakKeyDict()
    >>> owners[params] = "wrapper"
    >>> params in owners, owners.get(params), len(owners)
    (True, 'wrapper', 1)
    >>> del params
    >>> len(owners)  # the entry goes with its key
    0
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, MutableMapping
from typing import Any, Generic, TypeVar

import torch  # noqa: F401 (the examples use it)

__all__ = ["IdentityWeakKeyDict"]

K = TypeVar("K")
V = TypeVar("V")


class IdentityWeakKeyDict(MutableMapping, Generic[K, V]):
    """A mapping from objects, held weakly and compared by identity, to values."""

    def __init__(self) -> None:
        self._data: dict[int, tuple[weakref.ref, V]] = {}

    def _forget(self, key_id: int, reference: weakref.ref) -> None:
        entry = self._data.get(key_id)
        if entry is not None and entry[0] is reference:
            del self._data[key_id]

    def __setitem__(self, key: K, value: V) -> None:
        key_id = id(key)
        reference = weakref.ref(key, lambda ref, key_id=key_id: self._forget(key_id, ref))
        self._data[key_id] = (reference, value)

    def __getitem__(self, key: K) -> V:
        entry = self._data.get(id(key))
        if entry is None or entry[0]() is not key:
            raise KeyError(key)
        return entry[1]

    def __delitem__(self, key: K) -> None:
        self[key]  # noqa: B018 (raises KeyError for a foreign key)
        del self._data[id(key)]

    def __iter__(self) -> Iterator[K]:
        for reference, _ in list(self._data.values()):
            key = reference()
            if key is not None:
                yield key

    def __len__(self) -> int:
        return sum(1 for reference, _ in self._data.values() if reference() is not None)

    def __contains__(self, key: Any) -> bool:
        entry = self._data.get(id(key))
        return entry is not None and entry[0]() is key
