"""A warning for rows of samples given as one sample to a method that perturbs groups of features.

Tensors given as keywords (``method(x=x)``, the ``dispatch`` convention) are one sample: the batch is ``[]``. A
captum user's ``x`` of shape ``[8, 4]`` then holds 8 rows that :class:`FeatureAblation`,
:class:`ShapleyValueSampling` and :class:`Occlusion` treat as one sample: a feature group (a column id of a mask
broadcast over the rows, or a window) spans every row, and its drop sums the rows' explained outputs. Each row's
attribution then holds the other rows' drops too (the gradient methods, whose rows do not mix, give the rows'
own). A call given tensors as keywords (:func:`keyword_call`) whose explained output has rows (a dimension before
its units) that its explained inputs share, or that its target gives one index each, is warned of once per wrapper.
A TensorDict of batch ``[]`` is one sample by the caller's choice, and is not warned of.

Examples:
    >>> import torch
    >>> rows_in_one_sample([torch.zeros(8, 4)], torch.zeros(8, 3), 0, 0)
    8
    >>> rows_in_one_sample([torch.zeros(4, 84, 84)], torch.zeros(4), 0, 0) is None  # one sample's 4 action values
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import Any

import torch
from tensordict import TensorDictBase

__all__ = ["called_with_keywords", "keyword_call", "rows_in_one_sample", "rows_message"]

_KEYWORDS: ContextVar[bool] = ContextVar("tdhook_keyword_call", default=False)


@contextlib.contextmanager
def keyword_call(args: tuple, kwargs: Mapping[str, Any]) -> Iterator[None]:
    """Mark the call inside, of arguments ``args`` and ``kwargs``, as given tensors as keywords (no TensorDict),
    and the calls it makes again (a narrowed copy's) as part of it."""
    given = not args and bool(kwargs) and not any(isinstance(value, TensorDictBase) for value in kwargs.values())
    token = _KEYWORDS.set(_KEYWORDS.get() or given)
    try:
        yield
    finally:
        _KEYWORDS.reset(token)


def called_with_keywords() -> bool:
    """Whether the call running now was given tensors as keywords (see :func:`keyword_call`)."""
    return _KEYWORDS.get()


def rows_in_one_sample(
    inputs: Sequence[torch.Tensor], output: torch.Tensor, target: Any, batch_dims: int
) -> int | None:
    """The number of leading rows a call of batch ``[]`` seems to hold as samples, or ``None``: the explained
    output has a dimension before its units whose size, more than one, every explained input shares as its first,
    or the target is a tensor of indices with one per such row."""
    if batch_dims or output.dim() < 2:  # a vector output is one sample's units
        return None
    rows = output.shape[0]
    if isinstance(target, torch.Tensor) and target.dim() >= 1 and target.shape[0] == rows > 1:
        return rows
    if rows > 1 and inputs and all(x.dim() >= 2 and x.shape[0] == rows for x in inputs):
        return rows
    return None


def rows_message(name: str, rows: int, target_key: Any) -> str:
    """The warning for ``rows`` rows explained as one sample by method ``name``."""
    return (
        f"{name}: the call was given tensors as keywords, which are one sample, but its inputs and its output "
        f"{target_key!r} have {rows} leading rows: the method treats them as one sample, so each feature group "
        "(or window) spans every row and its drop sums the rows' outputs, and each row's attribution holds the other "
        f"rows' drops. To explain {rows} samples, call it on a TensorDict with batch_size=[{rows}]; to explain one "
        "sample, this is its attribution"
    )
