"""Input gradients of Linear and convolution layers for a given weight, without a forward pass.

The fast paths of the rules send relevance through a layer as ``Wᵀ s``: the
gradient a layer with weight ``W`` passes to its input for the output gradient
``s``. These functions compute it directly from the weight and the input's
shape. torch's transposed convolution vectorizes over the input channels, so
on CPU it is slow for a 2-D convolution with few of them (the first layer of
most image models). There, a strided convolution is computed as one stride-1
convolution over its stride phases (:func:`phase_stacked_input_gradient`) and
an unstrided one as a matrix product followed by shifted sums
(:func:`shifted_input_gradient`): two to four times faster.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tdhook.attribution.rules._autograd import is_batched_gradient
from tdhook.attribution.rules._layers import PLAIN_CONVOLUTIONS, TRANSPOSED_INPUT_GRADIENTS, _has_torch_forward

__all__ = [
    "has_direct_input_gradient",
    "direct_input_gradient",
    "direct_input_gradients",
    "phase_stacked_input_gradient",
    "shifted_input_gradient",
]

# Up to this many input channels, a 2-D convolution's input gradient on CPU is faster by stride phases or by
# shifted sums. Measured with batch 8 at 224×224: 7×7 stride 2, 94 → 35 ms for 3 channels, 125 → 66 ms for 8,
# even at 12 (3×3 and 1×1 stride 2 with 32 or more channels: slower); 3×3 stride 1, 150 → 34 ms for 3
# channels, 150 → 54 ms for 6.
_MAX_FEW_CHANNELS = 8
# Below this many output-gradient elements the fixed costs of those paths (about 0.2 ms) outweigh the gain.
_MIN_FEW_CHANNEL_GRADIENT = 1 << 17
# Elements of the matrix product that :func:`shifted_input_gradient` computes at once (4 MiB in float32).
_SHIFTED_PIECE = 1 << 20


def has_direct_input_gradient(module: nn.Module) -> bool:
    """Whether :func:`direct_input_gradient` handles ``module``: Linear and zero-padded convolutions with torch's
    forward (a forward set on the instance may pad otherwise, or call another function).

    Examples:
        >>> has_direct_input_gradient(nn.Conv2d(3, 4, 3)), has_direct_input_gradient(nn.ReLU())
        (True, False)
    """
    kind = type(module)
    if kind is not nn.Linear and kind not in PLAIN_CONVOLUTIONS and kind not in TRANSPOSED_INPUT_GRADIENTS:
        return False
    if not _has_torch_forward(module):
        return False
    if kind is nn.Linear:
        return True
    return module.padding_mode == "zeros" and not isinstance(module.padding, str)


def direct_input_gradient(
    module: nn.Module, weight: torch.Tensor, grad: torch.Tensor, x: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """``Wᵀ grad``: the input gradient of ``module``'s linear map with ``weight`` for the input ``x`` (or its
    shape), with no forward pass.

    Examples:
        >>> conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        >>> x = torch.randn(2, 3, 9, 9, requires_grad=True)
        >>> out = conv(x)
        >>> grad = torch.randn_like(out)
        >>> expected = torch.autograd.grad(out, x, grad)[0]
        >>> torch.allclose(direct_input_gradient(conv, conv.weight.detach(), grad, x.shape), expected, atol=1e-6)
        True
    """
    kind, m = type(module), module
    shape = x.shape if isinstance(x, torch.Tensor) else tuple(x)
    if weight.dtype != grad.dtype:
        # Autocast leaves a half-precision gradient beside a float32 weight. The product runs in the gradient's
        # dtype, as the autocast forward pass did; torch's CPU kernels without oneDNN refuse mixed dtypes.
        weight = weight.to(grad.dtype)
    if kind is nn.Linear:
        return grad @ weight
    if kind in PLAIN_CONVOLUTIONS:
        dims = len(m.kernel_size)
        if len(shape) == dims + 1:  # one unbatched sample
            return direct_input_gradient(module, weight, grad.unsqueeze(0), (1, *shape)).squeeze(0)
        if _has_few_input_channels(m, weight, grad):
            if max(m.stride) > 1:
                return phase_stacked_input_gradient(weight, grad, shape, m.stride, m.padding)
            return shifted_input_gradient(weight, grad, shape, m.padding)
        # Only the input's shape is read. torch.nn.grad.conv*_input pass an expanded tensor, which the
        # convolution first copies into a full-size one; a contiguous one of the gradient's dtype is used as it is.
        if not (isinstance(x, torch.Tensor) and x.is_contiguous() and x.dtype == grad.dtype):
            x = grad.new_empty(shape)
        mask = (True, False, False)  # the input gradient only
        return torch.ops.aten.convolution_backward(
            grad, x, weight, None, m.stride, m.padding, m.dilation, False, [0] * dims, m.groups, mask
        )[0]
    result = TRANSPOSED_INPUT_GRADIENTS[kind](grad, weight, None, m.stride, m.padding, m.dilation, m.groups)
    # With output_padding ≥ stride the product runs past the input's end; its first positions are the gradient.
    spatial = shape[-len(m.kernel_size) :]
    return result[(..., *(slice(0, n) for n in spatial))]


def direct_input_gradients(
    module: nn.Module, weights: Sequence[torch.Tensor], grad: torch.Tensor, x: torch.Tensor
) -> list[torch.Tensor]:
    """``[Wᵀ grad for W in weights]`` as one product, the weights stacked along their input dimension.

    Stacked, the products read ``grad`` once: cheaper than separate calls, though wider ones cost more.

    Examples:
        >>> lin = nn.Linear(3, 2)
        >>> grad, x = torch.randn(5, 2), torch.randn(5, 3)
        >>> first, second = direct_input_gradients(lin, [lin.weight, 2 * lin.weight], grad, x)
        >>> torch.allclose(second, 2 * first)
        True
    """
    if getattr(module, "groups", 1) != 1:
        return [direct_input_gradient(module, w, grad, x) for w in weights]
    stacked_weight = torch.cat(list(weights), dim=0 if type(module) in TRANSPOSED_INPUT_GRADIENTS else 1)
    channel_dim = x.dim() - 1 if type(module) is nn.Linear else x.dim() - len(module.kernel_size) - 1
    shape = list(x.shape)
    shape[channel_dim] *= len(weights)
    stacked = direct_input_gradient(module, stacked_weight, grad, shape)
    return list(stacked.split(x.shape[channel_dim], dim=channel_dim))


def _has_few_input_channels(conv: nn.Module, weight: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether ``conv`` is a CPU 2-D convolution with few input channels (one group, no dilation), and ``grad``
    a large enough plain float32 or float64 gradient.

    A batch of gradients (under ``vmap``) takes torch's product: the few-channel paths use views and in-place
    sums that have no batching rule. So do half precisions (the shifted sums would round once per tap).
    """
    return (
        type(conv) is nn.Conv2d
        and grad.device.type == "cpu"
        and grad.dtype in (torch.float32, torch.float64)
        and grad.numel() >= _MIN_FEW_CHANNEL_GRADIENT
        and not is_batched_gradient(grad)
        and conv.groups == 1
        and tuple(conv.dilation) == (1, 1)
        and weight.shape[1] <= _MAX_FEW_CHANNELS
    )


def phase_stacked_input_gradient(
    weight: torch.Tensor,
    grad: torch.Tensor,
    input_shape: Sequence[int],
    stride: Sequence[int],
    padding: Sequence[int],
) -> torch.Tensor:
    """The input gradient of a strided 2-D convolution (zero padding, no dilation, one group) as one stride-1
    convolution over its stride phases.

    The input positions ``i = s·u + a`` of one phase ``a`` (``0 ≤ a < s``) receive gradient only from kernel
    taps ``t = a + p − s·j``; for each phase that is a stride-1 correlation of ``grad`` with a sub-kernel. The
    ``s_h · s_w`` sub-kernels, zero where a phase has fewer taps, are stacked as the output channels of one
    convolution, whose result is interleaved back into the input's shape. It computes the same sums as the
    transposed convolution, grouped differently.

    Args:
        weight: the weight, ``(C_out, C_in, k_h, k_w)``.
        grad: the output gradient, ``(N, C_out, H_out, W_out)``.
        input_shape: ``(N, C_in, H, W)``.
        stride: the convolution's stride.
        padding: the convolution's zero padding.

    Examples:
        >>> conv = nn.Conv2d(3, 8, 7, stride=2, padding=3, bias=False)
        >>> x = torch.randn(2, 3, 32, 32, requires_grad=True)
        >>> out = conv(x)
        >>> grad = torch.randn_like(out)
        >>> expected = torch.autograd.grad(out, x, grad)[0]
        >>> result = phase_stacked_input_gradient(conv.weight.detach(), grad, x.shape, (2, 2), (3, 3))
        >>> torch.allclose(result, expected, atol=1e-5)
        True
    """
    c_out, c_in = weight.shape[:2]
    n, _, *size = input_shape
    taps, offsets, crops = [], [], []
    for k, s, p, n_in, n_out in zip(weight.shape[2:], stride, padding, size, grad.shape[2:], strict=True):
        # Phase a takes tap t = a + p − s·j at offset j of the output gradient, for j from ⌈(a+p−k+1)/s⌉ to ⌊(a+p)/s⌋.
        low = min(-((k - 1 - a - p) // s) for a in range(s))
        high = max((a + p) // s for a in range(s))
        phases = torch.arange(s, device=weight.device)[:, None]
        tap = phases + p - s * (low + torch.arange(high - low + 1, device=weight.device))
        taps.append(torch.where((tap >= 0) & (tap < k), tap, k))  # tap k: the zero appended below
        per_phase = -(-n_in // s)  # input positions in each phase (the last phases may have one fewer)
        pad = max(0, -low, per_phase + high - n_out)
        offsets.append(pad)
        crops.append(slice(low + pad, low + pad + per_phase))
    padded = F.pad(weight, (0, 1, 0, 1))
    # kernel[a, b, c_in, c_out, j_h, j_w] = weight[c_out, c_in, tap_h[a, j_h], tap_w[b, j_w]]
    kernel = padded[:, :, taps[0][:, None, :, None], taps[1][None, :, None, :]].permute(2, 3, 1, 0, 4, 5)
    kernel = kernel.reshape(stride[0] * stride[1] * c_in, c_out, *kernel.shape[-2:])
    dims = [1, 1]
    # aten.convolution: no autocast, so the result keeps the dtype of the other paths.
    phased = torch.ops.aten.convolution(grad, kernel, None, dims, offsets, dims, False, [0, 0], 1)
    phased = phased[:, :, crops[0], crops[1]]
    rows, cols = phased.shape[-2:]
    result = phased.unflatten(1, (stride[0], stride[1], c_in)).permute(0, 3, 4, 1, 5, 2)
    result = result.reshape(n, c_in, rows * stride[0], cols * stride[1])
    if result.shape[-2:] != tuple(size):
        result = result[:, :, : size[0], : size[1]].contiguous()
    return result


def shifted_input_gradient(
    weight: torch.Tensor, grad: torch.Tensor, input_shape: Sequence[int], padding: Sequence[int]
) -> torch.Tensor:
    """The input gradient of a 2-D convolution with stride 1 (zero padding, no dilation, one group) as a matrix
    product followed by shifted sums.

    For every input channel ``c`` and tap ``t``, ``Y[c, t] = Σ_o W[o, c, t] · grad[o]`` is one row of a matrix
    product over the output channels; input position ``i`` then sums ``Y[c, t]`` at output position
    ``i + p − t`` over the taps. The product runs on a few samples at a time, so that ``Y`` stays small.

    Args:
        weight: the weight, ``(C_out, C_in, k_h, k_w)``.
        grad: the output gradient, ``(N, C_out, H_out, W_out)``.
        input_shape: ``(N, C_in, H, W)``.
        padding: the convolution's zero padding.

    Examples:
        >>> conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        >>> x = torch.randn(2, 3, 16, 16, requires_grad=True)
        >>> out = conv(x)
        >>> grad = torch.randn_like(out)
        >>> expected = torch.autograd.grad(out, x, grad)[0]
        >>> torch.allclose(shifted_input_gradient(conv.weight.detach(), grad, x.shape, (1, 1)), expected, atol=1e-5)
        True
    """
    c_out, c_in, k_h, k_w = weight.shape
    n, _, height, width = input_shape
    out_h, out_w = grad.shape[-2:]
    rows = weight.permute(1, 2, 3, 0).reshape(c_in * k_h * k_w, c_out)  # one row per input channel and tap
    result = grad.new_zeros(input_shape)
    # Tap t of output position o lands on input position o − p + t: the output positions that land inside.
    spans = [
        [(max(0, p - t), min(n_out, n_in + p - t)) for t in range(k)]
        for k, p, n_in, n_out in ((k_h, padding[0], height, out_h), (k_w, padding[1], width, out_w))
    ]
    samples = max(1, _SHIFTED_PIECE // max(1, rows.shape[0] * out_h * out_w))
    for start in range(0, n, samples):
        part = grad[start : start + samples]
        with torch.autocast(grad.device.type, enabled=False):  # the precision of the other paths
            taps = torch.matmul(rows, part.reshape(len(part), c_out, out_h * out_w))
        taps = taps.view(len(part), c_in, k_h, k_w, out_h, out_w)
        target = result[start : start + samples]
        for t_h, (top, bottom) in enumerate(spans[0]):
            for t_w, (left, right) in enumerate(spans[1]):
                if top < bottom and left < right:
                    shift_h, shift_w = t_h - padding[0], t_w - padding[1]
                    # add_, not +=: a slice covering the whole tensor would be assigned back (an error under autograd)
                    target[:, :, top + shift_h : bottom + shift_h, left + shift_w : right + shift_w].add_(
                        taps[:, :, t_h, t_w, top:bottom, left:right]
                    )
    return result
