"""Activations quantized in a forward pass: the gradient, and with it the relevance, stops there.

torch.ao's static quantization (``torch.ao.quantization.convert``, torchvision's models built with
``quantize=True``) puts a ``Quantize`` module (``torch.quantize_per_tensor``) where a ``QuantStub`` was. The
quantized tensor it returns carries no gradient, and the quantized convolutions and Linear layers after it have no
autograd formula. Where the model's output depends on the input through float layers besides (a quantized block
beside a float skip connection, a part left in float with ``qconfig = None``), the relevance reaches the input through
those alone, and the quantized part's share is lost: a sum off the explained output's, with no error. Where the output
depends on the input through quantized layers only, the wrapper finds no gradient at all and names the quantized
modules (:func:`quantized_modules`).

:func:`quantizing_call` tells such a call apart for the watch of the first call
(:class:`~tdhook.attribution._nonlinear_calls.NonlinearCalls`), and :func:`quantizing_message` words its warning.
Dynamically quantized Linear layers take and return float tensors, and have a rule
(:class:`~tdhook.attribution.rules.quantized.QuantizedLinearRule`): they quantize nothing the watch sees.

Examples:
    >>> import torch
    >>> h = torch.randn(3, requires_grad=True) * 1
    >>> quantized = torch.quantize_per_tensor(h, 0.1, 0, torch.quint8)
    >>> quantizing_call("quantize_per_tensor", (h, 0.1, 0, torch.quint8), quantized)
    'quantize_per_tensor (to a quantized tensor)'
    >>> quantizing_call("relu", (h,), h.relu()) is None
    True
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = ["CUT", "QUANTIZING", "quantized_modules", "quantizing_call", "quantizing_message"]

#: how a quantizing call is labelled among the calls of a module (see :mod:`~tdhook.attribution.coverage`)
QUANTIZING = " (to a quantized tensor)"

#: the node a quantizing call is noted with: the branch it starts reaches the explained output in value only, never
#: through the relevance pass, so the call is reported whatever the output depends on in that pass
CUT = object()

# The package of torch.ao's statically quantized modules (``Quantize``, the quantized Conv2d and Linear,
# ``QFunctional``); the dynamically quantized ones live in its ``dynamic`` package and compute on float tensors.
# (the fused ones, ``ConvReLU2d``, in the intrinsic package's).
_STATIC = ("torch.ao.nn.quantized.modules", "torch.ao.nn.intrinsic.quantized.modules")


def _tensors(values: Any) -> list[torch.Tensor]:
    """The tensors in ``values``, nested in tuples and lists (``torch.cat``'s) included."""
    return [leaf for leaf in tree_leaves(values) if isinstance(leaf, torch.Tensor)]


def quantizing_call(name: str, args: tuple, result: Any) -> str | None:
    """How to report the call named ``name`` that returned ``result``, where it quantizes an activation: a quantized
    tensor computed from a tensor among ``args`` that requires grad; ``None`` otherwise.

    Examples:
        >>> import torch
        >>> x = torch.randn(2)
        >>> quantizing_call("quantize_per_tensor", (x, 0.1, 0, torch.quint8), torch.quantize_per_tensor(x, 0.1, 0,
        ...     torch.quint8)) is None  # a constant quantized: no relevance is lost
        True
    """
    results = _tensors(result)
    if not any(r.is_quantized for r in results):
        return None
    if not any(t.requires_grad for t in _tensors(args)):
        return None
    return f"{name}{QUANTIZING}"


def quantizing_message(where: str, kind: str, functions: Iterable[str]) -> str:
    """The warning for a module (``where``, of class ``kind``) that quantizes activations by ``functions``.

    Examples:
        >>> quantizing_message("module 'quant'", " (Quantize)", ["quantize_per_tensor (to a quantized tensor)"])[:75]
        "LRP: module 'quant' (Quantize) quantizes an activation in its own forward ("
    """
    calls = ", ".join(f.removesuffix(QUANTIZING) for f in functions)
    return (
        f"LRP: {where}{kind} quantizes an activation in its own forward ({calls}): a quantized tensor carries no "
        "gradient, so no relevance passes back through it, and what it reads gets none of the relevance of the "
        "quantized layers after it (torch.ao's statically quantized convolutions and Linear layers have no rule; a "
        "dynamically quantized Linear has one); the relevance sums to less than the explained output. Explain the "
        "float model (torchvision's quantize=False, or the model before torch.ao.quantization.convert), or quantize "
        "its Linear layers only, dynamically (torch.ao.quantization.quantize_dynamic); lrp.coverage() lists every "
        "such call"
    )


def quantized_modules(model: nn.Module) -> list[str]:
    """The statically quantized modules of ``model``, as ``'name' (Class)``: what computes on quantized tensors,
    those that quantize their input (``Quantize``) first.

    Examples:
        >>> from torch.ao.nn.quantized import DeQuantize, Quantize
        >>> quantized_modules(nn.Sequential(DeQuantize(), nn.Linear(2, 2), Quantize(0.1, 0, torch.quint8)))
        ["'2' (Quantize)", "'0' (DeQuantize)"]
    """
    found = [(name, type(m)) for name, m in model.named_modules() if type(m).__module__.startswith(_STATIC)]
    found.sort(key=lambda item: item[1].__name__ != "Quantize")
    return [f"{name!r} ({kind.__name__})" for name, kind in found]
