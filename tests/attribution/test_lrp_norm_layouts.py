"""LRP through a BatchNorm whose ``[N, C, H, 1]`` output is transposed before the head (float64, against zennit on
the model with the BatchNorm merged by hand, and gradient × input of that model for LRP-0).

PyTorch's CPU ``batch_norm`` backward misreads a gradient laid out unlike the norm's output when a spatial size of 1
makes the layout ambiguous; the plain gradient through such a model is about 1.1 off. The presets merge the
BatchNorm into the convolution before it and never run that backward.
"""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from zennit import composites as zcomposites
from zennit.attribution import Gradient

from tdhook.attribution import LRP
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.mappers.presets import (
    EpsilonAlpha2Beta1,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    UniformEpsilon,
)
from tests.conftest import relative_error

F64 = torch.float64


class TransposedHead(nn.Module):
    """Conv2d to ``[N, 3, 5, 1]``, a BatchNorm (or nothing, once merged), the channels read last by a Linear
    (its outputs flattened: glue that zennit and tdhook both pass relevance through unchanged)."""

    def __init__(self, norm: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, (1, 2))
        self.bn = nn.BatchNorm2d(3) if norm else nn.Identity()
        self.lin = nn.Linear(3, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.bn(self.conv(x)).transpose(1, 2).squeeze(-1)).flatten(1)


def models() -> tuple[nn.Module, nn.Module]:
    """The model in eval mode with random statistics, and the same function with the BatchNorm merged by hand."""
    torch.manual_seed(0)
    model = TransposedHead().to(F64).eval()
    bn = model.bn
    with torch.no_grad():
        bn.running_mean.uniform_(-1.0, 1.0)
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.uniform_(0.5, 2.0)
        bn.bias.uniform_(-1.0, 1.0)
    merged = TransposedHead(norm=False).to(F64).eval()
    with torch.no_grad():
        scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        merged.conv.weight.copy_(model.conv.weight * scale.view(-1, 1, 1, 1))
        merged.conv.bias.copy_((model.conv.bias - bn.running_mean) * scale + bn.bias)
        merged.lin.load_state_dict(model.lin.state_dict())
    return model, merged


def tdhook_relevance(model: nn.Module, mapper, x: torch.Tensor) -> torch.Tensor:
    lrp = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"])
    return lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]


def zennit_relevance(composite, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(x)
    start = torch.zeros_like(out).scatter_(1, out.argmax(1, keepdim=True), 1.0) * out
    with Gradient(model=model, composite=composite) as attributor:
        _, relevance = attributor(x.clone(), start)
    return relevance


def gradient_times_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    leaf = x.clone().requires_grad_(True)
    out = model(leaf)
    (grad,) = torch.autograd.grad(out.gather(1, out.argmax(1, keepdim=True)).sum(), leaf)
    return x * grad


PRESETS = {
    "EpsilonPlus": (EpsilonPlus, zcomposites.EpsilonPlus),
    "EpsilonPlusFlat": (EpsilonPlusFlat, zcomposites.EpsilonPlusFlat),
    "EpsilonAlpha2Beta1": (EpsilonAlpha2Beta1, zcomposites.EpsilonAlpha2Beta1),
    "EpsilonGammaBox": (lambda: EpsilonGammaBox(-3.0, 3.0), lambda: zcomposites.EpsilonGammaBox(low=-3.0, high=3.0)),
}


@pytest.mark.parametrize("preset", list(PRESETS))
def test_presets_match_zennit_on_the_model_merged_by_hand(preset):
    model, merged = models()
    x = torch.randn(4, 2, 5, 2, dtype=F64)
    ours, theirs = PRESETS[preset]
    expected = zennit_relevance(theirs(), merged, x)
    assert relative_error(tdhook_relevance(model, ours(), x), expected) < 1e-9


def test_lrp0_of_the_merged_layers_is_gradient_times_input():
    model, merged = models()
    x = torch.randn(4, 2, 5, 2, dtype=F64)
    relevance = tdhook_relevance(model, UniformEpsilon(epsilon=1e-14, stabilizer=1e-14), x)
    torch.testing.assert_close(relevance, gradient_times_input(merged, x), rtol=1e-8, atol=1e-10)


@pytest.mark.xfail(
    strict=True,
    reason="no rule on the convolution: the BatchNorm is not merged and its plain gradient runs PyTorch's CPU "
    "batch_norm backward, which misreads the transposed gradient (about 1.1 off)",
)
def test_lrp0_with_the_batch_norm_unmerged_is_gradient_times_input():
    model, merged = models()
    x = torch.randn(4, 2, 5, 2, dtype=F64)
    relevance = tdhook_relevance(model, BaseRuleMapper(stabilizer=0.0), x)
    torch.testing.assert_close(relevance, gradient_times_input(merged, x), rtol=1e-8, atol=1e-10)
