"""CP-LRP on timm models against an oracle that shares no code with the rules: the gradient × input of the same model
with the quantities CP-LRP holds detached.

A ``TorchFunctionMode`` runs a plain forward pass in which softmax weights and sigmoid-like gates are detached, a
layer, group or RMS norm's scale and a statistic (a variance, a norm, an ``rsqrt``) are detached, an element-wise
activation keeps its value with its ratio ``f(x) / x`` detached, an activation's output that multiplies another
tensor computed from the input is detached (the gate CP-LRP holds), and any other product of two such tensors passes
half of its gradient to each factor (the uniform rule). A fused attention is written out with its weights detached.
Tensors computed from parameters alone are constants, never factors. Conservation alone would not see relevance
moved between pixels or channels; this equality does.

The models, small and in float64 with random weights (BatchNorm calibrated as the gallery does): timm's Gemma 4 ViT
(gated MLPs whose projections are clipped at ±inf, RMS norms, a fused attention with a rotary embedding), ConViT
(attention weights mixed with positional ones by a learned sigmoid, then renormalised in place), a ViT with SwiGLU
MLPs, CoaT-Lite (factorised attention: a softmax over the keys, a query times the keys' summary, convolutional
relative positions); under ``-m gallery`` also EfficientNet with group norms (squeeze-excite gates, SiLU), ECA-NFNet
(weight-standardised convolutions, ECA gates, SiLU in place) and MobileNet v4's hybrid (multi-query attention, layer
scales). Before the clips' fixes, Gemma 4's ViT was 0.39 off (its gated MLP's GELU not held, the clipped projection
taken for a second gate) and then 6.7e-5 (its clips at ±inf under the pass rule's stabiliser); 1.1e-8 now.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tdhook.attribution import CPLRP
from tests.attribution.test_lrp_detection import explain
from tests.attribution.test_lrp_gallery import Case, build
from tests.conftest import relative_error

timm = pytest.importorskip("timm")

from timm.layers import SwiGLU  # noqa: E402

F64 = torch.float64
TOLERANCE = 1e-6

SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax}
GATES = {torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid, F.hardsigmoid}
STATISTICS = {torch.var, torch.Tensor.var, torch.std, torch.Tensor.std, torch.norm, torch.Tensor.norm}
STATISTICS |= {torch.linalg.vector_norm, torch.rsqrt, torch.Tensor.rsqrt}
RATIOS = {F.gelu, F.silu, F.elu, F.hardswish, F.mish, F.relu6, F.hardtanh, F.softplus, torch.tanh, torch.Tensor.tanh}
PRODUCTS = {torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.mul, torch.Tensor.mul}
MATRIX_PRODUCTS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
# Calls that rearrange or resize a gate keep it one.
REARRANGING = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape, torch.Tensor.expand, torch.Tensor.expand_as}
REARRANGING |= {torch.Tensor.permute, torch.Tensor.transpose, torch.transpose, torch.Tensor.flatten, torch.flatten}
REARRANGING |= {torch.Tensor.unsqueeze, torch.Tensor.squeeze, torch.Tensor.contiguous, F.interpolate}
ACTIVATION_MODULES = (nn.GELU, nn.SiLU, nn.Hardswish, nn.Mish, nn.ReLU6, nn.ELU, nn.Tanh, nn.Softplus)
GATE_MODULES = (nn.Sigmoid, nn.Hardsigmoid)

# What a tensor is to the oracle: an activation's output (a gate where it multiplies another tensor computed from the
# input), a sigmoid-like gate or a softmax's weights (held first), or computed from parameters alone.
ACTIVATION, GATE, CONSTANT = "_oracle_activation", "_oracle_gate", "_oracle_constant"


def kind(tensor: object) -> int:
    """2 for a gate or weights, 1 for an activation's output, 0 else."""
    if not isinstance(tensor, torch.Tensor):
        return 0
    return 2 if getattr(tensor, GATE, False) else int(getattr(tensor, ACTIVATION, False))


def marked(tensor: torch.Tensor, name: str) -> torch.Tensor:
    setattr(tensor, name, True)
    return tensor


def from_input(tensor: object) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.grad_fn is not None and not getattr(tensor, CONSTANT, False)


def constant(values: list) -> bool:
    """Whether a call of these arguments computes from parameters and constants alone (no input leaf among them)."""
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    leaf = [t.grad_fn is None and t.requires_grad and not isinstance(t, nn.Parameter) for t in tensors]
    return bool(tensors) and not any(from_input(t) or is_leaf for t, is_leaf in zip(tensors, leaf, strict=True))


def held_ratio(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y = f(x)`` as ``x`` times its ratio, the ratio detached (0 where ``x`` is)."""
    ratio = torch.where(x == 0, torch.zeros_like(y), y / torch.where(x == 0, torch.ones_like(x), x))
    return marked(x * ratio.detach(), ACTIVATION)


def held_norm(x: torch.Tensor, dims: tuple, eps: float, centred: bool) -> torch.Tensor:
    """``x`` (centred) divided by its detached root mean square over ``dims``."""
    x = x - x.mean(dims, keepdim=True) if centred else x
    return x / torch.sqrt(x.pow(2).mean(dims, keepdim=True) + eps).detach()


def affine(y: torch.Tensor, weight: object, bias: object, shape: tuple = (-1,)) -> torch.Tensor:
    y = y if weight is None else y * weight.view(shape)
    return y if bias is None else y + bias.view(shape)


def argument(args: tuple, kwargs: dict, position: int, name: str, default: object = None) -> object:
    return args[position] if len(args) > position else kwargs.get(name, default)


class Detached(TorchFunctionMode):
    """A plain forward pass with the quantities CP-LRP holds detached (see the module's docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = self.call(func, args, kwargs)
        if isinstance(out, torch.Tensor) and constant([*args, *kwargs.values()]):
            marked(out, CONSTANT)
        if func in REARRANGING and isinstance(out, torch.Tensor) and kind(args[0]):
            marked(out, GATE if kind(args[0]) == 2 else ACTIVATION)
        return out

    def call(self, func, args: tuple, kwargs: dict):
        if func in SOFTMAX:
            return marked(func(*args, **kwargs).detach(), GATE)
        if func in GATES:
            return marked(func(*args, **kwargs), GATE)
        if func in STATISTICS:
            return func(*args, **kwargs).detach()
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            scores = q @ k.transpose(-2, -1) * (kwargs.get("scale") or q.shape[-1] ** -0.5)
            mask = argument(args, kwargs, 3, "attn_mask")
            if mask is not None:
                scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
            return torch.softmax(scores, -1).detach() @ v
        if func is F.layer_norm:
            x, shape = args[0], argument(args, kwargs, 1, "normalized_shape")
            eps = argument(args, kwargs, 4, "eps", 1e-5)
            y = held_norm(x, tuple(range(-len(shape), 0)), eps, centred=True)
            return affine(y, argument(args, kwargs, 2, "weight"), argument(args, kwargs, 3, "bias"), tuple(shape))
        if func is F.rms_norm:
            x, shape = args[0], argument(args, kwargs, 1, "normalized_shape")
            eps = argument(args, kwargs, 3, "eps") or torch.finfo(x.dtype).eps
            y = held_norm(x, tuple(range(-len(shape), 0)), eps, centred=False)
            return affine(y, argument(args, kwargs, 2, "weight"), None, tuple(shape))
        if func is F.group_norm:
            x, groups = args[0], argument(args, kwargs, 1, "num_groups")
            eps = argument(args, kwargs, 4, "eps", 1e-5)
            y = held_norm(x.reshape(x.shape[0], groups, -1), (-1,), eps, centred=True).reshape(x.shape)
            shape = (1, -1) + (1,) * (x.dim() - 2)
            return affine(y, argument(args, kwargs, 2, "weight"), argument(args, kwargs, 3, "bias"), shape)
        if func in RATIOS:
            kwargs.pop("inplace", None)
            return held_ratio(args[0], func(*args, **kwargs))
        if func in PRODUCTS | MATRIX_PRODUCTS and len(args) == 2 and from_input(args[0]) and from_input(args[1]):
            a, b = args
            if func in PRODUCTS and max(kind(a), kind(b)) > 0:  # the gate held: the one of higher kind, else the first
                return func(a.detach(), b) if kind(a) >= kind(b) else func(a, b.detach())
            if func in MATRIX_PRODUCTS and max(kind(a), kind(b)) == 2:  # weights times values
                return func(a.detach(), b) if kind(a) == 2 else func(a, b.detach())
            return 0.5 * (func(a.detach(), b) + func(a, b.detach()))
        return func(*args, **kwargs)


def detached_gradient_times_input(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    leaf = x.clone().requires_grad_(True)
    hooks = [
        module.register_forward_hook(lambda _, inputs, out: held_ratio(inputs[0], out))
        for module in model.modules()
        if isinstance(module, ACTIVATION_MODULES)
    ]
    hooks += [
        module.register_forward_hook(lambda _, inputs, out: marked(out, GATE))
        for module in model.modules()
        if isinstance(module, GATE_MODULES)
    ]
    try:
        with Detached():
            y = model(leaf)
    finally:
        for hook in hooks:
            hook.remove()
    (grad,) = torch.autograd.grad(y.gather(1, target[:, None]).sum(), leaf)
    return (x * grad).detach()


def tm(name: str, **kwargs) -> Callable[[], nn.Module]:
    return partial(timm.create_model, name, pretrained=False, num_classes=5, **kwargs)


SMALL = {"embed_dim": 32, "num_heads": 2}
CASES = {
    case.name: case
    for case in (
        Case("gemma4_vit_167m", tm("gemma4_vit_167m", img_size=32, depth=1, **SMALL), 32, "attention"),
        Case("convit_tiny", tm("convit_tiny", img_size=32, depth=2, **SMALL), 32, "attention"),
        Case("vit (SwiGLU)", tm("vit_base_patch16_224", img_size=32, depth=1, mlp_layer=SwiGLU, **SMALL), 32, "x"),
        Case("coat_lite_tiny", tm("coat_lite_tiny", img_size=32), 32, "attention"),
        Case("efficientnet_b0_gn", tm("efficientnet_b0_gn"), 16, "cnn"),
        Case("eca_nfnet_l0", tm("eca_nfnet_l0"), 16, "cnn"),
        Case("mobilenetv4_hybrid_medium", tm("mobilenetv4_hybrid_medium"), 32, "attention"),
    )
}
SLOW = {"efficientnet_b0_gn", "eca_nfnet_l0", "mobilenetv4_hybrid_medium"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.gallery) if n in SLOW else n for n in CASES], ids=str
)
def test_cplrp_is_gradient_times_input_with_the_held_quantities_detached(name: str):
    model = build(CASES[name])
    x = torch.rand(2, 3, CASES[name].size, CASES[name].size, generator=torch.Generator().manual_seed(2), dtype=F64)
    relevance, output, messages = explain(model, x, CPLRP(epsilon=1e-12, stabilizer=1e-12))
    assert messages == []
    expected = detached_gradient_times_input(model, x, output.argmax(-1))
    assert relative_error(relevance, expected) <= TOLERANCE
