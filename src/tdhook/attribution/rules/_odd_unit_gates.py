"""One plus a tanh or an erf: a sigmoid-like gate, held in a product as a sigmoid is.

A GELU written out multiplies its input by a cumulative distribution: ``x * 0.5 * (1 + erf(x / √2))`` (ESM's),
``0.5 * x * (1 + tanh(√(2/π) · (x + 0.044715 x³)))`` (BLOOM's, minGPT's, ``gelu_new`` called as a function). Its factor
``(1 + erf(z)) / 2`` or ``(1 + tanh(z)) / 2`` is a value in ``[0, 1]``: ``1 + tanh(z) = 2 σ(2z)`` and
``1 + erf(z) = 2 Φ(√2 z)``, a sigmoid scaled. AttnLRP and CP-LRP hold a sigmoid-like gate in a product, so the input
keeps all of the product's relevance: the identity rule they give ``F.gelu`` itself, to the last bits of the two
formulas. So the output of ``tanh`` or ``erf`` of an activation is marked an odd unit (odd, increasing, in
``[-1, 1]``), and ``1 + t``, ``t + 1`` or ``1 - t`` of one is a sigmoid-like gate (``1 - tanh(z) = 2 σ(-2z)``).

A tanh or an erf written into in place after (``t.add_(0.5)``, ``t.mul_(3)``) is none: its values are another's.

It was none: the product took the rule of two activations, and the number 1 a share of the relevance, as a bias does
(a tiny ESM kept 0.20-0.61 of the logit under either preset, with a warning naming the module). Any other number stays
an offset (``(1.5 + tanh(z)) * h`` is named, as ``(up + 1) * glu`` is), and so does one plus a sigmoid, which is no
distribution.

Examples:
    >>> import torch
    >>> x = torch.randn(3, requires_grad=True) * 1
    >>> t = mark_odd_unit(torch.tanh(x))
    >>> odd_unit_offset(torch.Tensor.__radd__, (t, 1.0), {}) is t, odd_unit_offset(torch.Tensor.__add__, (t, 2.0), {})
    (True, None)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["ERFS", "ODD_UNITS", "ODD_UNIT_OFFSETS", "mark_odd_unit", "odd_unit_offset"]

#: The error function, an activation's (``torch.erf``, ``torch.special.erf``): the pass rule, as for tanh.
ERFS = frozenset({torch.erf, torch.Tensor.erf, torch.special.erf})
#: Odd, increasing functions onto ``[-1, 1]`` whose output plus one is a scaled sigmoid.
ODD_UNITS = frozenset({torch.tanh, torch.Tensor.tanh, F.tanh}) | ERFS
#: ``t + 1``, ``1 + t`` and ``1 - t`` (``torch.add(t, 1)``, ``t.add(1)``, ``torch.rsub(t, 1)`` too).
# (Not through ``torch.ops.aten``: the rules see no ATen call, and name it.)
ODD_UNIT_OFFSETS = frozenset({torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__})
ODD_UNIT_OFFSETS |= {torch.Tensor.__rsub__, torch.rsub}
_ODD_UNIT_MARK = "_tdhook_odd_unit"


def mark_odd_unit(tensor: Any) -> Any:
    """Mark ``tensor`` (a tanh's or an erf's output) as an odd unit, as its values are now (an in-place write after,
    ``t.add_(0.5)``, makes it another value: no odd unit), and return it.

    >>> t = mark_odd_unit(torch.tanh(torch.randn(2, requires_grad=True) * 1))
    >>> _is_odd_unit(t), _is_odd_unit(t.add_(0.5))
    (True, False)
    """
    if isinstance(tensor, torch.Tensor):
        setattr(tensor, _ODD_UNIT_MARK, tensor._version)
    return tensor


def _is_odd_unit(value: Any) -> bool:
    version = getattr(value, _ODD_UNIT_MARK, None)
    return version is not None and version == value._version


def odd_unit_offset(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The odd unit ``t`` where ``func(*args, **kwargs)`` (one of :data:`ODD_UNIT_OFFSETS`) computes ``1 + t``,
    ``t + 1`` or ``1 - t``, else ``None``.

    >>> t = mark_odd_unit(torch.erf(torch.randn(2, requires_grad=True) * 1))
    >>> [odd_unit_offset(f, a, {}) is t for f, a in [(torch.rsub, (t, 1)), (torch.add, (t, 1)), (torch.add, (t, -1))]]
    [True, True, False]
    """
    if not args or kwargs.get("alpha", 1) != 1:  # (``torch.add(t, 1, alpha=2)`` is t + 2)
        return None
    odd, number = args[0], args[1] if len(args) > 1 else kwargs.get("other")
    if isinstance(number, bool) or not isinstance(number, (int, float)) or number != 1:
        return None
    return odd if _is_odd_unit(odd) else None
