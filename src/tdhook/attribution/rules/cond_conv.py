"""Conditionally parameterised convolutions (CondConv, Yang et al. 2019; timm's ``CondConv2d``): the routing weights
held constant, and the convolution rule applied with each sample's kernel.

A CondConv layer holds ``E`` expert kernels ``W_e`` and is called as ``layer(x, r)`` with routing weights ``r`` of
shape ``[B, E]`` that the block around it computes from the same input (``sigmoid(fc(mean(x)))``). Sample ``b`` is
convolved with its own kernel ``K_b = Σ_e r_be W_e`` (and bias ``Σ_e r_be b_e``): timm runs one convolution of the
batch laid out along the channels, grouped by sample. The output is a product of two activations, ``r`` and ``x``.

:class:`CondConvRule` holds ``r`` constant, as the presets hold a squeeze-excite gate (signal-take-all): the layer
is then a convolution of ``x`` by the fixed kernels ``K_b``, and it gets the rule a ``Conv2d`` gets (ε, z⁺, αβ, γ,
or LRP-0), on :func:`per_sample_convolution`, a plain ``Conv2d`` holding those kernels. No relevance flows into the
routing branch, and relevance is conserved through the layer as through a convolution.

The layer is recognised by what it holds (:func:`is_cond_conv`), as tdhook recognises timm's other layers by their
class name: timm is not a dependency.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tdhook.attribution.rules._autograd import hold
from tdhook.attribution.rules.base import RemovableRuleHandle, Rule, rules_apply
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule
from tdhook.attribution.rules.modified import AlphaBetaRule, GammaRule
from tdhook.attribution.rules.records import Registration

__all__ = ["CondConvRule", "is_cond_conv", "per_sample_convolution"]

# What a CondConv layer holds besides its expert kernels (``weight``, one row per expert) and biases (``bias``).
_COND_CONV_ATTRIBUTES = (
    "num_experts",
    "weight_shape",
    "in_channels",
    "out_channels",
    "kernel_size",
    "stride",
    "padding",
    "dilation",
    "groups",
    "dynamic_padding",
)
# The rules a convolution of fixed kernels can take here: each changes the gradient at the layer's output, or runs
# the layer with modified kernels, and records no relevance of its own (the input-layer rules do, at their input).
_KERNEL_RULES = (IgnoreRule, EpsilonRule, AlphaBetaRule, GammaRule)


def is_cond_conv(module: nn.Module) -> bool:
    """Whether ``module`` is a CondConv layer (timm's ``CondConv2d``, by its class name): a 2-D convolution whose
    ``weight`` holds one flattened kernel per expert, called with routing weights.

    Examples:
        >>> class CondConv2d(nn.Module):  # what timm's holds
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.in_channels, self.out_channels, self.num_experts, self.groups = 2, 3, 4, 1
        ...         self.kernel_size, self.stride, self.padding, self.dilation = (3, 3), (1, 1), (1, 1), (1, 1)
        ...         self.weight_shape, self.dynamic_padding = (3, 2, 3, 3), False
        ...         self.weight, self.bias = nn.Parameter(torch.randn(4, 54)), None
        >>> is_cond_conv(CondConv2d()), is_cond_conv(nn.Conv2d(2, 3, 3))
        (True, False)
    """
    if type(module).__name__ != "CondConv2d" or not all(hasattr(module, name) for name in _COND_CONV_ATTRIBUTES):
        return False
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and tuple(weight.shape) == (module.num_experts, math.prod(module.weight_shape))
    )


def per_sample_convolution(module: nn.Module, x: torch.Tensor, routing: torch.Tensor) -> tuple[nn.Conv2d, torch.Tensor]:
    """The plain ``Conv2d`` that computes the CondConv layer ``module`` on ``x`` with the routing weights ``routing``
    held constant, and its input: the batch laid out along the channels (``[1, B·C, H, W]``, padded where the layer
    pads to keep the size, as TensorFlow's "same"), convolved in ``B·groups`` groups with each sample's kernel
    ``K_b = Σ_e r_be W_e``. Its output is the layer's, laid out as ``[1, B·C_out, H', W']``.

    Examples:
        >>> experts = torch.randn(2, 3 * 2 * 1 * 1)  # two experts of 1×1 kernels, 2 → 3 channels
        >>> class CondConv2d(nn.Module):
        ...     in_channels, out_channels, num_experts, groups, dynamic_padding = 2, 3, 2, 1, False
        ...     kernel_size, stride, padding, dilation, weight_shape = (1, 1), (1, 1), (0, 0), (1, 1), (3, 2, 1, 1)
        ...     weight, bias = experts, None
        >>> x, routing = torch.randn(4, 2, 5, 5), torch.rand(4, 2)
        >>> layer, grouped = per_sample_convolution(CondConv2d(), x, routing)
        >>> layer.groups, tuple(grouped.shape)
        (4, (1, 8, 5, 5))
        >>> kernel = (routing[1] @ experts).view(3, 2, 1, 1)  # the second sample's
        >>> torch.allclose(layer(grouped).view(4, 3, 5, 5)[1], F.conv2d(x[1:2], kernel)[0], atol=1e-6)
        True
    """
    batch, channels, height, width = x.shape
    with torch.no_grad():
        routing = routing.detach().to(module.weight.dtype)
        kernel = torch.matmul(routing, module.weight.detach()).view(-1, *module.weight_shape[1:])
        bias = None if module.bias is None else torch.matmul(routing, module.bias.detach()).view(-1)
    grouped = x.reshape(1, batch * channels, height, width)
    padding = module.padding
    if module.dynamic_padding:
        grouped, padding = F.pad(grouped, _same_padding(module, height, width)), 0
    layer = nn.Conv2d(
        batch * channels,
        kernel.shape[0],
        module.kernel_size,
        module.stride,
        padding,
        module.dilation,
        groups=module.groups * batch,
        bias=bias is not None,
        device="meta",
    )
    layer.weight = nn.Parameter(kernel, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer, grouped


def _same_padding(module: nn.Module, height: int, width: int) -> tuple[int, int, int, int]:
    """``F.pad``'s ``(left, right, top, bottom)`` that keeps ``ceil(size / stride)`` outputs (TensorFlow's "same"):
    ``(ceil(n / s) - 1) s + (k - 1) d + 1 - n`` in all along each side, the odd one on the right and bottom."""
    total = [
        max((math.ceil(n / s) - 1) * s + (k - 1) * d + 1 - n, 0)
        for n, k, s, d in zip((height, width), module.kernel_size, module.stride, module.dilation, strict=True)
    ]
    (rows, columns) = total
    return columns // 2, columns - columns // 2, rows // 2, rows - rows // 2


class CondConvRule(Rule):
    """A CondConv layer (timm's ``CondConv2d``): its routing weights held constant, and ``rule`` applied to the
    convolution of each sample by its own kernel ``K_b = Σ_e r_be W_e`` (see
    :mod:`~tdhook.attribution.rules.cond_conv`).

    With ``rule`` the ε-rule, ``R_i = x_i Σ_j (∂z_j/∂x_i) R_j / stabilize(z_j, ε)`` with ``∂z/∂x`` the kernels
    ``K_b``; with z⁺, αβ or γ, the kernels' positive and negative parts. The presets give it the rule they give a
    ``Conv2d``; the transformer presets (LRP-0 on convolutions) hold the routing weights as they hold gates.

    Args:
        rule: the convolution's rule: :class:`~tdhook.attribution.rules.basic.IgnoreRule` (LRP-0, the default),
            :class:`~tdhook.attribution.rules.basic.EpsilonRule`, :class:`~tdhook.attribution.rules.AlphaBetaRule`
            or :class:`~tdhook.attribution.rules.GammaRule`.

    Raises:
        TypeError: another rule (an input-layer rule records its relevance at the layer's input, which is not
            the model's here), or a module that is no CondConv layer.

    Examples:
        >>> class CondConv2d(nn.Module):  # what timm's computes, for 1×1 kernels
        ...     in_channels, out_channels, num_experts, groups, dynamic_padding = 2, 3, 2, 1, False
        ...     kernel_size, stride, padding, dilation, weight_shape = (1, 1), (1, 1), (0, 0), (1, 1), (3, 2, 1, 1)
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.weight, self.bias = nn.Parameter(torch.randn(2, 6)), None
        ...     def forward(self, x, routing_weights):
        ...         kernel = (routing_weights @ self.weight).view(-1, 2, 1, 1)
        ...         out = F.conv2d(x.reshape(1, -1, *x.shape[2:]), kernel, groups=x.shape[0])
        ...         return out.view(x.shape[0], 3, *x.shape[2:])
        >>> layer, x = CondConv2d(), torch.randn(4, 2, 5, 5, requires_grad=True)
        >>> routing = torch.sigmoid(x.mean((2, 3)))  # from the input, as the block around the layer computes it
        >>> with CondConvRule(EpsilonRule(epsilon=1e-9)).register(layer):
        ...     z = layer(x, routing)
        ...     relevance = x * torch.autograd.grad(z, x, torch.ones_like(z))[0]  # the output's relevance: z
        >>> torch.allclose(relevance.sum((1, 2, 3)), z.sum((1, 2, 3)))  # conserved: none reaches the routing
        True
    """

    uses_input = False
    # The per-sample kernels are rebuilt in each call from the held routing weights, outside the autograd graph.
    differentiable = False

    def __init__(self, rule: Rule | None = None) -> None:
        rule = IgnoreRule() if rule is None else rule
        if not isinstance(rule, _KERNEL_RULES):
            raise TypeError(
                f"CondConvRule applies a convolution rule ({', '.join(kind.__name__ for kind in _KERNEL_RULES)}) "
                f"with each sample's kernel, got {rule!r}"
            )
        super().__init__()
        self.rule = rule

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        if not is_cond_conv(module):
            raise TypeError(f"CondConvRule expects a CondConv layer (timm's CondConv2d), got {type(module).__name__}")
        if module in self._registrations:
            raise ValueError(f"{self!r} is already registered on this {type(module).__name__}")
        registration = self._new_registration(module)
        with self._recorded(module, registration):
            registration.hooks.append(module.register_forward_pre_hook(_hold_routing, with_kwargs=True))
            hook = self._forward_hook(registration)
            registration.hooks.append(module.register_forward_hook(hook, prepend=True, with_kwargs=True))
        return RemovableRuleHandle(self, module)

    def rewrite(self, module, registration, inputs, output):
        x, routing = inputs[0], inputs[1]
        if isinstance(self.rule, IgnoreRule) or not x.requires_grad:
            return None  # LRP-0: the layer's own gradient, its routing weights held
        layer, grouped = per_sample_convolution(module, x, routing)
        inner = Registration(self.rule.prepare(layer), marks=False)
        routed = self.rule.rewrite(layer, inner, (grouped,), output.reshape(1, -1, *output.shape[2:]))
        return None if routed is None else routed.view(output.shape)


def _hold_routing(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """The layer's call with its routing weights (its second argument, or ``routing_weights``) held constant."""
    if not rules_apply(module):
        return None
    if len(args) > 1 and isinstance(args[1], torch.Tensor):
        return (args[0], hold(args[1]), *args[2:]), kwargs
    routing: Any = kwargs.get("routing_weights")
    if isinstance(routing, torch.Tensor):
        return args, {**kwargs, "routing_weights": hold(routing)}
    return None
