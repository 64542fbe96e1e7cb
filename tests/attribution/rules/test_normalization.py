"""NormRule: normalisation layers with the normalising scale held constant, against closed forms (float64).

The rule acts on what a norm's forward really runs (``F.layer_norm``, ``F.rms_norm``, ``F.group_norm``,
``F.instance_norm``, ``F.batch_norm``, ``F.normalize``, or a scale from ``rsqrt``/``sqrt``/``var``/``std``/a vector
norm/a negative power in a norm written by hand). Relevance is the input times the rule's gradient, and the gradient
that reaches a norm's output is ``R / y`` for an output relevance ``R``.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable

import pytest
import timm.layers
import torch
import torch.nn.functional as F
import torchvision
from tensordict import TensorDict
from torch import nn
from torchrl.modules import BatchRenorm1d

from tdhook.attribution import CPLRP, LRP, AttnLRP, UniformEpsilon
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule, PassRule
from tdhook.attribution.rules.batch_norm import MergeBatchNormRule
from tdhook.attribution.rules.normalization import LayerNormRule, NormRule, is_norm
from tests.attribution.rules._helpers import CNN_PRESETS, F64, randn
from tests.attribution.test_lrp_layers import (
    argmax_one_hot,
    gradient_times_input,
    lrp_relevance,
    merged_by_hand,
    randomise_batch_norm,
)
from tests.conftest import relative_error, tdhook_relevance

# ----------------------------------------------------------------------------- norms written by hand


class LlamaRMSNorm(nn.Module):
    """Hugging Face's Llama (and T5) RMSNorm: ``w · x · rsqrt(mean(x²) + ε)``."""

    def __init__(self, n: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, dtype=F64))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: ``x · rsqrt(mean(x²) + ε) · (1 + w)``."""

    def __init__(self, n: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(n, dtype=F64))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x) * (1.0 + self.weight)


class Gemma3nRMSNorm(nn.Module):
    """Gemma 3n's RMSNorm: ``w · x · pow(mean(x²) + ε, −1/2)`` (``torch.pow``, or the ``**`` operator)."""

    def __init__(self, n: int, eps: float = 1e-6, operator: bool = False) -> None:
        super().__init__()
        self.eps, self.operator = eps, operator
        self.weight = nn.Parameter(torch.ones(n, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean_squared = x.pow(2).mean(-1, keepdim=True) + self.eps
        return x * (mean_squared**-0.5 if self.operator else torch.pow(mean_squared, -0.5)) * self.weight


class VectorNormRMSNorm(nn.Module):
    """An RMSNorm through the vector norm: ``w · x · sqrt(n) / ‖x‖``."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * math.sqrt(x.shape[-1]) / torch.linalg.vector_norm(x, dim=-1, keepdim=True)


class VarMeanLayerNorm(nn.Module):
    """A LayerNorm written with ``torch.var_mean``: ``(x − μ) · (var + ε)^(−1/2) · w + b``."""

    def __init__(self, n: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(n, dtype=F64))
        self.bias = nn.Parameter(torch.zeros(n, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var, mean = torch.var_mean(x, -1, keepdim=True, unbiased=False)
        return (x - mean) * (var + self.eps).pow(-0.5) * self.weight + self.bias


class StdLayerNorm(VarMeanLayerNorm):
    """A LayerNorm written with ``Tensor.std``: ``(x − μ) / (std + ε) · w + b``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        centred = x - x.mean(-1, keepdim=True)
        return centred / (x.std(-1, keepdim=True, unbiased=False) + self.eps) * self.weight + self.bias


class RootMeanSquareScaling(nn.Module):
    """T5's norm under a name no mapper knows: found by its forward's ``rsqrt``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(size) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class L2Norm(nn.Module):
    """``F.normalize`` as a module (named like a norm, so the mappers give it :class:`NormRule`)."""

    def __init__(self, p: float = 2.0, dim: int = -1) -> None:
        super().__init__()
        self.p, self.dim = p, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(x, p=self.p, dim=self.dim)


class NotANorm(nn.Module):
    """A module whose forward runs no normalisation."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 2


class FullPrecisionRMSNorm(LlamaRMSNorm):
    """Llama's RMSNorm with its forward wrapped by a decorator (mixed-precision code keeps norms out of autocast)."""

    @torch.autocast("cpu", enabled=False)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


class NormedEmbeddings(nn.Module):
    """Token embeddings, a LayerNorm and dropout, as Funnel's embeddings: no layer of its own. Without ``norm``
    the LayerNorm is ``None``, as in ESM-2's embeddings (``emb_layer_norm_before=False``)."""

    def __init__(self, dim: int, norm: bool = True) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(8, dim)
        self.layer_norm = nn.LayerNorm(dim) if norm else None
        self.dropout = nn.Dropout(0.1)

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        if self.layer_norm is not None:
            inputs_embeds = self.layer_norm(inputs_embeds)
        return self.dropout(inputs_embeds)


class NoNorm(nn.Module):
    """Named like a norm, an element-wise affine map (MobileBERT's): ``x · w + b``."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(size, dtype=F64))
        self.bias = nn.Parameter(torch.zeros(size, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight + self.bias


class InputNorm(nn.Module):
    """Named like a norm, a user's input scaling by constants: ``(x - 0.5) / 0.25`` names nothing."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - 0.5) / 0.25


class InputScaling(InputNorm):
    """The same scaling under a name no norm has."""


class StatisticsNorm(nn.Module):
    """Named like a norm, a scaling by the data set's statistics kept as numbers: ``(x - self.mean) / self.std``."""

    def __init__(self, mean: float = 0.5, std: float = 0.25) -> None:
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std


CHANNEL_MEAN, CHANNEL_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class ChannelNorm(nn.Module):
    """Named like a norm, ImageNet's per-channel input scaling, in the forms preprocessing code writes it."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.register_buffer("mean", torch.tensor(CHANNEL_MEAN, dtype=F64))
        self.register_buffer("std", torch.tensor(CHANNEL_STD, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.form == "view":
            return (x - self.mean.view(1, -1, 1, 1)) / self.std.view(1, -1, 1, 1)
        if self.form == "methods":
            return x.sub(self.mean[:, None, None]).div(self.std[:, None, None])
        mean = torch.tensor(CHANNEL_MEAN, dtype=x.dtype).view(1, 3, 1, 1)
        return (x - mean) / torch.tensor(CHANNEL_STD, dtype=x.dtype).view(1, 3, 1, 1)


class ChannelScaling(ChannelNorm):
    """The same scaling under a name no norm has."""


class PowerNorm(nn.Module):
    """Named like a norm, the signed square root of bilinear pooling's power normalisation: element by element."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sign(x) * torch.sqrt(torch.abs(x))


class CapsuleNorm(nn.Module):
    """Named like a norm, a capsule's length: the norm of its input is the output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.linalg.vector_norm(x, dim=-1)


class Whitening(nn.Module):
    """``F.instance_norm`` over the features, under a name that is no ``*Norm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.instance_norm(x.unsqueeze(1)).squeeze(1)


class WhiteningNorm(Whitening):
    """The same norm named like one."""


class SignedSqrt(PowerNorm):
    """The signed square root under a name that is no ``*Norm``: an activation."""


class DivisiveNorm(nn.Module):
    """A divisive normalisation (GDN's form): each element divided by a root of its neighbours' squares, one scale per
    element by design."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(F.avg_pool1d(x.unsqueeze(1) ** 2, 3, 1, 1).squeeze(1) + 1e-6)


class RunningStatisticsNorm(nn.Module):
    """An eval-mode BatchNorm written by hand on its buffers: its scale, of buffers alone, has one value per feature."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("running_var", torch.rand(6, dtype=F64) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt(self.running_var + 1e-5)


class GivenStatisticsNorm(nn.Module):
    """A norm given its statistic beside its input, as many elements as it: ``x · rsqrt(var + ε)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.normalise(x, x.detach().pow(2).mean(-1, keepdim=True).expand_as(x).contiguous())

    @staticmethod
    def normalise(x: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(var + 1e-6)


class ScaledDotScore(nn.Module):
    """Attention pooling without parameters: ``softmax(Σ q·k / math.sqrt(d))`` names a root and a sum, of a number."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.softmax((x * x.flip(-1)).sum(-1, keepdim=True) / math.sqrt(x.shape[-1]), 0)


def _explain_after_a_linear_layer(*layers: nn.Module, preset: str) -> TensorDict:
    """LRP under ``preset`` of a linear layer 4 → 6 followed by ``layers``, on a random batch of 5."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), *layers).double()
    mapper = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, **CNN_PRESETS}[preset]()
    return LRP(model, mapper, in_keys=["x"], out_keys=["y"])(TensorDict(x=torch.randn(5, 4, dtype=F64), batch_size=[5]))


def _relevance_before_a_convolution(scalings: list[nn.Module], preset: str) -> list[torch.Tensor]:
    """LRP under ``preset`` of each of ``scalings`` followed by one and the same convolution, ReLU and linear layer,
    on one random image batch, with no warning."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)).double()
    x = torch.rand(2, 3, 8, 8, dtype=F64)
    relevance = []
    for scaling in scalings:
        mapper = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, **CNN_PRESETS}[preset]()
        lrp = LRP(nn.Sequential(scaling, body), mapper, in_keys=["x"], out_keys=["y"])
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            relevance.append(lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"])
    return relevance


def _closure_forward(scale: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale(x)

    return forward


class ClosureNorm(nn.Module):
    """Named like a norm, a forward that calls the function its closure holds (an RMS scaling): it names nothing of
    its own, and what it calls is not known from its code."""

    forward = _closure_forward(lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def randomise(module: nn.Module, bias: bool = True) -> nn.Module:
    """Weights of both signs far from one; biases random, or zero with ``bias=False``."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name.endswith("bias"):
                param.copy_(torch.randn_like(param) if bias else torch.zeros_like(param))
            else:
                param.copy_(torch.randn_like(param) * 1.5)
    return module


def norm_relevance(module: nn.Module, x: torch.Tensor, relevance_out: torch.Tensor, rule=None) -> torch.Tensor:
    return tdhook_relevance(NormRule() if rule is None else rule, module, x, relevance_out)


def output_gradient(module: nn.Module, x: torch.Tensor, relevance_out: torch.Tensor) -> torch.Tensor:
    """The gradient that reaches the norm's output: ``R / y``."""
    with torch.no_grad():
        return relevance_out / module(x)


def centred(h: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    return h - h.mean(dims, keepdim=True)


# ----------------------------------------------------------------------------- closed forms


class TestLayerNormClosedForm:
    """``grad_x = h − mean(h)``, ``h = g · w / σ`` over the normalised dimensions."""

    @pytest.mark.parametrize("affine", [True, False])
    @pytest.mark.parametrize("shape", [(6,), (3, 4)], ids=["one-dim", "two-dims"])
    def test_nn_layer_norm(self, shape: tuple[int, ...], affine: bool):
        module = randomise(nn.LayerNorm(shape, elementwise_affine=affine, dtype=F64))
        x, relevance_out = randn(5, 2, *shape), randn(5, 2, *shape)
        dims = tuple(range(-len(shape), 0))
        sigma = (x.var(dims, unbiased=False, keepdim=True) + module.eps).sqrt()
        weight = module.weight if affine else 1.0
        h = output_gradient(module, x, relevance_out) * weight / sigma
        expected = x * centred(h, dims)
        assert relative_error(norm_relevance(module, x, relevance_out), expected) <= 1e-12
        # The plain gradient keeps σ's dependence on x: another answer.
        assert relative_error(norm_relevance(module, x, relevance_out, IgnoreRule()), expected) > 1e-3

    @pytest.mark.parametrize("module", [VarMeanLayerNorm(6), StdLayerNorm(6)], ids=["var_mean", "std"])
    def test_hand_written_layer_norm(self, module: nn.Module):
        randomise(module)
        x, relevance_out = randn(4, 6), randn(4, 6)
        if isinstance(module, StdLayerNorm):
            scale = 1 / (x.std(-1, keepdim=True, unbiased=False) + module.eps)
        else:
            scale = torch.rsqrt(x.var(-1, keepdim=True, unbiased=False) + module.eps)
        h = output_gradient(module, x, relevance_out) * module.weight.detach() * scale
        expected = x * centred(h, (-1,))
        assert relative_error(norm_relevance(module, x, relevance_out), expected) <= 1e-12

    @pytest.mark.parametrize("source", ["torchvision", "timm"])
    def test_channels_first_layer_norm_is_layer_norm_on_the_permuted_input(self, source: str):
        cls = torchvision.models.convnext.LayerNorm2d if source == "torchvision" else timm.layers.LayerNorm2d
        module = randomise(cls(4, eps=1e-6).double())
        reference = nn.LayerNorm(4, eps=1e-6, dtype=F64)
        reference.load_state_dict(module.state_dict())
        x, relevance_out = randn(2, 4, 3, 5), randn(2, 4, 3, 5)

        def channels_last(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 2, 3, 1)

        expected = norm_relevance(reference, channels_last(x), channels_last(relevance_out)).permute(0, 3, 1, 2)
        assert relative_error(norm_relevance(module, x, relevance_out), expected) <= 1e-12
        # Normalising over the wrong dimension (the last, W) would give another answer.
        wrong = nn.LayerNorm(5, eps=1e-6, dtype=F64)
        assert relative_error(norm_relevance(wrong, x, relevance_out), expected) > 1e-3


class TestLayerNormRule:
    """AttnLRP's name for the rule (moved here from the transformer rules' tests)."""

    def test_layer_norm_rule_is_norm_rule(self):
        assert issubclass(LayerNormRule, NormRule)

    @pytest.mark.parametrize("norm", ["layer", "rms"])
    def test_layer_norm_rule_is_the_gradient_with_the_scale_detached(self, norm: str):
        if norm == "layer":
            module = nn.LayerNorm(6, dtype=F64)
        else:
            module = nn.RMSNorm(6, eps=1e-5, dtype=F64)
        with torch.no_grad():
            module.weight.copy_(randn(6))
            if norm == "layer":
                module.bias.copy_(randn(6))
        x, relevance_out = randn(5, 6), randn(5, 6)
        relevance = tdhook_relevance(LayerNormRule(), module, x, relevance_out)

        xr = x.clone().requires_grad_(True)
        if norm == "layer":
            centred = xr - xr.mean(-1, keepdim=True)
            sigma = (centred.pow(2).mean(-1, keepdim=True) + module.eps).sqrt().detach()
            y = centred / sigma * module.weight + module.bias
        else:
            y = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + module.eps).detach() * module.weight
        torch.testing.assert_close(y, module(x))
        (grad,) = torch.autograd.grad(y, xr, relevance_out / y.detach())
        assert relative_error(relevance, x * grad) <= 1e-12
        if norm == "rms":  # each feature keeps its own relevance
            assert relative_error(relevance, relevance_out) <= 1e-12


RMS_NORMS = {
    "nn.RMSNorm": lambda: nn.RMSNorm(6, eps=1e-5, dtype=F64),
    "nn.RMSNorm-eps-none": lambda: nn.RMSNorm(6, dtype=F64),
    "nn.RMSNorm-two-dims": lambda: nn.RMSNorm((2, 3), eps=1e-5, dtype=F64),
    "llama": lambda: LlamaRMSNorm(6, eps=1e-5),
    "gemma": lambda: GemmaRMSNorm(6, eps=1e-5),
    "vector-norm": lambda: VectorNormRMSNorm(6),
    "gemma3n": lambda: Gemma3nRMSNorm(6, eps=1e-5),
    "gemma3n-operator": lambda: Gemma3nRMSNorm(6, eps=1e-5, operator=True),
}


def rms_scale(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The held constant ``w · r`` of an RMSNorm, written out per kind."""
    if isinstance(module, VectorNormRMSNorm):
        return module.weight.detach() * math.sqrt(6) / x.norm(dim=-1, keepdim=True)
    if isinstance(module, nn.RMSNorm):
        dims = tuple(range(-len(module.normalized_shape), 0))
        eps = torch.finfo(F64).eps if module.eps is None else module.eps
        return module.weight.detach() * torch.rsqrt(x.pow(2).mean(dims, keepdim=True) + eps)
    eps = getattr(module, "eps", getattr(module, "variance_epsilon", None))
    weight = 1 + module.weight.detach() if isinstance(module, GemmaRMSNorm) else module.weight.detach()
    return weight * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class TestRMSNormClosedForm:
    """``grad_x = g · w / rms(x)``: each feature keeps its own relevance."""

    @pytest.mark.parametrize("kind", sorted(RMS_NORMS))
    def test_rms_norm(self, kind: str):
        module = randomise(RMS_NORMS[kind]())
        x = randn(4, 2, 3) if kind.endswith("two-dims") else randn(4, 6)
        relevance_out = randn(*x.shape)
        expected = x * output_gradient(module, x, relevance_out) * rms_scale(module, x)
        relevance = norm_relevance(module, x, relevance_out)
        assert relative_error(relevance, expected) <= 1e-12
        assert relative_error(relevance, relevance_out) <= 1e-12
        assert relative_error(norm_relevance(module, x, relevance_out, IgnoreRule()), expected) > 1e-3


class TestGroupNormClosedForm:
    """Centring and ``σ`` per group of channels (InstanceNorm: one channel per group)."""

    @staticmethod
    def expected(x, grad, groups, weight, eps):
        n, c = x.shape[:2]
        h = grad if weight is None else grad * weight.view(1, c, *[1] * (x.dim() - 2))
        grouped_x, grouped_h = x.reshape(n, groups, -1), h.reshape(n, groups, -1)
        sigma = (grouped_x.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
        return x * centred(grouped_h / sigma, (-1,)).reshape(x.shape)

    @pytest.mark.parametrize("groups", [1, 2, 3, 6])
    def test_group_norm(self, groups: int):
        module = randomise(nn.GroupNorm(groups, 6, dtype=F64))
        x, relevance_out = randn(2, 6, 3, 4), randn(2, 6, 3, 4)
        grad = output_gradient(module, x, relevance_out)
        expected = self.expected(x, grad, groups, module.weight.detach(), module.eps)
        assert relative_error(norm_relevance(module, x, relevance_out), expected) <= 1e-12
        assert relative_error(norm_relevance(module, x, relevance_out, IgnoreRule()), expected) > 1e-3

    @pytest.mark.parametrize("affine", [True, False])
    @pytest.mark.parametrize("dims", [1, 2])
    def test_instance_norm(self, dims: int, affine: bool):
        cls = nn.InstanceNorm1d if dims == 1 else nn.InstanceNorm2d
        module = randomise(cls(6, affine=affine, dtype=F64))
        shape = (3, 6, 7) if dims == 1 else (3, 6, 3, 4)
        x, relevance_out = randn(*shape), randn(*shape)
        grad = output_gradient(module, x, relevance_out)
        expected = self.expected(x, grad, 6, module.weight.detach() if affine else None, module.eps)
        assert relative_error(norm_relevance(module, x, relevance_out), expected) <= 1e-12
        assert relative_error(norm_relevance(module, x, relevance_out, IgnoreRule()), expected) > 1e-3


class TestNormalizeClosedForm:
    """``F.normalize``: ``grad_x = g / ‖x‖_p``, so every element keeps its relevance."""

    @pytest.mark.parametrize("dim", [1, -1])
    @pytest.mark.parametrize("p", [1.0, 2.0])
    def test_normalize(self, p: float, dim: int):
        module = L2Norm(p, dim)
        x, relevance_out = randn(3, 5, 4), randn(3, 5, 4)
        expected = x * output_gradient(module, x, relevance_out) / x.norm(p, dim, keepdim=True)
        relevance = norm_relevance(module, x, relevance_out)
        assert relative_error(relevance, expected) <= 1e-12
        assert relative_error(relevance, relevance_out) <= 1e-12
        # Gradient × input of a scale-invariant map sums to zero over the normalised dimension.
        assert relative_error(norm_relevance(module, x, relevance_out, IgnoreRule()), expected) > 1e-3


def batch_affine(module: nn.Module, x: torch.Tensor, batch_statistics: bool) -> torch.Tensor:
    """The per-channel scale ``s = w / sqrt(var + eps)`` of a BatchNorm or InstanceNorm, shaped like ``x``."""
    if batch_statistics:
        var = x.var([0, *range(2, x.dim())], unbiased=False)
    else:
        var = module.running_var
    scale = torch.rsqrt(var + module.eps)
    if module.weight is not None:
        scale = scale * module.weight.detach()
    return scale.view(1, -1, *[1] * (x.dim() - 2))


class TestAffineClosedForm:
    """BatchNorm (and InstanceNorm with running statistics): the ε-rule of ``y = s x + t``,
    ``R_x = s x · R / (y + ε sign(y))``."""

    @staticmethod
    def check(module: nn.Module, x: torch.Tensor, batch_statistics: bool, epsilon: float = 0.1) -> None:
        relevance_out = randn(*x.shape)
        with torch.no_grad():
            y = module(x)
        sign = torch.where(y >= 0, 1.0, -1.0).to(F64)
        expected = batch_affine(module, x, batch_statistics) * x * relevance_out / (y + epsilon * sign)
        relevance = norm_relevance(module, x, relevance_out, NormRule(epsilon))
        assert relative_error(relevance, expected) <= 1e-12
        assert relative_error(norm_relevance(module, x, relevance_out, NormRule(0.0)), expected) > 1e-3

    @pytest.mark.parametrize("cls", [nn.BatchNorm1d, nn.BatchNorm2d])
    def test_eval_batch_norm(self, cls: type):
        module = randomise_batch_norm(cls(4)).double().eval()
        module.eps = 1e-5
        self.check(module, randn(3, 4, 5) if cls is nn.BatchNorm1d else randn(3, 4, 2, 3), batch_statistics=False)

    @pytest.mark.parametrize("running_statistics", [True, False])
    def test_batch_norm_with_batch_statistics(self, running_statistics: bool):
        module = randomise(nn.BatchNorm2d(4, track_running_stats=running_statistics, dtype=F64))
        if running_statistics:
            module.train()  # training mode: the batch statistics, held constant
        else:
            module.eval()  # no running statistics: the batch statistics in eval mode too
        self.check(module, randn(3, 4, 2, 3), batch_statistics=True)

    def test_instance_norm_with_running_statistics(self):
        module = randomise(nn.InstanceNorm2d(4, affine=True, track_running_stats=True, dtype=F64)).eval()
        with torch.no_grad():
            module.running_mean.copy_(randn(4))
            module.running_var.copy_(torch.rand(4, dtype=F64) + 0.5)
        self.check(module, randn(3, 4, 2, 3), batch_statistics=False)


class TestLocalResponseNormClosedForm:
    """``F.local_response_norm``: ``y = x / d`` with ``d = (k + α · mean of x² over neighbouring channels)^β`` held
    constant, so that ``grad_x = g / d`` and every element keeps its relevance."""

    @pytest.mark.parametrize("shape", [(3, 5, 4), (2, 6, 3, 4), (2, 4, 2, 3, 3)])
    @pytest.mark.parametrize("size", [2, 3])
    def test_local_response_norm(self, shape: tuple[int, ...], size: int):
        module = nn.LocalResponseNorm(size, alpha=0.5, beta=0.75, k=0.5)
        x, relevance_out = randn(*shape), randn(*shape)
        squares = F.pad(x.pow(2).unsqueeze(1), (0, 0) * (x.dim() - 2) + (size // 2, (size - 1) // 2)).squeeze(1)
        window = sum(squares.narrow(1, start, x.shape[1]) for start in range(size)) / size
        divisor = (0.5 + 0.5 * window).pow(0.75)
        expected = x * output_gradient(module, x, relevance_out) / divisor
        relevance = norm_relevance(module, x, relevance_out)
        assert relative_error(relevance, expected) <= 1e-12
        assert relative_error(relevance, relevance_out) <= 1e-12
        assert relative_error(norm_relevance(module, x, relevance_out, IgnoreRule()), expected) > 1e-3

    def test_presets_give_it_the_rule(self):
        net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.LocalResponseNorm(3), nn.Flatten(), nn.Linear(16, 2))
        net, x = net.double(), randn(2, 3, 4, 4)
        for preset in CNN_PRESETS.values():
            lrp = LRP(net, preset(strict=True), in_keys=["x"], out_keys=["y"])
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # covered: no plain-gradient warning, no refusal
                assert lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"].shape == x.shape


class TestUnknownNorm:
    def test_module_without_a_normalisation_raises(self):
        with pytest.raises(ValueError, match="NormRule on NotANorm: its forward ran no normalisation"):
            norm_relevance(NotANorm(), randn(2, 3), randn(2, 3))

    def test_the_wrapper_names_the_module_path_of_a_rule_that_acts_in_its_forward(self):
        net = nn.Sequential(nn.Linear(3, 3, dtype=F64), nn.Sequential(NotANorm()))
        lrp = LRP(net, {"1.0": NormRule()}, in_keys=["x"], out_keys=["y"])
        with pytest.raises(ValueError, match="ran no normalisation") as caught:
            lrp(TensorDict(x=randn(2, 3), batch_size=[2]))
        assert "LRP: the module is '1.0'" in caught.value.__notes__

    @pytest.mark.parametrize("preset", [AttnLRP, CPLRP], ids=lambda p: p.__name__)
    def test_a_scale_computed_in_place_is_refused_with_what_to_do(self, preset):
        """``variance.add_(eps).rsqrt_()``: the scale written in place is not followed (holding it would take holding
        the tensor the forward goes on with); the error names the module and the out-of-place form to write."""

        class InPlaceRMSNorm(LlamaRMSNorm):
            def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
                variance = hidden_states.pow(2).mean(-1, keepdim=True)
                variance.add_(self.variance_epsilon).rsqrt_()
                return self.weight * (hidden_states * variance)

        net = nn.Sequential(nn.Linear(3, 3, dtype=F64), InPlaceRMSNorm(3))
        lrp = LRP(net, preset(), in_keys=["x"], out_keys=["y"])
        with pytest.raises(ValueError, match=r"InPlaceRMSNorm.*v\.rsqrt_\(\).*torch\.rsqrt\(v\)") as caught:
            lrp(TensorDict(x=randn(2, 3), batch_size=[2]))
        assert "LRP: the module is '1'" in caught.value.__notes__

    def test_module_without_gradient_does_not_raise(self):
        module = NotANorm()
        with NormRule().register(module), torch.no_grad():
            module(randn(2, 3))


# ----------------------------------------------------------------------------- which modules get the rule


class ConvNormAct(nn.Sequential):
    """A block named like a norm that holds a convolution."""


class TestIsNorm:
    @pytest.mark.parametrize(
        "make",
        [
            lambda: nn.LayerNorm(4),
            lambda: nn.GroupNorm(2, 4),
            lambda: nn.RMSNorm(4),
            lambda: nn.InstanceNorm2d(4),
            lambda: nn.BatchNorm2d(4),
            lambda: torchvision.models.convnext.LayerNorm2d(4),
            lambda: timm.layers.LayerNorm2d(4),
            lambda: timm.layers.BatchNormAct2d(4),
            lambda: timm.layers.GroupNormAct(4, num_groups=2),
            lambda: timm.layers.FilterResponseNormAct2d(4),
            lambda: timm.layers.FilterResponseNormTlu2d(4),
            lambda: LlamaRMSNorm(4),
            lambda: L2Norm(),
            lambda: RootMeanSquareScaling(4),
            lambda: FullPrecisionRMSNorm(4),
        ],
    )
    def test_norms(self, make):
        assert is_norm(make())

    def test_a_norm_whose_forward_a_decorator_wraps_keeps_its_held_scale(self):
        """The wrapper's own code names nothing, as an element-wise map of the module's own tensors would: the
        wrapped forward is what tells (it computes a scale), and each element keeps its relevance."""
        norm, x, relevance_out = FullPrecisionRMSNorm(6).double(), randn(3, 6), randn(3, 6)
        relevance = tdhook_relevance(BaseRuleMapper()("norm", norm), norm, x, relevance_out)
        assert relative_error(relevance, relevance_out) <= 1e-12

    def test_a_norm_found_by_its_forward_gets_the_rms_behaviour(self):
        norm, x = RootMeanSquareScaling(6).double(), torch.randn(3, 6, dtype=torch.float64)
        relevance_out = torch.randn(3, 6, dtype=torch.float64)
        # Held scale: each element's relevance passes on unchanged (the plain gradient would spread it).
        relevance = tdhook_relevance(BaseRuleMapper()("norm", norm), norm, x, relevance_out)
        assert relative_error(relevance, relevance_out) <= 1e-12

    @pytest.mark.parametrize(
        "make", [lambda: nn.Linear(2, 2), lambda: ConvNormAct(nn.Conv2d(1, 1, 1)), lambda: nn.ReLU()]
    )
    def test_not_norms(self, make):
        assert not is_norm(make())

    @pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP"])
    def test_a_block_calling_a_child_norm_is_not_a_norm_itself(self, preset: str):
        """Funnel's embeddings call ``self.layer_norm(x)``: its forward names ``layer_norm``, the child that is the
        norm (and gets the rule), not ``F.layer_norm``. Mapped to a norm rule itself, the block raised that its
        forward ran no normalisation. The block explains as its norm does."""
        block, x, relevance_out = NormedEmbeddings(4).double().eval(), randn(3, 4), randn(3, 4)
        assert not is_norm(block) and is_norm(block.layer_norm)
        relevance = {}
        for name, module in (("block", block), ("norm", block.layer_norm)):
            mapper = {"AttnLRP": AttnLRP, "CPLRP": CPLRP}[preset]()
            lrp = LRP(module, mapper, in_keys=["x"], out_keys=["y"], target=lambda y: relevance_out)
            relevance[name] = lrp(TensorDict(x=x, batch_size=[3]))
        assert torch.equal(relevance["block"]["relevance", "x"], relevance["norm"]["relevance", "x"])

    @pytest.mark.parametrize("preset", [*sorted(CNN_PRESETS), "AttnLRP", "CPLRP"])
    def test_a_module_named_like_a_norm_that_holds_one_is_not_a_norm_itself(self, preset: str):
        """PatchTST's ``PatchTSTBatchNorm`` (and PatchTSMixer's) transposes its input around a child
        ``nn.BatchNorm1d``: the child is the norm and gets the rule. Mapped to a norm rule by its name, the wrapper
        raised that its forward ran no normalisation, and no PatchTST with its default norm could be explained. It
        explains as its BatchNorm does on the transposed input."""
        from transformers import PatchTSTConfig
        from transformers.models.patchtst.modeling_patchtst import PatchTSTBatchNorm

        wrapper = PatchTSTBatchNorm(PatchTSTConfig(d_model=4)).double().eval()
        randomise_batch_norm(wrapper.batchnorm)
        x, relevance_out = randn(3, 5, 4), randn(3, 5, 4)
        assert not is_norm(wrapper) and is_norm(wrapper.batchnorm)
        relevance = {}
        for name, module, given, seed in (
            ("wrapper", wrapper, x, relevance_out),
            ("batch norm", wrapper.batchnorm, x.transpose(1, 2), relevance_out.transpose(1, 2)),
        ):
            mapper = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, **CNN_PRESETS}[preset]()
            lrp = LRP(nn.Sequential(module), mapper, in_keys=["x"], out_keys=["y"], target=lambda y, s=seed: s)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                relevance[name] = lrp(TensorDict(x=given.contiguous(), batch_size=[3]))["relevance", "x"]
        assert relative_error(relevance["wrapper"], relevance["batch norm"].transpose(1, 2)) <= 1e-12

    @pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP"])
    def test_a_block_whose_optional_norm_is_none_is_not_a_norm(self, preset: str):
        """ESM-2's embeddings name ``self.layer_norm``, left ``None``: no call of ``F.layer_norm``. Mapped to a norm
        rule, the block was reported as a module that did not run in every call. It passes relevance on as the
        identity it computes in eval mode."""
        block, x, relevance_out = NormedEmbeddings(4, norm=False).double().eval(), randn(3, 4), randn(3, 4)
        assert not is_norm(block)
        mapper = {"AttnLRP": AttnLRP, "CPLRP": CPLRP}[preset]()
        lrp = LRP(nn.Sequential(block), mapper, in_keys=["x"], out_keys=["y"], target=lambda y: relevance_out)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            relevance = lrp(TensorDict(x=x, batch_size=[3]))["relevance", "x"]
        assert torch.equal(relevance, relevance_out)

    @pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP", "EpsilonPlus"])
    def test_convnext_v2s_global_response_norm_is_explained_as_timms(self, preset: str):
        """Hugging Face's ``ConvNextV2GRN`` computes timm's ``GlobalResponseNorm`` (``x + w · x · ‖x‖ / mean ‖x‖ + b``)
        under a name that ends in ``GRN``: its scale is held as timm's is (it kept its plain gradient, with a
        warning, and CP-LRP was 1.5 times the logit off on a tiny ConvNeXt V2)."""
        from timm.layers.grn import GlobalResponseNorm
        from transformers.models.convnextv2.modeling_convnextv2 import ConvNextV2GRN

        grn, reference = ConvNextV2GRN(4).double(), GlobalResponseNorm(4, eps=1e-6).double()
        with torch.no_grad():
            reference.weight.copy_(randn(4))
            grn.weight.copy_(reference.weight.view(1, 1, 1, 4))
        x, relevance_out = randn(2, 3, 3, 4), randn(2, 3, 3, 4)
        assert is_norm(grn)
        torch.testing.assert_close(grn(x), reference(x))
        relevance = {}
        for name, module in (("hugging face", grn), ("timm", reference)):
            mapper = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, **CNN_PRESETS}[preset]()
            lrp = LRP(nn.Sequential(module), mapper, in_keys=["x"], out_keys=["y"], target=lambda y: relevance_out)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                relevance[name] = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
        assert relative_error(relevance["hugging face"], relevance["timm"]) <= 1e-12

    @pytest.mark.parametrize("preset", [*sorted(CNN_PRESETS), "AttnLRP", "CPLRP"])
    def test_an_input_scaling_named_like_a_norm_is_explained_as_under_any_other_name(self, preset: str):
        """A user's normaliser of raw inputs by constants, ``(x - 0.5) / 0.25`` or ``(x - self.mean) / self.std``,
        named ``InputNorm``: its forward names nothing but numbers (operators on its input and numbers) and cannot
        compute a normalising scale. Mapped to a norm rule by its name, the call raised that its forward ran no
        normalisation; under another name it passed. It explains as the same module under another name, before a
        convolution and its ReLU."""
        assert not is_norm(InputNorm()) and not is_norm(StatisticsNorm()) and is_norm(ClosureNorm())
        relevance = _relevance_before_a_convolution([InputNorm(), StatisticsNorm(), InputScaling()], preset)
        assert torch.equal(relevance[0], relevance[2]) and torch.equal(relevance[1], relevance[2])

    @pytest.mark.parametrize("form", ["view", "methods", "constants"])
    @pytest.mark.parametrize("preset", [*sorted(CNN_PRESETS), "AttnLRP", "CPLRP"])
    def test_a_per_channel_input_scaling_named_like_a_norm_is_explained_as_under_any_other_name(
        self, preset: str, form: str
    ):
        """ImageNet's preprocessing in a module named ``ChannelNorm``, written with views of its buffers, with tensor
        methods, or with constants of its code's module: reshaping, converting and arithmetic element by element
        compute no normalising scale. Mapped to a norm rule by its name, each raised that its forward ran no
        normalisation; it explains as the same module under another name."""
        assert not is_norm(ChannelNorm(form))
        relevance = _relevance_before_a_convolution([ChannelNorm(form), ChannelScaling(form)], preset)
        assert torch.equal(relevance[0], relevance[1])

    @pytest.mark.parametrize("preset", [*sorted(CNN_PRESETS), "AttnLRP", "CPLRP"])
    def test_a_norm_called_as_a_function_is_one_whatever_its_name(self, preset: str):
        """A forward calling ``F.instance_norm`` is a norm under any class name: with a name that is no ``*Norm`` it
        kept its plain gradient (the norm's scale invariance then left almost no relevance: -4.5e-6 for a logit of
        -3.14). A root alone (``sign(x) · sqrt(|x|)``) stays an activation."""
        assert is_norm(Whitening()) and not is_norm(SignedSqrt())
        tail = nn.Linear(6, 2)
        relevance = [
            _explain_after_a_linear_layer(norm(), copy.deepcopy(tail), preset=preset)["relevance", "x"]
            for norm in (Whitening, WhiteningNorm)
        ]
        assert torch.equal(relevance[0], relevance[1])

    @pytest.mark.parametrize("preset", [*sorted(CNN_PRESETS), "AttnLRP", "CPLRP"])
    def test_scales_with_one_value_per_element_that_are_no_activation_of_the_input_are_held(self, preset: str):
        """Roots with as many elements as the input that are not taken of it element by element stay normalising
        scales: a divisive normalisation's (of its neighbours), one of buffers (a BatchNorm written by hand, explained
        on one sample as on a batch), one of a statistic computed apart. A root of a number beside a sum
        (``math.sqrt(d)``) makes no norm."""
        assert not is_norm(ScaledDotScore())
        torch.manual_seed(0)
        x = torch.randn(5, 4, dtype=F64)
        for norm in (DivisiveNorm(), RunningStatisticsNorm(), GivenStatisticsNorm()):
            model = nn.Sequential(nn.Linear(4, 6), norm, nn.Linear(6, 2)).double()
            mapper = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, **CNN_PRESETS}[preset]()
            lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
            batch, single = (lrp(TensorDict(x=value, batch_size=value.shape[:1])) for value in (x, x[:1]))
            assert torch.isfinite(batch["relevance", "x"]).all(), type(norm).__name__
            torch.testing.assert_close(single["relevance", "x"], batch["relevance", "x"][:1], rtol=1e-10, atol=1e-12)

    def test_a_divisive_normalisations_scale_is_held_under_lrp0(self):
        """LRP-0 through a divisive normalisation is gradient × input with its root of the neighbours' squares held
        constant (detached): the root is a scale, though it has one value per element."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), DivisiveNorm(), nn.Linear(6, 2)).double()
        x = torch.randn(5, 4, dtype=F64)
        lrp = LRP(model, UniformEpsilon(0.0, stabilizer=1e-12), in_keys=["x"], out_keys=["y"])
        relevance = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
        leaf = x.clone().requires_grad_(True)
        h = model[0](leaf)
        scale = torch.rsqrt(F.avg_pool1d(h.unsqueeze(1) ** 2, 3, 1, 1).squeeze(1) + 1e-6).detach()
        (grad,) = torch.autograd.grad(model[2](h * scale).max(-1).values.sum(), leaf)
        assert relative_error(relevance, x * grad) <= 1e-9

    @pytest.mark.parametrize("preset", [*sorted(CNN_PRESETS), "AttnLRP", "CPLRP"])
    def test_a_root_taken_element_by_element_is_no_scale_to_hold(self, preset: str):
        """``sign(x) · sqrt(|x|)`` in a module named like a norm: its root has as many elements as its input, one per
        element, not per position. Held as a normalising scale, it made the output constant, and every input got no
        relevance, with no word; the rule now refuses it, naming the module."""
        with pytest.raises(ValueError, match="on PowerNorm: its forward ran no normalisation.*element by element"):
            _explain_after_a_linear_layer(PowerNorm(), nn.Linear(6, 2), preset=preset)

    @pytest.mark.parametrize("preset", [*sorted(CNN_PRESETS), "AttnLRP", "CPLRP"])
    def test_a_norm_that_returns_its_scale_is_refused_naming_it(self, preset: str):
        """A capsule's length, ``‖x‖``, in a module named like a norm: the rule holds the norm, the output is that
        held scale, and no relevance could reach the input. It was reported as a target that does not depend on
        the input, with no module named."""
        with pytest.raises(ValueError, match="on CapsuleNorm: its output is a scale its forward computes"):
            _explain_after_a_linear_layer(nn.Unflatten(-1, (2, 3)), CapsuleNorm(), preset=preset)

    @pytest.mark.parametrize("preset", [*sorted(CNN_PRESETS), "AttnLRP", "CPLRP"])
    def test_an_affine_map_named_like_a_norm_passes_relevance_as_its_plain_gradient(self, preset: str):
        """Its forward names nothing but its own tensors: no normalising scale to hold (the rule raised that it
        found none). Without bias, ``w · x`` gives each element its own relevance back."""
        module, x, relevance_out = NoNorm(4), randn(3, 4), randn(3, 4)
        assert not is_norm(module)
        mapper = {"AttnLRP": AttnLRP, "CPLRP": CPLRP, **CNN_PRESETS}[preset]()
        lrp = LRP(module, mapper, in_keys=["x"], out_keys=["y"], target=lambda y: relevance_out)
        relevance = lrp(TensorDict(x=x, batch_size=[3]))["relevance", "x"]
        assert relative_error(relevance, relevance_out) <= 1e-12

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    def test_presets_map_norms_to_the_rule(self, preset: str):
        mapper = CNN_PRESETS[preset]()
        assert type(mapper("n", nn.GroupNorm(2, 4))) is NormRule
        assert type(mapper("n", timm.layers.LayerNorm2d(4))) is NormRule
        assert type(mapper("n", nn.BatchNorm2d(4))) is MergeBatchNormRule
        assert type(mapper("n", timm.layers.BatchNormAct2d(4))) is MergeBatchNormRule


# ----------------------------------------------------------------------------- conservation in networks


def zero_biases(model: nn.Module) -> nn.Module:
    """Every bias zero, and the running means too: a BatchNorm's shift ``β − μ s`` is zero; so is the threshold
    ``τ`` of a thresholded linear unit, ``max(x, τ)``."""
    with torch.no_grad():
        for module in model.modules():
            for name in ("bias", "tau"):
                if getattr(module, name, None) is not None:
                    getattr(module, name).zero_()
            if getattr(module, "running_mean", None) is not None:
                module.running_mean.zero_()
    return model


def batch_norm_act(channels: int) -> nn.Module:
    norm = timm.layers.BatchNormAct2d(channels, act_layer=nn.LeakyReLU, act_kwargs={"negative_slope": 0.2})
    return randomise_batch_norm(norm)


CNN_NORMS = {
    "LayerNorm-CHW": lambda c: nn.LayerNorm([c, 8, 8]),
    "GroupNorm": lambda c: nn.GroupNorm(3, c),
    "InstanceNorm2d": lambda c: nn.InstanceNorm2d(c, affine=True),
    "LayerNorm2d-torchvision": lambda c: torchvision.models.convnext.LayerNorm2d(c),
    "LayerNorm2d-timm": lambda c: timm.layers.LayerNorm2d(c),
    "GroupNormAct-timm": lambda c: timm.layers.GroupNormAct(c, num_groups=2, act_layer=nn.LeakyReLU),
    "BatchNormAct2d-timm": batch_norm_act,
    # The filter response norm with its thresholded linear unit (timm's resnetv2_50d_frn): its scale is computed in
    # a helper function, out of the forward's sight, and its class is named after the unit (it passed no relevance).
    "FilterResponseNormTlu2d-timm": lambda c: timm.layers.FilterResponseNormTlu2d(c),
}
MLP_NORMS = {
    "LayerNorm": lambda n: nn.LayerNorm(n),
    "RMSNorm": lambda n: nn.RMSNorm(n, eps=1e-5),
    "LlamaRMSNorm": lambda n: LlamaRMSNorm(n),
    "GemmaRMSNorm": lambda n: GemmaRMSNorm(n),
    "VarMeanLayerNorm": lambda n: VarMeanLayerNorm(n),
    "L2Norm": lambda n: L2Norm(),
}
# The norms whose plain gradient does not conserve relevance (an eval-mode BatchNorm without shift is linear).
NOT_LINEAR = sorted(set(CNN_NORMS) - {"BatchNormAct2d-timm"}) + sorted(MLP_NORMS)


def norm_net(kind: str) -> tuple[nn.Module, torch.Tensor]:
    """A small network with two norms of ``kind``, its biases zero, and an input inside the ZBox bounds."""
    if kind in CNN_NORMS:
        make = CNN_NORMS[kind]
        layers = [nn.Conv2d(3, 6, 3, padding=1), make(6), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1), make(6)]
        layers += [nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, 4)]
        x = torch.randn(3, 3, 8, 8, dtype=F64).clamp(-2.9, 2.9)
    else:
        make = MLP_NORMS[kind]
        layers = [nn.Linear(5, 6), make(6), nn.ReLU(), nn.Linear(6, 6), make(6), nn.ReLU(), nn.Linear(6, 4)]
        x = torch.randn(3, 5, dtype=F64).clamp(-2.9, 2.9)
    model = nn.Sequential(*layers).double().eval()
    for module in model:
        if is_norm(module) and not isinstance(module, nn.modules.batchnorm._BatchNorm):
            randomise(module)
    return zero_biases(model), x


def conservation_error(model: nn.Module, x: torch.Tensor, rule_mapper) -> float:
    with torch.no_grad():
        relevance_out = torch.rand_like(model(x)) + 0.5
    relevance = lrp_relevance(model, x, relevance_out, rule_mapper)
    return relative_error(relevance.flatten(1).sum(1), relevance_out.sum(1))


class TestConservation:
    """With every bias zero, the rule conserves relevance through each norm, under every CNN preset."""

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("kind", sorted(CNN_NORMS) + sorted(MLP_NORMS))
    def test_zero_biases_conserve_relevance(self, kind: str, preset: str):
        model, x = norm_net(kind)
        assert conservation_error(model, x, CNN_PRESETS[preset](epsilon=0.0, stabilizer=1e-12)) <= 1e-9

    @pytest.mark.parametrize("kind", NOT_LINEAR)
    def test_the_plain_gradient_through_the_norm_is_not_conserved(self, kind: str):
        # What the conservation test tells apart: the norm differentiated as it is.
        model, x = norm_net(kind)
        norm_type = type(model[1])
        mapper = CNN_PRESETS["EpsilonPlus"](epsilon=0.0, stabilizer=1e-12, rule_mapper={norm_type: IgnoreRule()})
        assert conservation_error(model, x, mapper) > 1e-3


# ----------------------------------------------------------------------------- BatchNorm that is not merged


class AfterConcatenation(nn.Module):
    """Two rectified convolutions' outputs concatenated, then a BatchNorm: nothing to merge it into (over convolutions'
    outputs, and at most one other tensor, it is merged into each, see tests/attribution/rules/test_batch_norm.py)."""

    def __init__(self) -> None:
        super().__init__()
        self.left, self.right = nn.Conv2d(3, 2, 3, padding=1), nn.Conv2d(3, 2, 3, padding=1)
        self.norm = randomise_batch_norm(nn.BatchNorm2d(4))
        self.head = nn.Sequential(nn.ReLU(), nn.Conv2d(4, 3, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.cat([self.left(x).relu(), self.right(x).relu()], dim=1)))


def unmerged_net(where: str) -> tuple[nn.Module, torch.Tensor]:
    if where == "after-relu":
        norm = randomise_batch_norm(nn.BatchNorm2d(4))
        layers = [nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), norm, nn.Conv2d(4, 3, 3)]
        model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
    else:
        model = AfterConcatenation()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Conv2d):
                module.bias.normal_()
    return model.double().eval(), torch.randn(2, 3, 6, 6, dtype=F64).clamp(-2.9, 2.9)


class TestUnmergedBatchNorm:
    """An eval-mode BatchNorm with no layer right before it: the ε-rule of its affine map."""

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("where", ["after-relu", "after-cat"])
    def test_equals_the_epsilon_rule_mapped_on_it(self, where: str, preset: str):
        model, x = unmerged_net(where)
        relevance_out = torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, CNN_PRESETS[preset]())
        explicit = {nn.BatchNorm2d: EpsilonRule(1e-6)}
        expected = lrp_relevance(model, x, relevance_out, CNN_PRESETS[preset](rule_mapper=explicit))
        assert relative_error(actual, expected) <= 1e-12
        passed = lrp_relevance(model, x, relevance_out, CNN_PRESETS[preset](rule_mapper={nn.BatchNorm2d: PassRule()}))
        assert relative_error(passed, expected) > 1e-3  # the shift t matters: passing relevance on differs

    @pytest.mark.parametrize("where", ["after-relu", "after-cat"])
    def test_lrp0_is_gradient_times_input(self, where: str):
        model, x = unmerged_net(where)
        relevance_out = torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, BaseRuleMapper(stabilizer=0.0))
        expected = gradient_times_input(model, x, lambda out: relevance_out / out)
        assert relative_error(actual, expected) <= 1e-10
        stabilised = lrp_relevance(model, x, relevance_out, BaseRuleMapper(stabilizer=0.5))
        assert relative_error(stabilised, expected) > 1e-3


# ----------------------------------------------------------------------------- timm's BatchNormAct2d


def fused_net() -> nn.Sequential:
    layers = [nn.Conv2d(3, 6, 3, padding=1), batch_norm_act(6), nn.Conv2d(6, 4, 3), batch_norm_act(4)]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                module.bias.normal_()
    return model.double().eval()


def unfused(model: nn.Sequential, merge: bool = False) -> nn.Sequential:
    """``model`` with every ``BatchNormAct2d`` split into an ``nn.BatchNorm2d`` and an ``nn.LeakyReLU``; with
    ``merge``, the BatchNorm folded by hand into the convolution before it."""
    layers = []
    for module in copy.deepcopy(model):
        if isinstance(module, timm.layers.BatchNormAct2d):
            norm = nn.BatchNorm2d(module.num_features, eps=module.eps, dtype=F64).eval()
            norm.load_state_dict(module.state_dict())
            if merge:
                layers[-1] = merged_by_hand(layers[-1], norm)
            else:
                layers.append(norm)
            layers.append(nn.LeakyReLU(module.act.negative_slope))
        else:
            layers.append(module)
    return nn.Sequential(*layers)


class TestBatchNormAct:
    """timm's BatchNorm fused with an activation: merged into the convolution before it, its activation kept."""

    @pytest.mark.parametrize("preset", [*sorted(CNN_PRESETS), "BaseRuleMapper"])
    def test_equals_the_unfused_layers(self, preset: str):
        model = fused_net()
        plain = unfused(model)
        x = torch.randn(2, 3, 6, 6, dtype=F64).clamp(-2.9, 2.9)
        relevance_out = torch.randn(2, 3, dtype=F64)
        make = BaseRuleMapper if preset == "BaseRuleMapper" else CNN_PRESETS[preset]
        actual = lrp_relevance(model, x, relevance_out, make())
        expected = lrp_relevance(plain, x, relevance_out, make())
        assert relative_error(actual, expected) <= 1e-12
        # Both merged with the convolution before them: the network with the merged layers written by hand.
        by_hand = lrp_relevance(unfused(model, merge=True), x, relevance_out, make())
        assert relative_error(actual, by_hand) <= 1e-10
        # Not merged, the BatchNorms would give another answer.
        not_merged = lrp_relevance(plain, x, relevance_out, make(rule_mapper={nn.BatchNorm2d: NormRule(0.1)}))
        assert relative_error(not_merged, expected) > 1e-3

    def test_lrp0_is_gradient_times_input(self):
        model = fused_net()
        x = torch.randn(2, 3, 6, 6, dtype=F64)
        relevance_out = torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, BaseRuleMapper(stabilizer=0.0))
        expected = gradient_times_input(model, x, lambda out: relevance_out / out)
        assert relative_error(actual, expected) <= 1e-10


@pytest.mark.parametrize("rule", [NormRule, MergeBatchNormRule, LayerNormRule])
def test_a_negative_epsilon_is_refused_at_construction(rule):
    with pytest.raises(ValueError, match=f"{rule.__name__}: epsilon must be a finite number >= 0, got -1e-05"):
        rule(epsilon=-1e-5)
    assert rule(epsilon=0.0).epsilon == 0.0


# ----------------------------------------------------------------------------- torchrl's BatchRenorm1d


class Affine(nn.Module):
    """``y = s x + t`` per feature: what a BatchRenorm1d computes on one batch, its statistics held."""

    def __init__(self, scale: torch.Tensor, shift: torch.Tensor) -> None:
        super().__init__()
        self.scale, self.shift = scale, shift

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


class TestBatchRenorm:
    """torchrl's BatchRenorm1d (CrossQ's critics): in training mode it normalises with the batch's statistics,
    corrected by the running ones; held constant, it is an affine map per feature, as an eval-mode one is."""

    def net(self, training: bool) -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), BatchRenorm1d(6, warmup_steps=2), nn.ReLU(), nn.Linear(6, 3)).double()
        with torch.no_grad():
            model[1].weight.uniform_(0.5, 2.0)
            model[1].bias.normal_()
        for _ in range(3):  # past the warm-up: the correction r, d of the running statistics is on
            model(torch.randn(16, 4, dtype=F64))
        return model.train(training)

    def held(self, model: nn.Sequential, x: torch.Tensor) -> nn.Sequential:
        """``model`` with its BatchRenorm1d replaced by the affine map it computes on ``x``'s batch."""
        h = model[0](x)
        y = copy.deepcopy(model[1])(h)
        hc, yc = h - h.mean(0), y - y.mean(0)
        scale = (hc * yc).sum(0) / (hc * hc).sum(0)
        return nn.Sequential(model[0], Affine(scale.detach(), (y.mean(0) - scale * h.mean(0)).detach()), *model[2:])

    @pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
    def test_lrp0_is_gradient_times_input_with_the_statistics_held(self, training: bool):
        model, x = self.net(training), torch.randn(8, 4, dtype=F64)
        expected = gradient_times_input(self.held(model, x), x, argmax_one_hot)
        plain = copy.deepcopy(model)
        plain_out = plain(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no call without a rule
            lrp = LRP(model, BaseRuleMapper(stabilizer=1e-12), in_keys=["x"], out_keys=["y"])
            out = lrp(TensorDict(x=x.clone(), batch_size=[8]))
        assert relative_error(out["relevance", "x"], expected) <= 1e-10
        assert torch.equal(out["y"], plain_out)
        # The call updates the running statistics once, as the module's own call does.
        for name, buffer in model[1].named_buffers():
            assert torch.equal(buffer, dict(plain[1].named_buffers())[name]), name

    def test_the_epsilon_rule_of_its_affine_map(self):
        model, x = self.net(False), torch.randn(8, 4, dtype=F64)
        relevance_out = torch.randn(8, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, BaseRuleMapper(stabilizer=0.5))
        expected = lrp_relevance(self.held(model, x), x, relevance_out, {Affine: EpsilonRule(0.5)})
        assert relative_error(actual, expected) <= 1e-10


class TestNormsUnderVmap:
    """Under ``torch.vmap`` a norm's input reports no gradient: a fused norm (``F.layer_norm``, ``F.rms_norm``)
    kept its plain gradient silently (47 % off a LayerNorm's relevance, 52 % off an RMSNorm's). It is refused
    naming the module; a norm written out, whose held scale needs no gradient to be seen, keeps its relevance."""

    class Vmapped(nn.Module):
        def __init__(self, norm: nn.Module, vmapped: bool) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.inp, self.norm, self.out = nn.Linear(4, 6).to(F64), norm.to(F64), nn.Linear(6, 3).to(F64)
            self.vmapped = vmapped

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out((torch.vmap(self.norm) if self.vmapped else self.norm)(self.inp(x)))

    class WrittenOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.linspace(0.5, 1.5, 6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)

    @pytest.mark.parametrize("norm", [nn.LayerNorm, nn.RMSNorm], ids=["LayerNorm", "RMSNorm"])
    @pytest.mark.parametrize("mapper", [AttnLRP, BaseRuleMapper], ids=["AttnLRP", "BaseRuleMapper"])
    def test_a_fused_norm_is_refused_naming_the_module(self, norm, mapper):
        lrp = LRP(self.Vmapped(norm(6), vmapped=True), mapper(), in_keys=["x"], out_keys=["y"])
        with pytest.raises(RuntimeError, match=rf"module {norm.__name__} runs under torch.vmap") as info:
            lrp(TensorDict(x=randn(5, 3, 4), batch_size=[5]))
        assert any("'norm'" in note for note in info.value.__notes__)

    def test_a_batch_renorm_is_refused_naming_the_module(self):
        lrp = LRP(self.Vmapped(BatchRenorm1d(6), vmapped=True).eval(), BaseRuleMapper(), in_keys=["x"], out_keys=["y"])
        with pytest.raises(RuntimeError, match=r"module 'norm' \(BatchRenorm1d\) runs under torch.vmap"):
            lrp(TensorDict(x=randn(5, 3, 4), batch_size=[5]))

    def test_a_written_out_norm_keeps_its_relevance(self):
        x = TensorDict(x=randn(5, 3, 4), batch_size=[5])
        norm = self.WrittenOut()
        plain = LRP(self.Vmapped(norm, vmapped=False), AttnLRP(), in_keys=["x"], out_keys=["y"])(x.clone())
        vmapped = LRP(self.Vmapped(norm, vmapped=True), AttnLRP(), in_keys=["x"], out_keys=["y"])(x.clone())
        assert relative_error(vmapped["relevance", "x"], plain["relevance", "x"]) <= 1e-12


class ImagePolicy(nn.Module):
    """An Atari-style policy: integer pixels cast in its forward, then a convolution and a BatchNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(144, 3))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self.net(pixels.float() / 255)


@pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
def test_integer_pixels_before_a_merged_batch_norm_get_the_inputs_error(preset: str):
    # The BatchNorm merged into the convolution saw an input of the weights' gradient alone, and its rule raised that
    # its output was a scale it held ("map the module to another rule"), the integer key told only in a note.
    torch.manual_seed(0)
    lrp = LRP(ImagePolicy().eval(), CNN_PRESETS[preset](), in_keys=["pixels"], out_keys=["y"])
    pixels = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"input key 'pixels' holds integer tokens \(torch.uint8\)"):
        lrp(TensorDict(pixels=pixels, batch_size=[2]))


# ----------------------------------------------------------------------------- norms inside a router


class ScaleFreeRMSNorm(nn.Module):
    """An RMS norm without a weight, its scale a power -0.5 (Gemma 4's router norm)."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.pow(h.pow(2).mean(-1, keepdim=True) + 1e-6, -0.5)


class ByHandBatchNorm1d(nn.BatchNorm1d):
    """A BatchNorm whose forward computes ``x * scale + shift`` by hand (no ``F.batch_norm`` call)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.running_mean) * torch.rsqrt(self.running_var + self.eps) * self.weight + self.bias


class Frozen(nn.Module):
    """torchvision's ``FrozenBatchNorm2d`` over features given as ``(rows, features)``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torchvision.ops.FrozenBatchNorm2d(8).to(F64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.norm(h[..., None, None])[..., 0, 0]


ROUTER_NORMS = {
    "RMS norm": ScaleFreeRMSNorm,
    "BatchNorm by hand": lambda: ByHandBatchNorm1d(8, dtype=F64).eval(),
    "frozen BatchNorm": Frozen,
}


class NormedRouter(nn.Module):
    """A mixture's router that normalises its input before scoring the experts: the presets hold its outputs."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm
        self.weight = nn.Parameter(randn(4, 8))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.topk(torch.softmax(F.linear(self.norm(h), self.weight), -1), 2, dim=-1)


class Mixture(nn.Module):
    """Two of four bias-free experts per row, weighted by the router, beside a residual."""

    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.router = router
        self.experts = nn.ModuleList(nn.Linear(8, 8, bias=False, dtype=F64) for _ in range(4))
        self.out = nn.Linear(8, 3, bias=False, dtype=F64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, index = self.router(x)
        every = torch.stack([expert(x) for expert in self.experts], 1)
        rows = torch.arange(x.shape[0])
        mixed = sum(weights[:, k, None] * every[rows, index[:, k]] for k in range(2))
        return self.out(mixed + x)


class HeldRouter(nn.Module):
    """The router's outputs detached: the oracle of its rule."""

    def __init__(self, router: nn.Module) -> None:
        super().__init__()
        self.inner = router

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights, index = self.inner(h)
        return weights.detach(), index


@pytest.mark.parametrize("norm", sorted(ROUTER_NORMS))
@pytest.mark.parametrize("preset", [AttnLRP, CPLRP])
def test_a_norm_inside_a_router_needs_no_rule_of_its_own(preset, norm: str):
    """The router's rule holds its outputs, and pauses the function modes inside it, the norm's own mode too: the
    norm's rule saw none of its calls and refused it as computing no normalisation it knows (Gemma 4's router, in
    every call; a BatchNorm as computing no ``F.batch_norm`` or no ``x * scale + shift``). Nothing inside a held
    router reaches the relevance: with bias-free experts, it is gradient × input of the mixture with the routing
    weights detached."""
    torch.manual_seed(0)
    model, x = Mixture(NormedRouter(ROUTER_NORMS[norm]())), randn(5, 8)
    name, inner = [(name, m) for name, m in model.router.named_modules() if name.endswith("norm")][-1]
    assert isinstance(preset()(name, inner), NormRule)  # the innermost: the norm itself
    lrp = LRP(model, preset(), in_keys=["x"], out_keys=["y"])  # the argmax explained
    relevance = lrp(TensorDict(x=x.clone(), batch_size=[5]))["relevance", "x"]
    held = copy.deepcopy(model)
    held.router = HeldRouter(held.router)
    expected = gradient_times_input(held, x, argmax_one_hot(model(x)))
    assert relative_error(relevance, expected) <= 1e-5, relative_error(relevance, expected)
