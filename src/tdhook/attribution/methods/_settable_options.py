"""Options of a method that can be set after the wrapper is built, read and checked as its constructor does.

The constructor checks its options (a positive number of samples, a flag that is a bool) and reads the options given
as one value or a dict keyed by input key once per explained key (see :func:`~tdhook.attribution.methods._options.
per_key`); a call reads what it stored. An option set on the wrapper later (``occlusion.strides = 2``,
``smooth.nt_type = "vargrad"``) must be read and checked the same way, or a value meant for every key is read as one
entry per key and a value the constructor refuses runs: :class:`PerKeyOption` and :class:`CheckedOption` are the
attributes that do it. A per-key option keeps the value as given (what the attribute returns) and the list per key
(what the calls read, and what a copy narrowed to fewer keys keeps; see
:func:`~tdhook.attribution.methods._call_keys.narrowed`).

Examples:
    >>> class Method:
    ...     strides = PerKeyOption()
    ...     n_samples = CheckedOption(positive_int)
    ...     explained_keys, _defaulted_inputs = ["obs", "goal"], False
    >>> method = Method()
    >>> method.strides = 2
    >>> method.strides, method._strides
    (2, [2, 2])
    >>> method.strides = {"obs": 1, "goal": 3}
    >>> method._strides
    [1, 3]
    >>> method.n_samples = 0
    Traceback (most recent call last):
    ...
    ValueError: Method: n_samples must be a positive int, got 0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from numbers import Integral, Real
from typing import Any

from tensordict.utils import NestedKey

from tdhook.attribution.methods._options import MISSING, checked_batch_size, per_key
from tdhook.attribution.tunables import BUILDING

__all__ = [
    "CheckedOption",
    "FixedKeys",
    "FixedOption",
    "PerKeyOption",
    "batch_size",
    "check_stdevs",
    "one_of",
    "positive_int",
    "seed_value",
]


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


class CheckedOption:
    """A method's option checked whenever it is set (the constructor sets it too).

    Args:
        check: called with the value, the option's name and the method's name; returns the value to keep, or
            raises for one the method refuses (the option is then left as it was).
    """

    def __init__(self, check: Callable[[Any, str, str], Any]) -> None:
        self.check = check

    def __set_name__(self, owner: type, name: str) -> None:
        self.name, self.stored = name, f"_{name}_value"

    def __get__(self, method: Any, owner: type | None = None) -> Any:
        if method is None:
            return self
        try:
            return method.__dict__[self.stored]
        except KeyError:
            raise AttributeError(f"{type(method).__name__} has no {self.name} yet") from None

    def __set__(self, method: Any, value: Any) -> None:
        method.__dict__[self.stored] = self.check(value, self.name, type(method).__name__)


class PerKeyOption(CheckedOption):
    """A method's option read per explained key whenever it is set (the constructor sets it too); the attribute gives
    it back as given.

    Args:
        check: called with the method's name, the explained keys and the values per key; raises for a value the
            method refuses (the option is then left as it was).
        per_key_name: the attribute that holds the values per key (``_<name>`` by default).
    """

    def __init__(self, check: Callable[[str, Sequence[NestedKey], list], None] | None = None, per_key_name: str = ""):
        super().__init__(_as_given)
        self.check_values, self.per_key_name = check, per_key_name

    def __set_name__(self, owner: type, name: str) -> None:
        super().__set_name__(owner, name)
        self.per_key_name = self.per_key_name or f"_{name}"

    def __set__(self, method: Any, value: Any) -> None:
        owner, keys = type(method).__name__, method.explained_keys
        values = per_key(value, keys, self.name, owner, partial=method._defaulted_inputs)
        if self.check_values is not None:
            self.check_values(owner, keys, values)
        method.__dict__[self.per_key_name] = values
        super().__set__(method, value)


def positive_int(value: Any, name: str, owner: str) -> int:
    """``value``, an int of at least 1 (no bool).

    Examples:
        >>> positive_int(3, "n_samples", "SmoothGrad")
        3
    """
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
    return value


# The seeds torch's generators take (``manual_seed`` refuses any other, with a message naming no option).
SEEDS = range(-(2**63), 2**64)


def seed_value(value: Any, name: str, owner: str) -> int | None:
    """``value``, a seed: ``None`` (fresh draws every call) or an integer torch's generators take (a NumPy integer
    too); no bool, and no float, which would be cut to an int (``1.2`` and ``1.7`` the same draws).

    Examples:
        >>> seed_value(None, "seed", "SmoothGrad"), seed_value(3, "seed", "SmoothGrad")
        (None, 3)
        >>> seed_value(1.5, "seed", "SmoothGrad")
        Traceback (most recent call last):
        ...
        ValueError: SmoothGrad: seed must be None or an int in [-2**63, 2**64), got 1.5
    """
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, Integral) or int(value) not in SEEDS:
        raise ValueError(f"{owner}: {name} must be None or an int in [-2**63, 2**64), got {value!r}")
    return int(value)


def one_of(choices: tuple) -> Callable[[Any, str, str], Any]:
    """A check that takes one of ``choices``.

    Examples:
        >>> one_of(("a", "b"))("c", "kind", "Method")
        Traceback (most recent call last):
        ...
        ValueError: Method: kind must be one of ('a', 'b'), got 'c'
    """

    def check(value: Any, name: str, owner: str) -> Any:
        if value not in choices:
            raise ValueError(f"{owner}: {name} must be one of {choices}, got {value!r}")
        return value

    return check


def batch_size(value: Any, name: str, owner: str) -> int | None:
    """``value``, a positive int or ``None`` (see :func:`~tdhook.attribution.methods._options.checked_batch_size`).

    Examples:
        >>> batch_size(None, "internal_batch_size", "SmoothGrad")
    """
    return checked_batch_size(value, owner)


class FixedOption(CheckedOption):
    """An option fixed when the wrapper is built: what it names (the keys the wrapper reads and writes, its
    ``out_keys``) is settled then, so setting it afterwards, which would change nothing the calls do, is refused.

    Examples:
        >>> class Method:
        ...     relevance_key = FixedOption()
        ...
        ...     def __init__(self):
        ...         self.__dict__[BUILDING] = 1
        ...         self.relevance_key = "attribution"
        ...         self.__dict__[BUILDING] = 0
        >>> method = Method()
        >>> method.relevance_key = "saliency"  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        AttributeError: Method: relevance_key is fixed when the wrapper is built; build a new Method(...)
    """

    def __init__(self) -> None:
        super().__init__(_as_given)

    def __set__(self, wrapper: Any, value: Any) -> None:
        if not wrapper.__dict__.get(BUILDING):
            owner = type(wrapper).__name__
            raise AttributeError(
                f"{owner}: {self.name} is fixed when the wrapper is built; build a new {owner}(..., {self.name}=...)"
            )
        super().__set__(wrapper, value)


def _as_given(value: Any, name: str, owner: str) -> Any:
    return value


class FixedKeys:
    """The keys a wrapper writes (``relevance_key``) and explains (``target_key``), fixed when it is built (a mixin
    of the wrappers)."""

    relevance_key = FixedOption()
    target_key = FixedOption()
