"""Per-key options of the attribution methods: one value for every explained key, or a dict keyed by key.

Examples:
    >>> import torch
    >>> per_key({"obs": 1.0, "goal": 2.0}, ["obs", "goal"], "baselines", "IntegratedGradients")
    [1.0, 2.0]
    >>> per_key(0.0, ["obs", "goal"], "baselines", "IntegratedGradients")
    [0.0, 0.0]
    >>> x = torch.ones(4, 3)
    >>> baseline_tensors(torch.tensor([1.0, 2.0, 3.0]), ["x"], [x], 1, "IntegratedGradients")[0].shape
    torch.Size([4, 3])
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Number
from typing import Any, Union

import torch
from tensordict import TensorDictBase
from tensordict.utils import NestedKey, unravel_key

from tdhook.attribution.rules._caller import warn_at_caller

__all__ = [
    "MISSING",
    "Baselines",
    "baseline_tensors",
    "checked_batch_size",
    "checked_flag",
    "entries",
    "per_key",
    "seeded_generator",
    "steps_per_pass",
]

Baselines = Union[float, torch.Tensor, Mapping[NestedKey, Union[float, torch.Tensor]]]


class _Missing:
    """The entry of a key that a dict of options leaves out (see :func:`per_key`)."""

    def __repr__(self) -> str:
        return "MISSING"


MISSING = _Missing()


def entries(value: Mapping) -> dict:
    """The entries of options given per input key: a dict's items, or a TensorDict's leaves under their nested keys.

    Examples:
        >>> from tensordict import TensorDict
        >>> list(entries(TensorDict({"obs": {"goal": torch.zeros(2)}, "x": torch.ones(3)})))
        [('obs', 'goal'), 'x']
    """
    if isinstance(value, TensorDictBase):
        return dict(value.items(include_nested=True, leaves_only=True))
    return dict(value.items())


def per_key(value: Any, keys: Sequence[NestedKey], name: str, owner: str, partial: bool = False) -> list:
    """``value`` for each of ``keys``: the dict's entry, or the one value for all.

    Args:
        value: one value, or a dict (or a TensorDict) keyed by input key (every explained key, and only those).
        keys: the explained input keys.
        name: the option's name, for error messages.
        owner: the method's name, for error messages.
        partial: whether the dict may leave keys out (default keys, of which a call may explain fewer): their
            entries are :data:`MISSING`.

    Returns:
        One value per key, in the order of ``keys``.

    Raises:
        KeyError: the dict misses an explained key or names a key that is not explained.

    Examples:
        >>> per_key({"obs": 1.0}, ["obs", "mask"], "baselines", "IntegratedGradients", partial=True)
        [1.0, MISSING]
    """
    if not isinstance(value, Mapping):
        return [value] * len(keys)
    given = {unravel_key(k): v for k, v in entries(value).items()}
    missing = [] if partial else [k for k in keys if k not in given]
    extra = [k for k in given if k not in keys]
    if missing or extra:
        raise KeyError(
            f"{owner}: {name} must have one entry per explained input key {list(keys)}; "
            f"missing {missing}, not explained {extra}"
        )
    return [given.get(k, MISSING) for k in keys]


def baseline_tensors(
    baselines: Baselines, keys: Sequence[NestedKey], inputs: Sequence[torch.Tensor], batch_dims: int, owner: str
) -> list[torch.Tensor]:
    """The baseline of each explained input, broadcast to the input's shape.

    Args:
        baselines: a number, a tensor with one sample's shape (or the whole
            input's, or any shape that broadcasts to it), or a dict keyed by input key.
        keys: the explained input keys.
        inputs: the inputs, one per key.
        batch_dims: the number of batch dimensions.
        owner: the method's name, for error messages.

    Returns:
        One tensor per key, of the input's shape, dtype and device (possibly an expanded view).

    Raises:
        TypeError: a baseline is neither a real number nor a floating-point tensor.
        ValueError: a baseline's shape does not broadcast to its input's.
    """
    out = []
    for key, x, value in zip(keys, inputs, per_key(baselines, keys, "baselines", owner), strict=True):
        if isinstance(value, Number) and not isinstance(value, (bool, complex)):
            value = torch.tensor(float(value), dtype=x.dtype, device=x.device)
        elif not isinstance(value, torch.Tensor) or not value.is_floating_point():
            raise TypeError(
                f"{owner}: the baseline of input key {key!r} must be a number or a floating-point tensor, "
                f"got {getattr(value, 'dtype', type(value).__name__)}"
            )
        try:
            shape = torch.broadcast_shapes(value.shape, x.shape)
        except RuntimeError:
            shape = None
        if shape != x.shape:
            raise ValueError(
                f"{owner}: the baseline of input key {key!r} has shape {list(value.shape)}, which does not broadcast "
                f"to the input's {list(x.shape)}; expected one sample's shape {list(x.shape[batch_dims:])} "
                "(or the input's)"
            )
        out.append(value.to(dtype=x.dtype, device=x.device).expand(x.shape))
    return out


def seeded_generator(seed: int | None) -> torch.Generator:
    """A CPU generator of its own, so that a method's draws never touch the global random state.

    Args:
        seed: the seed; ``None`` for a nondeterministic one.

    Returns:
        The generator.

    Examples:
        >>> a = torch.randn(3, generator=seeded_generator(0))
        >>> torch.equal(a, torch.randn(3, generator=seeded_generator(0)))
        True
    """
    generator = torch.Generator()
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator


def draws_shape(shape: Sequence[int], n_samples: int, batch_dims: int, seed: int | None) -> tuple[int, ...]:
    """The shape of ``n_samples`` random draws for each element of a tensor of ``shape`` (the batch's, then a
    sample's): with a seed, one set shared by every
    sample of the batch (size 1 along its ``batch_dims`` dimensions, broadcast), so that a sample's draws do not
    depend on the batch it comes in; without one (fresh draws every call), one set per sample.

    Examples:
        >>> draws_shape((4, 2, 3), 5, 2, seed=0), draws_shape((4, 2, 3), 5, 2, seed=None)
        ((5, 1, 1, 3), (5, 4, 2, 3))
    """
    if seed is None:
        return (n_samples, *shape)
    return (n_samples, *[1] * batch_dims, *shape[batch_dims:])


def steps_per_pass(n_steps: int, rows_per_step: int, internal_batch_size: int | None, owner: str = "") -> int:
    """How many perturbed copies (points of a path, noisy samples) one forward pass evaluates.

    A pass holds at least one copy of every sample: where ``internal_batch_size`` is less than the batch's samples,
    each pass runs ``rows_per_step`` rows, and a warning (from ``owner``) says so, as captum's does.

    Args:
        n_steps: the number of copies.
        rows_per_step: the rows one copy adds to a forward pass (the batch's number of samples).
        internal_batch_size: the most rows per forward pass, or ``None`` for all the copies at once.
        owner: the method, named in the warning.

    Returns:
        At least 1, at most ``n_steps``.

    Examples:
        >>> steps_per_pass(50, 8, None), steps_per_pass(50, 8, 100), steps_per_pass(50, 8, 8)
        (50, 12, 1)
    """
    if internal_batch_size is None:
        return n_steps
    if internal_batch_size < rows_per_step:
        warn_at_caller(
            f"{owner}: internal_batch_size={internal_batch_size} is less than the {rows_per_step} samples of the "
            f"batch: each forward pass runs one copy (a point of the path, a noisy sample) for every sample, "
            f"{rows_per_step} rows; split the batch to run fewer"
        )
    return max(1, min(n_steps, internal_batch_size // max(1, rows_per_step)))


def checked_batch_size(internal_batch_size: int | None, owner: str) -> int | None:
    """``internal_batch_size`` if it is ``None`` or a positive int.

    Raises:
        ValueError: it is neither.

    Examples:
        >>> checked_batch_size(None, "SmoothGrad"), checked_batch_size(16, "SmoothGrad")
        (None, 16)
    """
    if internal_batch_size is not None and (
        isinstance(internal_batch_size, bool) or not isinstance(internal_batch_size, int) or internal_batch_size < 1
    ):
        raise ValueError(f"{owner}: internal_batch_size must be a positive int or None, got {internal_batch_size!r}")
    return internal_batch_size


def checked_flag(value: object, name: str, owner: str) -> bool:
    """``value`` if it is a bool: a switch that changes the result takes ``True`` or ``False`` only (the string
    ``"False"`` or the number 0.5 would otherwise be read by their truth, silently).

    Raises:
        TypeError: ``value`` is not a bool.

    Examples:
        >>> checked_flag(False, "abs", "Saliency")
        False
        >>> checked_flag("False", "abs", "Saliency")
        Traceback (most recent call last):
        ...
        TypeError: Saliency: abs must be True or False, got 'False'
    """
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: {name} must be True or False, got {value!r}")
    return value
