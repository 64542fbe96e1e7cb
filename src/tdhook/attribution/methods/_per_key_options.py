"""Options of a method given as one value or a dict keyed by input key, settable after the wrapper is built.

A method's constructor reads such an option once per explained key (see :func:`~tdhook.attribution.methods._options.
per_key`); a call reads that list. The option set on the wrapper later (``occlusion.strides = 2``) must be read the
same way, or a value meant for every key is read as one entry per key: :class:`PerKeyOption` is the attribute that
does it, keeping the value as given (what the attribute returns) and the list per key (what the calls read, and
what a copy narrowed to fewer keys keeps; see :func:`~tdhook.attribution.methods._call_keys.narrowed`).

Examples:
    >>> class Method:
    ...     strides = PerKeyOption()
    ...     explained_keys, _defaulted_inputs = ["obs", "goal"], False
    >>> method = Method()
    >>> method.strides = 2
    >>> method.strides, method._strides
    (2, [2, 2])
    >>> method.strides = {"obs": 1, "goal": 3}
    >>> method._strides
    [1, 3]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from numbers import Real
from typing import Any

from tensordict.utils import NestedKey

from tdhook.attribution.methods._options import MISSING, per_key

__all__ = ["PerKeyOption", "check_stdevs"]


class PerKeyOption:
    """A method's option read per explained key whenever it is set (the constructor sets it too).

    Args:
        check: called with the method's name, the explained keys and the values per key; raises for a value the
            method refuses (the option is then left as it was).
        per_key_name: the attribute that holds the values per key (``_<name>`` by default).
    """

    def __init__(self, check: Callable[[str, Sequence[NestedKey], list], None] | None = None, per_key_name: str = ""):
        self.check, self.per_key_name = check, per_key_name

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name
        self.per_key_name = self.per_key_name or f"_{name}"
        self.given_name = f"_{name}_given"

    def __get__(self, method: Any, owner: type | None = None) -> Any:
        return self if method is None else method.__dict__[self.given_name]

    def __set__(self, method: Any, value: Any) -> None:
        owner, keys = type(method).__name__, method.explained_keys
        values = per_key(value, keys, self.name, owner, partial=method._defaulted_inputs)
        if self.check is not None:
            self.check(owner, keys, values)
        method.__dict__[self.per_key_name], method.__dict__[self.given_name] = values, value


def check_stdevs(owner: str, keys: Sequence[NestedKey], stdevs: list) -> None:
    """Refuse a standard deviation that is no number >= 0, naming its key.

    Examples:
        >>> check_stdevs("SmoothGrad", ["x"], [-1.0])
        Traceback (most recent call last):
        ...
        ValueError: SmoothGrad: the stdev of input key 'x' must be a number >= 0, got -1.0
    """
    for key, value in zip(keys, stdevs, strict=True):
        if value is not MISSING and (isinstance(value, bool) or not isinstance(value, Real) or not value >= 0):
            raise ValueError(f"{owner}: the stdev of input key {key!r} must be a number >= 0, got {value!r}")
