"""Half-precision layers under the modified rules: their quotients and transposed products in float32.

A modified rule divides the output relevance by a modified output (``R / stabilize(z⁺)``), scales it (``α``)
and applies a transposed weight. In float16, whose largest value is 65504, the quotient overflows for a
relevance of 0.03 over a modified output of 1e-6, and its infinities of both signs meet in the transposed
product as NaN; bfloat16 keeps 8 bits of mantissa, and its sums over a receptive field lose most of them. The
rules therefore compute these factors in float32 for float16 and bfloat16 layers, and round the result to the
layer's dtype once, at the end. float32 and float64 layers pay one dtype test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, MutableMapping
from typing import Any

import torch

from tdhook.attribution.rules._parameter_sets import ParameterSets

__all__ = [
    "HALF_PRECISIONS",
    "is_half_precision",
    "float32_params",
    "in_scaled_pass",
    "scaled_pass",
    "without_autocast",
]

#: The dtypes whose rules' factors are computed in float32.
HALF_PRECISIONS = frozenset({torch.float16, torch.bfloat16})

# The key under which a rule's prepared parameters keep their float32 copy (a per-context cache).
_FLOAT32 = "float32"
# Per-context caches of one sample's tensors, kept apart for each dtype (see _DirectInputRule._for_one_sample).
_NOT_COPIED = frozenset({_FLOAT32, "one_sample"})


# The scale of the float16 backward pass running now: 1 but in a pass whose target's relevance the wrapper scaled
# down (see tdhook.attribution._scaled_passes), whose relevance is divided back in float32.
_pass_scale = [1.0]


def in_scaled_pass() -> bool:
    """Whether a float16 backward pass at a scale below 1 runs now: relevance set directly (input-layer rules) is
    then recorded in float32, where the scaled relevance does not round to 0.

    Examples:
        >>> in_scaled_pass()
        False
    """
    return _pass_scale[0] != 1


@contextlib.contextmanager
def scaled_pass(scale: float) -> Iterator[None]:
    """A backward pass whose target's relevance is scaled by ``scale`` runs in the block.

    Examples:
        >>> with scaled_pass(0.5):
        ...     in_scaled_pass()
        True
    """
    _pass_scale[0] = scale
    try:
        yield
    finally:
        _pass_scale[0] = 1.0


def is_half_precision(x: torch.Tensor) -> bool:
    """Whether ``x`` is float16 or bfloat16, whose rules' factors are computed in float32.

    Examples:
        >>> is_half_precision(torch.ones(1, dtype=torch.bfloat16)), is_half_precision(torch.ones(1))
        (True, False)
    """
    return x.dtype in HALF_PRECISIONS


def without_autocast(x: torch.Tensor) -> torch.autocast:
    """Autocast switched off on ``x``'s device: the float32 work stays float32 in a call under autocast.

    Examples:
        >>> with torch.autocast("cpu", dtype=torch.bfloat16), without_autocast(torch.ones(1)):
        ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
        torch.float32
    """
    return torch.autocast(x.device.type, enabled=False)


def float32_params(params: MutableMapping[str, Any], keep: bool = True) -> MutableMapping[str, Any]:
    """A rule's prepared parameters (parameter sets by name, and flags) with their tensors in float32.

    With ``keep``, the copy is kept in ``params`` (which live as long as the context, or until the layer's
    parameters change) and made once; without it (a call that keeps the graph, whose parameters are functions
    of the live ones), it is made anew, differentiably.

    Examples:
        >>> params = {"pos": {"weight": torch.ones(2, dtype=torch.float16)}, "shift_is_nonnegative": True}
        >>> copy = float32_params(params)
        >>> copy["pos"]["weight"].dtype, copy["shift_is_nonnegative"], float32_params(params) is copy
        (torch.float32, True, True)
    """
    kept = params.get(_FLOAT32) if keep else None
    if kept is not None:
        return kept
    if isinstance(params, ParameterSets):  # each set copied at its first read, shared tensors once
        copy = params.converted(_float32, skip=_NOT_COPIED)
        if keep:
            params[_FLOAT32] = copy
        return copy
    copy = {
        key: {name: _float32(value) for name, value in entry.items()} if isinstance(entry, dict) else _float32(entry)
        for key, entry in params.items()
        if key not in _NOT_COPIED
    }
    if keep:
        params[_FLOAT32] = copy
    return copy


def _float32(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.float()
    return value
