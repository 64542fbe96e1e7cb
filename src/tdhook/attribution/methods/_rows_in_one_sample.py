"""A warning for rows of samples given as one sample to a method that perturbs groups of features.

Tensors given as keywords (``method(x=x)``, the ``dispatch`` convention) are one sample: the batch is ``[]``. A
captum user's ``x`` of shape ``[8, 4]`` then holds 8 rows that :class:`FeatureAblation`,
:class:`ShapleyValueSampling` and :class:`Occlusion` treat as one sample: a feature group (a column id of a mask
broadcast over the rows, or a window) spans every row, and its drop sums the rows' explained outputs. Each row's
attribution then holds the other rows' drops too (the gradient methods, whose rows do not mix, give the rows'
own). A call whose batch is ``[]`` while its explained inputs and its explained output share a leading dimension,
or whose target holds one index per leading row, is warned of once per wrapper.

Examples:
    >>> import torch
    >>> rows_in_one_sample([torch.zeros(8, 4)], torch.zeros(8, 3), 0, 0)
    8
    >>> rows_in_one_sample([torch.zeros(3, 16, 16)], torch.zeros(10), 0, 0) is None
    True
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["rows_in_one_sample", "rows_message"]


def rows_in_one_sample(
    inputs: Sequence[torch.Tensor], output: torch.Tensor, target: Any, batch_dims: int
) -> int | None:
    """The number of leading rows a call of batch ``[]`` seems to hold as samples, or ``None``: every explained
    input and the explained output share a leading dimension of more than one row, or the target is a tensor of
    indices with one per such row."""
    if batch_dims or output.dim() == 0:
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
        f"{name}: the call's batch is [] (tensors given as keywords are one sample), but its inputs and its output "
        f"{target_key!r} have {rows} leading rows: the method treats them as one sample, so each feature group "
        "(or window) spans every row and its drop sums the rows' outputs, and each row's attribution holds the other "
        f"rows' drops. To explain {rows} samples, call it on a TensorDict with batch_size=[{rows}]; to explain one "
        "sample, this is its attribution"
    )
