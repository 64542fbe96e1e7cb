"""Quantized linear layers: the ε-rule on the dequantized weight.

A dynamically quantized ``Linear`` (``torch.ao.nn.quantized.dynamic.Linear``,
what ``torch.ao.quantization.quantize_dynamic`` puts in place of ``nn.Linear``)
takes and returns float tensors, but its packed int8 weight has no autograd
formula: the plain gradient stops there, and every relevance before it is zero.
:class:`QuantizedLinearRule` gives the layer the ε-rule's gradient with the
weight it really computes with, the dequantized one, and leaves its output, the
quantized computation's, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tdhook.attribution.rules._autograd import redirect
from tdhook.attribution.rules.base import _LAYER_MARK, RemovableRuleHandle, Rule, _call_arguments, rules_apply
from tdhook.attribution.tunables import EPSILON

__all__ = ["QuantizedLinearRule", "is_quantized_linear", "holds_packed_weights"]


def is_quantized_linear(module: nn.Module) -> bool:
    """Whether ``module`` is a dynamically quantized ``Linear`` (float input and output, int8 weight).

    Examples:
        >>> layer = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(4, 2)), {nn.Linear})[0]
        >>> is_quantized_linear(layer), is_quantized_linear(nn.Linear(4, 2))
        (True, False)
    """
    return isinstance(module, torch.ao.nn.quantized.dynamic.Linear)


def holds_packed_weights(module: nn.Module) -> bool:
    """Whether ``module`` only holds a quantized layer's packed weight (it never runs)."""
    return isinstance(module, torch.ao.nn.quantized.modules.linear.LinearPackedParams)


class QuantizedLinearRule(Rule):
    """LRP-ε on a dynamically quantized ``Linear``: ``R_i = x_i Σ_j w_ji R_j / stabilize(z_j, ε)`` with ``w`` the
    dequantized weight and ``z`` the layer's (quantized) output.

    Its relevance cannot keep its graph (``LRP(..., create_graph=True)`` refuses it): the layer's output is
    computed from activations quantized on the fly, a step function of the input with no derivative to keep.

    Args:
        epsilon: the stabilizer added to ``z`` with its sign.

    Examples:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> layer = torch.ao.quantization.quantize_dynamic(nn.Sequential(nn.Linear(4, 2, bias=False)), {nn.Linear})[0]
        >>> x = torch.randn(3, 4, requires_grad=True)
        >>> with QuantizedLinearRule(epsilon=1e-9).register(layer):
        ...     z = layer(x)
        ...     relevance = x * torch.autograd.grad(z[:, 0].sum(), x)[0]
        >>> torch.allclose(relevance, x.detach() * layer.weight().dequantize()[0])  # x_i w_0i, as LRP-0
        True
    """

    uses_input = True
    tunables = {"epsilon": EPSILON}

    def __init__(self, epsilon: float = 1e-6) -> None:
        super().__init__()
        self.epsilon = epsilon

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        if not is_quantized_linear(module):
            raise TypeError(
                f"QuantizedLinearRule expects a dynamically quantized Linear (torch.ao.nn.quantized.dynamic.Linear), "
                f"got {type(module).__name__}"
            )
        if module in self._registrations:
            raise ValueError(f"{self!r} is already registered on this {type(module).__name__}")
        registration = self._new_registration(module)

        def hook(mod: nn.Module, args: tuple, kwargs: dict, output: Any) -> torch.Tensor | None:
            inputs = _call_arguments(mod, args, kwargs)  # the input given by position or by keyword
            x = inputs[0] if inputs else None
            if not rules_apply(mod) or not isinstance(x, torch.Tensor) or not x.requires_grad:
                return None
            return self.apply(mod, x, output)

        with self._recorded(module, registration):
            registration.hooks.append(module.register_forward_hook(hook, with_kwargs=True))
        return RemovableRuleHandle(self, module)

    def apply(self, module: nn.Module, x: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        """``output = module(x)`` with the rule's gradient with respect to ``x``."""
        weight = module.weight().dequantize().to(x.dtype)
        z = output.detach()
        scale = z.abs() / (z.abs() + self.epsilon)  # z / stabilize(z, ε), exactly
        routed = redirect(output, [x], lambda grad: [(grad * scale).to(x.dtype) @ weight])
        if routed.grad_fn is not None:  # a layer's output: the layers it feeds are no first layers
            routed.grad_fn.metadata[_LAYER_MARK] = True
        return routed
