"""The kinds of layers the rules and mappers tell apart, and a layer's forward pass with other parameters."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from tensordict.nn.utils import biased_softplus
from torch import nn
from torch.func import functional_call
from torchrl.modules.models.utils import SquashDims

__all__ = [
    "ACTIVATIONS",
    "AVG_POOLS",
    "BATCH_NORMS",
    "GRADIENT_ROUTED",
    "PLAIN_CONVOLUTIONS",
    "TRANSPOSED_FORWARDS",
    "TRANSPOSED_INPUT_GRADIENTS",
    "CONVOLUTIONS",
    "LINEAR_LAYERS",
    "forward_with",
    "bias_view",
]

ACTIVATIONS = (
    nn.ELU,
    nn.Hardshrink,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Hardswish,
    nn.LeakyReLU,
    nn.LogSigmoid,
    nn.PReLU,
    nn.ReLU,
    nn.ReLU6,
    nn.RReLU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.Sigmoid,
    nn.SiLU,
    nn.Mish,
    nn.Softplus,
    nn.Softshrink,
    nn.Softsign,
    nn.Tanh,
    nn.Tanhshrink,
    nn.Threshold,
    biased_softplus,  # the scale mapping of tensordict's NormalParamExtractor
)
AVG_POOLS = (
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
)
BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
GRADIENT_ROUTED = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.Flatten,
    nn.Unflatten,
    nn.Identity,
    nn.Embedding,  # an input layer: LRP gives its tokens the relevance of their embeddings
    SquashDims,
)

PLAIN_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
TRANSPOSED_FORWARDS = {
    nn.ConvTranspose1d: F.conv_transpose1d,
    nn.ConvTranspose2d: F.conv_transpose2d,
    nn.ConvTranspose3d: F.conv_transpose3d,
}

# The input gradient of a transposed convolution is the plain convolution with the same weight.
TRANSPOSED_INPUT_GRADIENTS = {nn.ConvTranspose1d: F.conv1d, nn.ConvTranspose2d: F.conv2d, nn.ConvTranspose3d: F.conv3d}
CONVOLUTIONS = (*PLAIN_CONVOLUTIONS, *TRANSPOSED_FORWARDS)
LINEAR_LAYERS = (*CONVOLUTIONS, nn.Linear)


def forward_with(module: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, busy: list) -> torch.Tensor:
    """Run ``module`` on ``x`` with ``params`` in place of its own parameters."""
    weight = params.get("weight", getattr(module, "weight", None))
    bias = params.get("bias", getattr(module, "bias", None))
    if type(module) is nn.Linear:
        return F.linear(x, weight, bias)
    if isinstance(module, PLAIN_CONVOLUTIONS):
        return module._conv_forward(x, weight, bias)
    if type(module) in TRANSPOSED_FORWARDS:
        m = module
        return TRANSPOSED_FORWARDS[type(m)](
            x, weight, bias, m.stride, m.padding, m.output_padding, m.groups, m.dilation
        )
    busy.append(True)  # the rule's own hook must not run on this inner call
    try:
        return functional_call(module, params, (x,))
    finally:
        busy.pop()


def bias_view(module: nn.Module, bias: torch.Tensor) -> torch.Tensor:
    """``bias`` shaped to broadcast over the output ``z``: its last dimension (Linear) or the channel dimension."""
    return bias if type(module) is nn.Linear else bias.view(-1, *([1] * len(module.kernel_size)))
