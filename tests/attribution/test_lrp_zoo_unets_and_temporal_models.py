"""Networks written in torch that diffusion and audio models are made of, against oracles that share no code with the
rules (float64, batch 2).

1. A diffusion-style U-Net: GroupNorm, SiLU, a sinusoidal time embedding through an MLP added in every residual block,
   a strided down-sampling convolution, a self-attention block (``softmax`` written out or
   ``F.scaled_dot_product_attention``), nearest or bilinear up-sampling and a skip concatenation. CP-LRP leaves the
   output and the ``state_dict`` as they were, warns of nothing, and equals the gradient × input of the same U-Net
   with its norms' scales, its SiLU ratios ``f(x) / x`` and its attention weights detached; with its biases and the
   time embedding's output layer zeroed (the embedding is a constant added to the signal) it conserves the logit.
   The CNN presets have no rule for the attention block and name it (a warning; an error for
   ``nn.MultiheadAttention``).
2. A temporal convolutional network: causal depth-wise dilated convolutions (padded on the left), point-wise
   convolutions into a GLU, residual sums, a convolution padded on both sides and chomped, weight norms as
   parametrizations or as the older ``torch.nn.utils.weight_norm``. EpsilonPlus and EpsilonAlpha2Beta1 equal zennit's
   composites on the same network with its weight norms folded into plain weights, its residual sums as zennit's
   ``Sum`` under ``Norm`` (``stabilize_additions=True`` in tdhook) and the GLU's gate held under ``Pass``; LRP-0
   conserves the logit with the biases zeroed.
3. CNN-LSTM and CNN-GRU classifiers (convolution, BatchNorm, ReLU, max pooling, then the recurrence): LRP-0 equals the
   gradient × input of the same network with its recurrence written as a loop whose gates are detached and whose
   ``tanh`` passes relevance on (signal-take-all). A tanh RNN, which no rule covers, is named in a warning.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from torch.nn.utils import parametrizations

from tdhook.attribution import CPLRP, LRP, AttnLRP
from tdhook.attribution.lrp_helpers.rules import EpsilonAlpha2Beta1, EpsilonPlus
from tdhook.attribution.mappers.base import BaseRuleMapper
from tests.conftest import relative_error, zennit_model_relevance

zennit = pytest.importorskip("zennit")

from zennit import composites as zcomposites  # noqa: E402
from zennit.layer import Sum  # noqa: E402
from zennit.rules import Pass  # noqa: E402

F64 = torch.float64
BATCH = 2


def explain(model: nn.Module, x: torch.Tensor, mapper) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The relevance of ``x``, the output and the warnings of one call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        td = LRP(model, mapper, in_keys=["x"], out_keys=["y"])(TensorDict(x=x.clone(), batch_size=[BATCH]))
    return td["relevance", "x"], td["y"], [str(w.message) for w in caught]


def gradient_times_input(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(leaf).gather(1, target[:, None]).sum(), leaf)
    return x * grad


def conservation_error(relevance: torch.Tensor, output: torch.Tensor) -> float:
    logit = output.max(-1).values
    return ((relevance.flatten(1).sum(1) - logit).abs() / logit.abs()).max().item()


def passed_on(f, x: torch.Tensor) -> torch.Tensor:
    """``f(x)`` with the ratio ``f(x) / x`` detached: its gradient × input passes the output's relevance on."""
    return x * (f(x) / x).detach()


def zero_biases(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
    return model


# --- 1. A diffusion-style U-Net ----------------------------------------------------------------------------------


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    freqs = torch.exp(-math.log(10000.0) * torch.arange(dim // 2, dtype=t.dtype) / (dim // 2))
    angles = t[:, None] * freqs[None]
    return torch.cat([angles.cos(), angles.sin()], -1)


class HeldGroupNorm(nn.Module):
    """A GroupNorm with its standard deviation detached (the oracle's)."""

    def __init__(self, norm: nn.GroupNorm) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grouped = x.reshape(x.shape[0], self.norm.num_groups, -1)
        centred = grouped - grouped.mean(-1, keepdim=True)
        std = (centred.pow(2).mean(-1, keepdim=True) + self.norm.eps).sqrt().detach()
        channels = (1, -1) + (1,) * (x.dim() - 2)
        return (centred / std).reshape(x.shape) * self.norm.weight.reshape(channels) + self.norm.bias.reshape(channels)


class PassedSiLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return passed_on(F.silu, x)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, tdim: int) -> None:
        super().__init__()
        self.norm1, self.conv1 = nn.GroupNorm(4, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.time = nn.Linear(tdim, cout)
        self.norm2, self.conv2 = nn.GroupNorm(4, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.act, self.dropout = nn.SiLU(), nn.Dropout(0.1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        h = self.conv1(self.act(self.norm1(x))) + self.time(self.act(temb))[:, :, None, None]
        return self.skip(x) + self.conv2(self.dropout(self.act(self.norm2(h))))


class AttentionBlock(nn.Module):
    """Self-attention over the pixels; ``kind``: ``"eager"`` (softmax written out), ``"sdpa"``, ``"mha"``
    (``nn.MultiheadAttention``) or ``"held"`` (the oracle's: softmax written out and detached)."""

    def __init__(self, channels: int, kind: str) -> None:
        super().__init__()
        self.kind, self.norm = kind, nn.GroupNorm(4, channels)
        if kind == "mha":
            self.mha = nn.MultiheadAttention(channels, 2, batch_first=True)
        else:
            self.q, self.k, self.v = (nn.Conv2d(channels, channels, 1) for _ in range(3))
        self.proj = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, height, width = x.shape
        h = self.norm(x)
        if self.kind == "mha":
            tokens = h.flatten(2).transpose(1, 2)
            out = self.mha(tokens, tokens, tokens, need_weights=False)[0]
        else:
            q, k, v = (layer(h).flatten(2).transpose(1, 2) for layer in (self.q, self.k, self.v))
            if self.kind == "sdpa":
                out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None])[:, 0]
            else:
                weights = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(c), -1)
                out = (weights.detach() if self.kind == "held" else weights) @ v
        return x + self.proj(out.transpose(1, 2).reshape(b, c, height, width))


class TinyUNet(nn.Module):
    """Input convolution, a residual block, a strided down-sampling, a residual block with attention, a middle
    block, up-sampling and a convolution, the skip concatenated, a residual block, an output head; the flattened
    output image is explained (its largest pixel)."""

    def __init__(self, attention: str, upsample: str, tdim: int = 16) -> None:
        super().__init__()
        self.tdim, self.upsample = tdim, upsample
        self.register_buffer("t", torch.tensor([3.0, 40.0]))
        self.temb = nn.Sequential(nn.Linear(tdim, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.conv_in = nn.Conv2d(3, 8, 3, padding=1)
        self.block1 = ResBlock(8, 8, tdim)
        self.down = nn.Conv2d(8, 8, 3, stride=2, padding=1)
        self.block2, self.attention = ResBlock(8, 16, tdim), AttentionBlock(16, attention)
        self.middle = ResBlock(16, 16, tdim)
        self.up_conv = nn.Conv2d(16, 16, 3, padding=1)
        self.block3 = ResBlock(24, 8, tdim)
        self.norm_out, self.act, self.conv_out = nn.GroupNorm(4, 8), nn.SiLU(), nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        temb = self.temb(timestep_embedding(self.t.to(x.dtype), self.tdim))
        skip = self.block1(self.conv_in(x), temb)
        h = self.middle(self.attention(self.block2(self.down(skip), temb)), temb)
        align = None if self.upsample == "nearest" else False
        h = self.up_conv(F.interpolate(h, scale_factor=2, mode=self.upsample, align_corners=align))
        h = self.block3(torch.cat([h, skip], 1), temb)
        return self.conv_out(self.act(self.norm_out(h))).flatten(1)


def unet(attention: str, upsample: str = "nearest") -> TinyUNet:
    torch.manual_seed(0)
    model = TinyUNet(attention, upsample).to(F64).eval()
    with torch.no_grad():  # norm scales away from one
        for name, parameter in model.named_parameters():
            if parameter.dim() == 1 and name.endswith("weight"):
                parameter.add_(0.3 * torch.randn_like(parameter))
    return model


def held_unet(model: TinyUNet) -> TinyUNet:
    """The U-Net CP-LRP explains by its gradient: norms' scales, SiLU ratios and attention weights detached."""
    held = copy.deepcopy(model)
    for parent in list(held.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.GroupNorm):
                setattr(parent, name, HeldGroupNorm(child))
            elif isinstance(child, nn.SiLU):
                setattr(parent, name, PassedSiLU())
    held.attention.kind = "held"
    return held


def unet_input() -> torch.Tensor:
    return torch.randn(BATCH, 3, 8, 8, dtype=F64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("upsample", ["nearest", "bilinear"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
class TestDiffusionUNet:
    def test_cplrp_is_gradient_times_input_with_the_held_quantities_detached(self, attention: str, upsample: str):
        model, x = unet(attention, upsample), unet_input()
        plain = model(x)
        state = {key: value.clone() for key, value in model.state_dict().items()}
        relevance, output, caught = explain(model, x, CPLRP())
        assert caught == []
        assert torch.equal(output, plain)
        assert all(torch.equal(state[key], value) for key, value in model.state_dict().items())
        expected = gradient_times_input(held_unet(model), x, output.argmax(-1))
        assert relative_error(relevance, expected) <= 1e-7
        plain_gradient = gradient_times_input(model, x, output.argmax(-1))
        assert relative_error(relevance, plain_gradient) > 0.01  # the held quantities matter

    def test_cplrp_conserves_with_biases_and_the_time_embedding_zeroed(self, attention: str, upsample: str):
        model = zero_biases(unet(attention, upsample))
        with torch.no_grad():
            model.temb[2].weight.zero_()  # the time embedding adds a constant to every block
        relevance, output, _ = explain(model, unet_input(), CPLRP())
        assert conservation_error(relevance, output) <= 1e-6


@pytest.mark.parametrize("attention, called", [("eager", "matmul, softmax"), ("sdpa", "scaled_dot_product_attention")])
def test_the_cnn_presets_name_the_attention_of_a_unet(attention: str, called: str):
    relevance, _, caught = explain(unet(attention), unet_input(), EpsilonPlus())
    assert torch.isfinite(relevance).all()
    assert any(f"module 'attention' (AttentionBlock) computes {called}" in message for message in caught), caught


def test_the_cnn_presets_refuse_the_multihead_attention_of_a_unet():
    with pytest.raises(ValueError, match="'attention.mha' \\(MultiheadAttention\\).*no rule for attention"):
        explain(unet("mha"), unet_input(), EpsilonPlus())


# --- 2. A temporal convolutional network -------------------------------------------------------------------------


class HeldGate(nn.Module):
    """Multiplies by the gate set before each call (zennit's oracle of a GLU with its gate held)."""

    gate: torch.Tensor

    def forward(self, a: torch.Tensor) -> torch.Tensor:
        return a * self.gate


def weight_normed(layer: nn.Module, kind: str | None) -> nn.Module:
    if kind == "parametrization":
        return parametrizations.weight_norm(layer)
    if kind == "hook":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # torch.nn.utils.weight_norm is deprecated
            return torch.nn.utils.weight_norm(layer)
    return layer


class CausalBlock(nn.Module):
    """``x + glu(pw(relu(dw(pad_left(x)))))``; ``oracle`` switches to zennit's form (``Sum``, the gate held)."""

    def __init__(self, channels: int, dilation: int, norm: str | None) -> None:
        super().__init__()
        self.pad = 2 * dilation
        self.depthwise = weight_normed(nn.Conv1d(channels, channels, 3, dilation=dilation, groups=channels), norm)
        self.pointwise = weight_normed(nn.Conv1d(channels, 2 * channels, 1), norm)
        self.relu, self.glu = nn.ReLU(), nn.GLU(dim=1)
        self.sum, self.gate, self.oracle = Sum(), HeldGate(), False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pointwise(self.relu(self.depthwise(F.pad(x, (self.pad, 0)))))
        if not self.oracle:
            return x + self.glu(h)
        a, b = h.chunk(2, 1)
        self.gate.gate = torch.sigmoid(b).detach()
        return self.sum(torch.stack([x, self.gate(a)], -1))


class TemporalConvNet(nn.Module):
    def __init__(self, norm: str | None) -> None:
        super().__init__()
        self.conv_in = nn.Conv1d(3, 8, 1)
        self.blocks = nn.Sequential(CausalBlock(8, 1, norm), CausalBlock(8, 2, norm))
        self.chomped = nn.Conv1d(8, 8, 3, padding=2)
        self.relu, self.head = nn.ReLU(), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.chomped(self.blocks(self.conv_in(x)))[..., :-2])
        return self.head(h[..., -1])


def temporal_conv_net(norm: str | None) -> TemporalConvNet:
    torch.manual_seed(0)
    return TemporalConvNet(norm).to(F64).eval()


def folded(model: TemporalConvNet) -> TemporalConvNet:
    """The same network with plain weights (its weight norms computed once) in zennit's form."""
    plain = temporal_conv_net(None)
    with torch.no_grad():
        for name, layer in plain.named_modules():
            if isinstance(layer, nn.Conv1d):
                layer.weight.copy_(model.get_submodule(name).weight)
    for block in plain.blocks:
        block.oracle = True
    return plain


def temporal_input() -> torch.Tensor:
    return torch.randn(BATCH, 3, 12, dtype=F64, generator=torch.Generator().manual_seed(1))


TCN_PRESETS = {
    "EpsilonPlus": (EpsilonPlus, zcomposites.EpsilonPlus),
    "EpsilonAlpha2Beta1": (EpsilonAlpha2Beta1, zcomposites.EpsilonAlpha2Beta1),
}


@pytest.mark.parametrize("norm", [None, "parametrization", "hook"])
class TestTemporalConvNet:
    @pytest.mark.parametrize("preset", sorted(TCN_PRESETS))
    def test_equals_zennit_with_the_weight_norms_folded(self, norm: str | None, preset: str):
        model, x = temporal_conv_net(norm), temporal_input()
        plain = model(x)
        state = {key: value.clone() for key, value in model.state_dict().items()}
        ours, theirs = TCN_PRESETS[preset]
        relevance, output, caught = explain(model, x, ours(stabilize_additions=True))
        assert caught == []
        assert torch.equal(output, plain)
        assert all(torch.equal(state[key], value) for key, value in model.state_dict().items())
        oracle = folded(model)
        assert torch.allclose(oracle(x), plain)
        expected = zennit_model_relevance(theirs(layer_map=[(HeldGate, Pass())]), oracle, x)
        assert relative_error(relevance, expected) <= 1e-10

    def test_lrp0_conserves_with_biases_zeroed(self, norm: str | None):
        relevance, output, _ = explain(zero_biases(temporal_conv_net(norm)), temporal_input(), BaseRuleMapper(1e-12))
        assert conservation_error(relevance, output) <= 1e-10


# --- 3. CNN-LSTM and CNN-GRU -------------------------------------------------------------------------------------


class ConvRecurrent(nn.Module):
    """Convolution, BatchNorm, ReLU, max pooling over time, a recurrence, a linear head on its last step."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.held = kind, False
        self.conv, self.norm = nn.Conv1d(3, 6, 3, padding=1), nn.BatchNorm1d(6)
        self.relu, self.pool = nn.ReLU(), nn.MaxPool1d(2)
        self.rnn = getattr(nn, kind)(6, 5, batch_first=True)
        self.head = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pool(self.relu(self.norm(self.conv(x)))).transpose(1, 2)
        return self.head((self.held_loop(h) if self.held else self.rnn(h)[0])[:, -1])

    def held_loop(self, h: torch.Tensor) -> torch.Tensor:
        """The recurrence with its gates detached and its ``tanh`` passing relevance on."""
        rnn, size = self.rnn, self.rnn.hidden_size
        state, cell, outputs = h.new_zeros(h.shape[0], size), h.new_zeros(h.shape[0], size), []
        for t in range(h.shape[1]):
            gi = h[:, t] @ rnn.weight_ih_l0.T + rnn.bias_ih_l0
            gh = state @ rnn.weight_hh_l0.T + rnn.bias_hh_l0
            if self.kind == "LSTM":
                i, f, g, o = (gi + gh).chunk(4, -1)
                i, f, o = (torch.sigmoid(gate).detach() for gate in (i, f, o))
                cell = f * cell + i * passed_on(torch.tanh, g)
                state = o * passed_on(torch.tanh, cell)
            else:
                r = torch.sigmoid(gi[:, :size] + gh[:, :size]).detach()
                z = torch.sigmoid(gi[:, size : 2 * size] + gh[:, size : 2 * size]).detach()
                state = (1 - z) * passed_on(torch.tanh, gi[:, 2 * size :] + r * gh[:, 2 * size :]) + z * state
            outputs.append(state)
        return torch.stack(outputs, 1)


def conv_recurrent(kind: str) -> ConvRecurrent:
    torch.manual_seed(0)
    model = ConvRecurrent(kind).to(F64).train()
    with torch.no_grad():  # BatchNorm statistics of random batches
        model(torch.randn(8, 3, 10, dtype=F64))
    return model.eval()


def recurrent_input() -> torch.Tensor:
    return torch.randn(BATCH, 3, 10, dtype=F64, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["LSTM", "GRU"])
def test_lrp0_on_a_cnn_recurrent_classifier_is_the_signal_take_all_loop(kind: str):
    model, x = conv_recurrent(kind), recurrent_input()
    plain = model(x)
    relevance, output, caught = explain(model, x, BaseRuleMapper(1e-12))
    assert caught == []
    assert torch.equal(output, plain)
    held = copy.deepcopy(model)
    held.held = True
    assert torch.allclose(held(x), plain)
    assert relative_error(relevance, gradient_times_input(held, x, output.argmax(-1))) <= 1e-8


def test_a_tanh_rnn_in_a_cnn_is_named():
    relevance, _, caught = explain(conv_recurrent("RNN"), recurrent_input(), EpsilonPlus())
    assert torch.isfinite(relevance).all()
    assert any("module 'rnn' (RNN) computes rnn_tanh" in message for message in caught), caught


# --- 4. Conditioning computed from constants ---------------------------------------------------------------------


class FiLMConditioned(nn.Module):
    """``conv(x) · scale + shift`` (``· (1 + scale)`` with ``plus_one``), ``scale`` and ``shift`` from a time
    embedding ``linear(act(linear(sinusoid(t))))`` of a fixed time step (a buffer): a constant of the explained input,
    computed from parameters alone, as diffusion U-Nets condition their blocks. ``act`` an activation or norm
    module."""

    def __init__(self, act: nn.Module, plus_one: bool, tdim: int = 8) -> None:
        super().__init__()
        self.tdim, self.plus_one = tdim, plus_one
        self.register_buffer("t", torch.tensor([3.0, 40.0]))
        self.embed, self.act, self.project = nn.Linear(tdim, tdim), act, nn.Linear(tdim, 8)
        self.conv_in, self.conv_out = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        temb = self.embed(timestep_embedding(self.t.to(x.dtype), self.tdim))
        scale, shift = self.project(self.act(temb))[:, :, None, None].chunk(2, 1)
        h = self.conv_in(x)
        h = h * (1 + scale) + shift if self.plus_one else h * scale + shift
        return self.conv_out(h).flatten(1)


class Swish(nn.Module):
    """An activation written by hand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(x)


ACTIVATIONS_OF_A_CONSTANT = {
    "SiLU": nn.SiLU,
    "GELU": nn.GELU,
    "Tanh": nn.Tanh,
    "Sigmoid": nn.Sigmoid,
    "ReLU": nn.ReLU,
    "PReLU": nn.PReLU,
    "Swish": Swish,
    "LayerNorm": lambda: nn.LayerNorm(8),
    "BatchNorm1d": lambda: nn.BatchNorm1d(8),
    "SiLU, LayerNorm": lambda: nn.Sequential(nn.SiLU(), nn.LayerNorm(8)),
}


@pytest.mark.parametrize("plus_one", [False, True], ids=["scale", "one_plus_scale"])
@pytest.mark.parametrize("act", sorted(ACTIVATIONS_OF_A_CONSTANT))
@pytest.mark.parametrize("preset", [CPLRP, AttnLRP], ids=lambda preset: preset.__name__)
def test_a_scale_computed_from_constants_through_an_activation_module_is_a_constant(preset, act: str, plus_one: bool):
    """The product ``h · scale`` is a linear map of ``h``: all of its relevance goes to ``h``, and relevance is the
    gradient × input (the model is linear in ``x``), whatever activation or norm module the embedding goes through.
    (Such a module's output lost the mark of a tensor computed from parameters alone, and the product's rule gave the
    scale half of the relevance: it was halved, with no warning.)"""
    torch.manual_seed(0)
    model = FiLMConditioned(ACTIVATIONS_OF_A_CONSTANT[act](), plus_one).to(F64).eval()
    x = unet_input()[:, :, :5, :5]
    relevance, output, caught = explain(model, x, preset())
    assert caught == []
    assert relative_error(relevance, gradient_times_input(model, x, output.argmax(-1))) <= 1e-10
