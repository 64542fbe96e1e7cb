"""Models written by hand from papers, as users write them (no zoo): U-Net, a VAE, PointNet with its T-Net,
DeepSets, the Set Transformer, a Perceiver's cross-attention, hypernetworks and dynamic convolutions, capsules,
SIREN and positional encodings, a Kolmogorov–Arnold layer, a mixture density head, a neural ODE and a Siamese
network. Each is held to an oracle: LRP-0 is gradient × input where the model is piecewise linear, relevance is
conserved with its biases zeroed where the preset conserves, an explicit rule or the same model written otherwise
gives the same relevance, or the function no rule covers is named."""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import (
    CPLRP,
    LRP,
    AttnLRP,
    BaseRuleMapper,
    EpsilonAlpha2Beta1,
    EpsilonGammaBox,
    EpsilonPlus,
)
from tdhook.attribution._nonlinear_calls import COMPUTED_WEIGHT
from tests.conftest import relative_error

F64 = torch.float64
B = 3

# The presets with ε = 0 on dense layers, so that they conserve where their rules do.
CNN_PRESETS = {
    "EpsilonPlus": lambda: EpsilonPlus(epsilon=0.0, stabilizer=1e-12),
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-4.0, 4.0, epsilon=0.0, stabilizer=1e-12),
    "EpsilonAlpha2Beta1": lambda: EpsilonAlpha2Beta1(epsilon=0.0, stabilizer=1e-12),
}
TRANSFORMER_PRESETS = {"AttnLRP": AttnLRP, "CPLRP": CPLRP}
EVERY_PRESET = {"LRP-0": lambda: BaseRuleMapper(stabilizer=0.0), **CNN_PRESETS, **TRANSFORMER_PRESETS}
# α2β1 gives 2R where an output has no negative part (a layer after a ReLU whose live inputs all have positive
# weights), as zennit does: it conserves only where both parts are present, so the conservation checks leave it out.
CONSERVING = {name: preset for name, preset in EVERY_PRESET.items() if name != "EpsilonAlpha2Beta1"}
# Where a function is named, the CNN presets name it alike: one of them stands for all.
NAMING = {name: EVERY_PRESET[name] for name in ("LRP-0", "EpsilonPlus", "AttnLRP", "CPLRP")}


def zero_biases(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "bias" in name.rsplit(".", 1)[-1]:
                parameter.zero_()
    return model


def explain(model: nn.Module, inputs: dict[str, torch.Tensor], mapper, target) -> tuple[dict, list[str], list[str]]:
    """The relevance of each input, the warnings' messages and the functions the coverage report names."""
    lrp = LRP(model, mapper, in_keys=list(inputs), out_keys=["y"], target=target)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = lrp(TensorDict(dict(inputs), batch_size=[B]))
    functions = [call.function for call in lrp.coverage().plain_gradient]
    return {key: out["relevance", key] for key in inputs}, [str(w.message) for w in caught], functions


def gradient_times_input(model: nn.Module, inputs: dict[str, torch.Tensor], seed: Callable) -> dict:
    leaves = {key: value.clone().requires_grad_(True) for key, value in inputs.items()}
    grads = torch.autograd.grad(seed(model(*leaves.values())).sum(), list(leaves.values()))
    return {key: value * grad for (key, value), grad in zip(inputs.items(), grads, strict=True)}


def assert_conserved(relevance: dict, explained: torch.Tensor, rtol: float = 1e-8) -> None:
    total = sum(r.flatten(1).sum(1) for r in relevance.values())
    torch.testing.assert_close(total, explained.detach().reshape(B, -1).sum(1), rtol=rtol, atol=1e-10)


def first_unit(y: torch.Tensor) -> torch.Tensor:
    return y[:, :1]


# ----------------------------------------------------------------------------------------------------------- U-Net


class UNet(nn.Module):
    """Ronneberger et al., small: a contracting path, an expanding one by a transposed convolution, bilinear
    upsampling (a module, or ``F.interpolate``), the skip cropped to size and concatenated, an output cropped."""

    def __init__(self, up: str) -> None:
        super().__init__()
        self.kind = up
        self.down = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU())
        self.bottom = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU())
        if up == "transposed":
            self.up = nn.ConvTranspose2d(6, 4, 2, stride=2)
        else:
            self.up = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(6, 4, 1))
        self.join, self.head = nn.Sequential(nn.Conv2d(8, 4, 3), nn.ReLU()), nn.Conv2d(4, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.down(x)
        bottom = self.bottom(skip)
        if self.kind == "interpolate":
            up = self.up[1](F.interpolate(bottom, scale_factor=2, mode="bilinear", align_corners=True))
        else:
            up = self.up(bottom)
        skip = F.pad(skip, (1, 1, 1, 1))[..., 1 : 1 + up.shape[-2], 1 : 1 + up.shape[-1]]
        return self.head(self.join(torch.cat([skip, up], 1)))[..., 1:-1, 1:-1]


SEGMENT = torch.zeros(1, 3, 6, 6, dtype=F64)
SEGMENT[:, 1, 2:4, 2:4] = 1.0  # a region of one class explained


def segment(y: torch.Tensor) -> torch.Tensor:
    return y * SEGMENT


@pytest.mark.parametrize("up", ["transposed", "upsample", "interpolate"])
def test_a_unet_is_gradient_times_input_under_lrp0_and_conserves(up: str):
    torch.manual_seed(0)
    model, x = UNet(up).double(), {"x": torch.randn(B, 2, 12, 12, dtype=F64)}
    relevance, caught, functions = explain(model, x, BaseRuleMapper(strict=True, stabilizer=0.0), segment)
    assert caught == [] and functions == []
    torch.testing.assert_close(relevance["x"], gradient_times_input(model, x, segment)["x"], rtol=1e-10, atol=1e-13)
    zero_biases(model)
    for preset in (BaseRuleMapper(stabilizer=0.0), CNN_PRESETS["EpsilonGammaBox"](), CPLRP()):
        assert_conserved(explain(model, x, preset, segment)[0], segment(model(x["x"])))


def test_bilinear_upsampling_before_a_layer_under_z_plus_is_the_explicit_rule():
    """z⁺ on the convolution after a bilinear upsampling (a module the rules pass by its gradient), against the
    rule written out: ``R_u = u⁺ · W⁺ᵀ(R / z⁺) + u⁻ · W⁻ᵀ(R / z⁺)``, then ``R_x = x · Upᵀ(R_u / u)``."""
    torch.manual_seed(0)
    up, conv = nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(3, 2, 1, bias=False).double()
    with torch.no_grad():
        conv.weight[:, 0] = conv.weight[:, 0].abs() + 0.1  # every output has a positive share: z⁺ > 0
    x = torch.rand(B, 3, 4, 4, dtype=F64) + 0.1  # positive, so is its upsampling
    seed = torch.randn(1, 2, 8, 8, dtype=F64)
    relevance = explain(nn.Sequential(up, conv), {"x": x}, EpsilonPlus(stabilizer=1e-12), lambda y: y * seed)[0]

    leaf = x.clone().requires_grad_(True)
    u = up(leaf)
    positive = F.conv2d(u.detach(), conv.weight.clamp(min=0))
    ratio = conv(u).detach() * seed / positive
    (through_layer,) = torch.autograd.grad(F.conv2d(u, conv.weight.clamp(min=0)), u, ratio, retain_graph=True)
    relevance_u = u.detach() * through_layer
    (grad,) = torch.autograd.grad(u, leaf, relevance_u / u.detach())
    torch.testing.assert_close(relevance["x"], x * grad, rtol=1e-8, atol=1e-12)


def upsampling_matrix(up: nn.Module, channels: int, size: int) -> torch.Tensor:
    """The matrix ``U`` of the linear map ``up`` on one sample of ``channels × size × size``: column ``i`` is the
    upsampling of the ``i``-th unit vector (float64)."""
    basis = torch.eye(channels * size * size, dtype=F64).view(-1, channels, size, size)
    return up(basis).flatten(1).T


@pytest.mark.parametrize("mode", ["bilinear", "bilinear-align-corners", "nearest"])
@pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonAlpha2Beta1"])
def test_upsampling_is_lrp0_of_its_matrix_where_zennit_passes_relevance_by_its_transpose(mode: str, preset: str):
    """Who is right after a bilinear upsampling, tdhook or zennit: the definition decides. The upsampling is a linear
    map ``u = U x`` without bias, so LRP-0 on it (LRP-ε as ε → 0) is ``R_x = x ⊙ Uᵀ(R_u / u)``, which tdhook gives
    (the plain gradient, in its relevance = input × modified gradient). zennit has no rule for ``nn.Upsample`` and
    passes the relevance itself by the plain gradient, ``R_x = Uᵀ R_u``: LRP-0 only where each output copies one
    input (nearest: ``x_i U_ji / u_j = U_ji``). A bilinear output mixes four inputs with weights that sum to 1, so
    both conserve, but zennit shares it by the weights ``U_ji`` and not by the contributions ``x_i U_ji / u_j``
    (23 % and 54 % apart under EpsilonPlus and α2β1 on a small CNN). zennit is the one off the definition; the oracle
    is the explicit matrix in float64, with ``R_u`` from zennit's rules on the layers after the upsampling."""
    from zennit import composites as zcomposites

    if mode == "nearest":
        up = nn.Upsample(scale_factor=2, mode="nearest")
    else:
        up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=mode.endswith("corners"))
    torch.manual_seed(0)
    tail = nn.Sequential(nn.Conv2d(3, 2, 3, padding=1, bias=False), nn.ReLU(), nn.Flatten(), nn.Linear(128, 3, False))
    tail = tail.double()
    model = nn.Sequential(up, *tail)
    x = torch.rand(B, 3, 4, 4, dtype=F64) + 0.1  # positive: so is every upsampled unit, u > 0
    ours = {"EpsilonPlus": EpsilonPlus, "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1}[preset]
    theirs = {"EpsilonPlus": zcomposites.EpsilonPlus, "EpsilonAlpha2Beta1": zcomposites.EpsilonAlpha2Beta1}[preset]
    relevance = explain(model, {"x": x}, ours(epsilon=1e-9, stabilizer=1e-9), None)[0]["x"]

    with torch.no_grad():
        u, out = up(x), model(x)
    start = torch.zeros_like(out).scatter_(1, out.argmax(1, keepdim=True), 1.0) * out

    def zennit(net: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
        leaf = inputs.clone().requires_grad_(True)
        with theirs(epsilon=1e-9, stabilizer=1e-9).context(net) as modified:
            return torch.autograd.grad(modified(leaf), leaf, start)[0]

    relevance_u = zennit(tail, u).flatten(1)  # R_u, by the rules of the layers after the upsampling
    matrix = upsampling_matrix(up, 3, 4)
    torch.testing.assert_close(x.flatten(1) @ matrix.T, u.flatten(1), rtol=1e-12, atol=1e-14)  # U is the upsampling
    lrp0 = x.flatten(1) * ((relevance_u / u.flatten(1)) @ matrix)  # R_x = x ⊙ Uᵀ(R_u / u)
    transposed = relevance_u @ matrix  # R_x = Uᵀ R_u
    for shares in (lrp0, transposed):  # both conserve R_u
        torch.testing.assert_close(shares.sum(1), relevance_u.sum(1), rtol=1e-10, atol=1e-12)
    assert relative_error(relevance.flatten(1), lrp0) <= 1e-8  # tdhook: LRP-0 of the matrix
    by_zennit = zennit(model, x)
    assert relative_error(by_zennit.flatten(1), transposed) <= 1e-8  # zennit: the relevance by the transpose
    if mode == "nearest":  # each output copies one input: the two are the same
        assert relative_error(relevance, by_zennit) <= 1e-8
    else:
        assert relative_error(relevance, by_zennit) > 0.05


# ------------------------------------------------------------------------------------------------------------- VAE


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 6))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.net(z)


class VAE(nn.Module):
    """Kingma & Welling: the reparameterisation ``μ + exp(log σ² / 2) · ε`` with a fixed ε."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(6, 8), nn.ReLU())
        self.mean, self.log_variance = nn.Linear(8, 3), nn.Linear(8, 3)
        self.decoder = Decoder()
        self.register_buffer("eps", torch.randn(1, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.encoder(x)
        return self.decoder(self.mean(h) + torch.exp(0.5 * self.log_variance(h)) * self.eps)


@pytest.mark.parametrize("preset", sorted(CONSERVING))
def test_a_decoder_explained_at_its_latent_is_gradient_times_input_and_conserves(preset: str):
    torch.manual_seed(0)
    model, z = Decoder().double(), {"z": torch.randn(B, 3, dtype=F64)}
    if preset == "LRP-0":
        relevance = explain(model, z, CONSERVING[preset](), 2)[0]
        torch.testing.assert_close(relevance["z"], gradient_times_input(model, z, lambda y: y[:, 2])["z"])
    relevance, caught, _ = explain(zero_biases(model), z, CONSERVING[preset](), 2)
    assert caught == []
    assert_conserved(relevance, model(z["z"])[:, 2])


@pytest.mark.parametrize("preset", sorted(NAMING))
def test_the_reparameterisations_exponential_is_named(preset: str):
    torch.manual_seed(0)
    _, caught, functions = explain(VAE().double(), {"x": torch.randn(B, 6, dtype=F64)}, NAMING[preset](), 0)
    assert functions == ["exp"] and any("(VAE) computes exp" in message for message in caught)


# -------------------------------------------------------------------------------------------------------- PointNet


class PointNet(nn.Module):
    """Qi et al.: a T-Net predicts a 3 × 3 matrix from the points, ``bmm`` aligns them with it (a product of two
    tensors computed from the input), a shared MLP (1 × 1 convolutions) and a max over the points."""

    def __init__(self, align: bool, identity: bool = True) -> None:
        super().__init__()
        self.align, self.identity = align, identity
        if align:
            self.t_net = nn.Sequential(nn.Conv1d(3, 8, 1), nn.ReLU(), nn.Conv1d(8, 8, 1), nn.ReLU())
            self.t_head = nn.Linear(8, 9)
        self.features = nn.Sequential(nn.Conv1d(3, 8, 1), nn.ReLU(), nn.Conv1d(8, 16, 1), nn.ReLU())
        self.head = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, points: torch.Tensor) -> torch.Tensor:  # batch, points, 3
        if self.align:
            matrix = self.t_head(self.t_net(points.transpose(1, 2)).amax(2)).view(-1, 3, 3)
            points = torch.bmm(points, matrix + torch.eye(3, dtype=points.dtype) if self.identity else matrix)
        return self.head(self.features(points.transpose(1, 2)).max(2)[0])


def points() -> dict[str, torch.Tensor]:
    return {"points": torch.randn(B, 10, 3, dtype=F64)}


@pytest.mark.parametrize("preset", sorted(CONSERVING))
def test_pointnet_without_its_t_net_is_gradient_times_input_and_conserves(preset: str):
    torch.manual_seed(0)
    model, x = PointNet(align=False).double(), points()
    if preset == "LRP-0":
        relevance = explain(model, x, BaseRuleMapper(strict=True, stabilizer=0.0), 0)[0]
        torch.testing.assert_close(relevance["points"], gradient_times_input(model, x, first_unit)["points"])
    relevance, caught, _ = explain(zero_biases(model), x, CONSERVING[preset](), 0)
    assert caught == []
    assert_conserved(relevance, model(x["points"])[:, 0])


@pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonAlpha2Beta1"])
def test_the_t_nets_alignment_is_named_under_a_cnn_preset(preset: str):
    """``bmm`` of the points and a matrix computed from them is no layer: gradient × input gives the product
    twice its relevance (it is of degree two), so the CNN presets name it."""
    torch.manual_seed(0)
    _, caught, functions = explain(PointNet(align=True).double(), points(), CNN_PRESETS[preset](), 0)
    assert functions == ["bmm"] and any("(PointNet) computes bmm" in message for message in caught)


def test_the_t_net_under_a_box_rule_is_refused_naming_the_layer():
    """z^B on the first layer, whose input mixes the points with the T-Net's output."""
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="ZBoxRule on Conv1d"):
        explain(PointNet(align=True).double(), points(), CNN_PRESETS["EpsilonGammaBox"](), 0)


@pytest.mark.parametrize("preset", sorted(TRANSFORMER_PRESETS))
def test_the_t_nets_alignment_conserves_under_the_transformer_presets(preset: str):
    """The product rule splits ``bmm`` between its factors (the identity added to the matrix, a constant, left
    out: it would take a share as a bias does)."""
    torch.manual_seed(0)
    model, x = zero_biases(PointNet(align=True, identity=False).double()), points()
    relevance, caught, functions = explain(model, x, TRANSFORMER_PRESETS[preset](), 0)
    assert caught == [] and functions == []
    assert_conserved(relevance, model(x["points"])[:, 0])


# ------------------------------------------------------------------------------------------- DeepSets, attention


class DeepSets(nn.Module):
    """Zaheer et al.: ρ(pool(φ(x))) over the set's elements."""

    def __init__(self, pool: str) -> None:
        super().__init__()
        self.pool = pool
        self.phi = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        self.rho = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.phi(x)
        pooled = {"mean": lambda: h.mean(1), "sum": lambda: h.sum(1), "logsumexp": lambda: h.logsumexp(1)}
        return self.rho(pooled[self.pool]())


def sets() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(B, 7, 4, dtype=F64)}


@pytest.mark.parametrize("pool", ["mean", "sum"])
@pytest.mark.parametrize("preset", sorted(CONSERVING))
def test_deep_sets_pooled_by_sums_and_means_conserve(preset: str, pool: str):
    torch.manual_seed(0)
    model, x = zero_biases(DeepSets(pool).double()), sets()
    relevance, caught, _ = explain(model, x, CONSERVING[preset](), 0)
    assert caught == []
    assert_conserved(relevance, model(x["x"])[:, 0])
    if preset == "LRP-0":
        torch.testing.assert_close(relevance["x"], gradient_times_input(model, x, first_unit)["x"])


def test_deep_sets_pooled_by_logsumexp_are_named():
    torch.manual_seed(0)
    _, caught, functions = explain(DeepSets("logsumexp").double(), sets(), CNN_PRESETS["EpsilonPlus"](), 0)
    assert functions == ["logsumexp"] and any("(DeepSets) computes logsumexp" in message for message in caught)


class Block(nn.Module):
    """The Set Transformer's MAB(Q, K): ``LN(H + FF(H))`` with ``H = LN(Q + attention(Q, K, K))``."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.norms = nn.ModuleList([nn.LayerNorm(width), nn.LayerNorm(width)])
        self.ff = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        h = self.norms[0](q + self.attention(q, k, k, need_weights=False)[0])
        return self.norms[1](h + self.ff(h))


class SetTransformer(nn.Module):
    """Lee et al.: an induced set attention block (learned inducing points attend to the set, the set to them)
    and pooling by attention from a learned seed. The inducing points and the seed are inputs here, so that
    relevance can be conserved over everything the output is made of."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.induced, self.back, self.pool = Block(), Block(), Block()

    def forward(self, x: torch.Tensor, inducing: torch.Tensor, seed: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        x = self.back(x, self.induced(inducing, x))
        return self.head(self.pool(seed, x)[:, 0])


class Perceiver(nn.Module):
    """Jaegle et al.: latents attend to the inputs (``nn.MultiheadAttention`` sequence-first, keys and values of
    another width), then to themselves. ``written_out`` computes the cross-attention with ``torch.softmax`` and
    matrix products from the module's own weights."""

    def __init__(self, written_out: bool = False) -> None:
        super().__init__()
        self.written_out = written_out
        self.cross = nn.MultiheadAttention(8, 2, kdim=6, vdim=6)
        self.latent = nn.MultiheadAttention(8, 2)
        self.ff = nn.Sequential(nn.LayerNorm(8), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 3)

    def attend(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        if not self.written_out:
            return self.cross(q, kv, kv)[0]
        a, (length, batch, width), heads = self.cross, q.shape, self.cross.num_heads
        bq, bk, bv = a.in_proj_bias.chunk(3)
        q, k, v = F.linear(q, a.q_proj_weight, bq), F.linear(kv, a.k_proj_weight, bk), F.linear(kv, a.v_proj_weight, bv)
        q, k, v = (t.reshape(t.shape[0], batch * heads, -1).transpose(0, 1) for t in (q, k, v))
        weights = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(width // heads), -1)
        return a.out_proj((weights @ v).transpose(0, 1).reshape(length, batch, width))

    def forward(self, x: torch.Tensor, latents: torch.Tensor) -> torch.Tensor:
        kv, h = x.transpose(0, 1), latents.transpose(0, 1)
        h = h + self.attend(h, kv)
        h = h + self.latent(h, h, h)[0]
        return self.head((h + self.ff(h)).mean(0))


def set_transformer_inputs() -> dict[str, torch.Tensor]:
    return {**sets(), "inducing": torch.randn(B, 3, 8, dtype=F64), "seed": torch.randn(B, 1, 8, dtype=F64)}


def perceiver_inputs() -> dict[str, torch.Tensor]:
    return {"x": torch.randn(B, 5, 6, dtype=F64), "latents": torch.randn(B, 3, 8, dtype=F64)}


@pytest.mark.parametrize(
    "make, inputs", [(SetTransformer, set_transformer_inputs), (Perceiver, perceiver_inputs)], ids=["set", "perceiver"]
)
def test_attention_with_learned_queries_conserves_under_cplrp(make, inputs):
    torch.manual_seed(0)
    model, x = zero_biases(make().double()), inputs()
    relevance, caught, functions = explain(model, x, CPLRP(), 0)
    assert caught == [] and functions == []
    assert_conserved(relevance, model(*x.values())[:, 0])


@pytest.mark.parametrize("preset", sorted(TRANSFORMER_PRESETS))
def test_a_sequence_first_cross_attention_module_equals_it_written_out(preset: str):
    torch.manual_seed(0)
    model, x = Perceiver().double(), perceiver_inputs()
    written = copy.deepcopy(model)
    written.written_out = True
    torch.testing.assert_close(written(*x.values()), model(*x.values()))
    module, _, _ = explain(model, x, TRANSFORMER_PRESETS[preset](), 0)
    by_hand, _, _ = explain(written, x, TRANSFORMER_PRESETS[preset](), 0)
    for key in x:
        torch.testing.assert_close(module[key], by_hand[key], rtol=1e-9, atol=1e-12)


class MaskedSetPooling(nn.Module):
    """Sets padded to one size: a seed attends to the elements with a ``key_padding_mask``, beside the mean of the
    elements the mask keeps (the mask a constant of the call, not explained)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(4, 8), nn.Linear(8, 3)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor, seed: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        attended = self.attention(seed, h, h, key_padding_mask=padding)[0][:, 0]
        kept = (~padding).unsqueeze(-1).to(x.dtype)
        return self.head(seed[:, 0] + attended + (h * kept).sum(1) / kept.sum(1))


def test_padded_set_elements_get_no_relevance_and_the_rest_conserves_under_cplrp():
    torch.manual_seed(0)
    model = zero_biases(MaskedSetPooling().double())
    x, seed = torch.randn(B, 6, 4, dtype=F64), torch.randn(B, 1, 8, dtype=F64)
    padding = torch.zeros(B, 6, dtype=torch.bool)
    padding[0, 4:], padding[1, 2:] = True, True
    module = TensorDictModule(model, in_keys=["x", "seed", "padding"], out_keys=["y"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = LRP(module, CPLRP(), in_keys=["x", "seed"], target=0)(
            TensorDict(x=x, seed=seed, padding=padding, batch_size=[B])
        )
    assert not out["relevance", "x"][padding].any() and out["relevance", "x"][~padding].any()
    relevance = {key: out["relevance", key] for key in ("x", "seed")}
    assert_conserved(relevance, model(x, seed, padding)[:, 0])


@pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
def test_attention_under_a_cnn_preset_is_refused_naming_the_module(preset: str):
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="'induced.attention' \\(MultiheadAttention\\)"):
        explain(SetTransformer().double(), set_transformer_inputs(), CNN_PRESETS[preset](), 0)


# ------------------------------------------------------------------------------- generated weights and kernels


class HyperNetwork(nn.Module):
    """Ha et al.: a network computes another's weight from a task input ``z``. ``einsum`` gives each sample its
    own weight; ``F.linear`` one weight shared by the batch; ``F.conv2d`` grouped by sample gives each its own
    kernel (a dynamic convolution)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        shape = (4, 2, 3, 3) if how == "conv2d" else (5, 4)
        self.shape = shape
        self.generator = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, math.prod(shape)))
        self.head = nn.Linear(shape[0], 3)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if self.how == "einsum":
            h = torch.einsum("boi,bi->bo", self.generator(z).view(-1, *self.shape), x)
        elif self.how == "linear":
            h = F.linear(x, self.generator(z[:1]).view(self.shape))
        else:
            batch, channels, height, width = x.shape
            kernels = self.generator(z).view(batch * self.shape[0], *self.shape[1:])
            h = F.conv2d(x.reshape(1, batch * channels, height, width), kernels, padding=1, groups=batch)
            h = h.view(batch, self.shape[0], height, width).mean((2, 3))
        return self.head(F.relu(h))


def task_inputs(how: str) -> dict[str, torch.Tensor]:
    x = torch.randn(B, 2, 5, 5, dtype=F64) if how == "conv2d" else torch.randn(B, 4, dtype=F64)
    return {"x": x, "z": torch.randn(B, 2, dtype=F64)}


@pytest.mark.parametrize("preset", sorted(NAMING))
@pytest.mark.parametrize("how", ["einsum", "linear", "conv2d"])
def test_a_weight_computed_from_an_input_is_split_or_named(how: str, preset: str):
    """A product of the input and a weight computed from another input: the transformer presets' product rule
    splits an ``einsum`` and a ``F.linear`` (the matrix product ``x @ W.T`` it is) between their factors and
    conserves; a ``F.conv2d`` by such a weight is named under every preset, and a ``F.linear`` under the CNN presets
    (gradient × input gives it twice its relevance), as a product of two activations."""
    torch.manual_seed(0)
    model, x = zero_biases(HyperNetwork(how).double()), task_inputs(how)
    relevance, caught, functions = explain(model, x, NAMING[preset](), 0)
    if how in ("einsum", "linear") and preset in TRANSFORMER_PRESETS:
        assert caught == [] and functions == []
        assert_conserved(relevance, model(*x.values())[:, 0])
    else:
        named = how if how == "einsum" else f"{how} ({COMPUTED_WEIGHT})"  # a layer function: named a product
        assert functions == [named] and any(f"(HyperNetwork) computes {named}" in message for message in caught)


class StandardisedConv2d(nn.Conv2d):
    """Weight standardisation (Qiao et al.): the layer convolves with its weight standardised per output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv2d(x, standardised(self.weight), self.bias, self.stride, self.padding)


def standardised(weight: torch.Tensor) -> torch.Tensor:
    return (weight - weight.mean((1, 2, 3), keepdim=True)) / (weight.std((1, 2, 3), keepdim=True) + 1e-5)


@pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
def test_a_convolution_with_a_standardised_weight_is_the_layer_with_that_weight(preset: str):
    torch.manual_seed(0)
    layers = [nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), StandardisedConv2d(4, 4, 3, padding=1), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(100, 3)).double()
    plain = copy.deepcopy(model)
    plain[2] = nn.Conv2d(4, 4, 3, padding=1).double()
    plain[2].load_state_dict({"weight": standardised(model[2].weight).detach(), "bias": model[2].bias.detach()})
    x = {"x": torch.randn(B, 2, 5, 5, dtype=F64)}
    relevance, caught, functions = explain(model, x, CNN_PRESETS[preset](), 0)
    assert caught == [] and functions == []
    torch.testing.assert_close(relevance["x"], explain(plain, x, CNN_PRESETS[preset](), 0)[0]["x"])


# ---------------------------------------------------------------------------------------------------- capsules


def squash(s: torch.Tensor) -> torch.Tensor:
    squared = (s * s).sum(-1, keepdim=True)
    return squared / (1 + squared) * s / torch.sqrt(squared + 1e-12)


class Capsules(nn.Module):
    """Sabour et al.: primary capsules, predictions by a weight per capsule pair, three iterations of routing by
    agreement (a softmax over the coupling logits, the squash non-linearity), lengths as the output."""

    def __init__(self) -> None:
        super().__init__()
        self.primary = nn.Linear(6, 4 * 3)
        self.weight = nn.Parameter(torch.randn(4, 2, 5, 3) * 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        predictions = torch.einsum("ijdk,bik->bijd", self.weight, squash(self.primary(x).view(-1, 4, 3)))
        logits = x.new_zeros(x.shape[0], 4, 2)
        for _ in range(3):
            capsules = squash((torch.softmax(logits, 2).unsqueeze(-1) * predictions).sum(1))
            logits = logits + (predictions * capsules.unsqueeze(1)).sum(-1)
        return capsules.norm(dim=-1)


@pytest.mark.parametrize("preset", sorted(EVERY_PRESET))
def test_capsule_routing_conserves_under_cplrp_and_names_what_no_rule_covers(preset: str):
    """CP-LRP holds the coupling coefficients (a softmax weighing the predictions) and the squash's scale (a
    norm), and conserves; the capsules' lengths are named under every preset (AttnLRP's product rule splits the
    agreement, its softmax rule does not conserve)."""
    torch.manual_seed(0)
    model, x = zero_biases(Capsules().double()), {"x": torch.randn(B, 6, dtype=F64)}
    relevance, caught, functions = explain(model, x, EVERY_PRESET[preset](), 0)
    assert "norm" in functions and any("(Capsules) computes" in message for message in caught)
    if preset in TRANSFORMER_PRESETS:
        assert functions == ["norm"]
    if preset == "CPLRP":
        assert_conserved(relevance, model(x["x"])[:, 0])


# ---------------------------------------------------------------------- periodic activations and encodings, KAN


class Siren(nn.Module):
    """Sitzmann et al.: sine activations, the first scaled by ω₀ = 30."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(2, 8), nn.Linear(8, 8), nn.Linear(8, 3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[2](torch.sin(self.layers[1](torch.sin(30 * self.layers[0](x)))))


class Encoded(nn.Module):
    """An MLP on NeRF's positional encoding (sines and cosines of ``2^k π x``) or on random Fourier features
    (Tancik et al.: of ``2π x B`` for a fixed Gaussian ``B``)."""

    def __init__(self, fourier: bool) -> None:
        super().__init__()
        self.fourier = fourier
        self.register_buffer("frequencies", torch.randn(3, 6) * 2)
        self.mlp = nn.Sequential(nn.Linear(12 if fourier else 21, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fourier:
            phase = 2 * math.pi * x @ self.frequencies
            return self.mlp(torch.cat([torch.sin(phase), torch.cos(phase)], -1))
        bands = [f((2.0**k) * math.pi * x) for k in range(3) for f in (torch.sin, torch.cos)]
        return self.mlp(torch.cat([x, *bands], -1))


class KolmogorovArnold(nn.Module):
    """Liu et al.'s KAN layer: cubic B-splines of each input (Cox–de Boor from comparisons with the knots) with
    learned coefficients, plus a SiLU base branch."""

    def __init__(self, inputs: int = 3, outputs: int = 2, grid: int = 5, order: int = 3) -> None:
        super().__init__()
        self.order = order
        self.register_buffer("knots", torch.arange(-order, grid + order + 1) * (2.0 / grid) - 1.0)
        self.coefficients = nn.Parameter(torch.randn(outputs, inputs, grid + order) * 0.3)
        self.base = nn.Parameter(torch.randn(outputs, inputs) * 0.5)
        self.head = nn.Linear(outputs, 2)

    def bases(self, x: torch.Tensor) -> torch.Tensor:
        t, x = self.knots, x.unsqueeze(-1)
        b = ((x >= t[:-1]) & (x < t[1:])).to(x.dtype)
        for p in range(1, self.order + 1):
            left = (x - t[: -(p + 1)]) / (t[p:-1] - t[: -(p + 1)]) * b[..., :-1]
            b = left + (t[p + 1 :] - x) / (t[p + 1 :] - t[1:-p]) * b[..., 1:]
        return b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        splines = torch.einsum("bis,ois->bo", self.bases(x), self.coefficients)
        return self.head(splines + F.linear(F.silu(x), self.base))


PERIODIC = {"SIREN": (Siren, 2, ["sin"]), "NeRF": (lambda: Encoded(False), 3, ["sin", "cos"])}
PERIODIC |= {"Fourier features": (lambda: Encoded(True), 3, ["sin", "cos"])}


@pytest.mark.parametrize("preset", sorted(NAMING))
@pytest.mark.parametrize("name", sorted(PERIODIC))
def test_sines_and_cosines_are_named_under_every_preset(name: str, preset: str):
    """No preset has a rule for a periodic function (its relevance is no share of its output): named, and the
    gradient through it kept, so LRP-0 is gradient × input."""
    torch.manual_seed(0)
    make, width, named = PERIODIC[name]
    model, x = make().double(), {"x": torch.randn(B, width, dtype=F64)}
    relevance, caught, functions = explain(model, x, NAMING[preset](), 0)
    assert functions == named and any(f"computes {', '.join(named)}" in message for message in caught)
    if preset == "LRP-0":
        torch.testing.assert_close(relevance["x"], gradient_times_input(model, x, first_unit)["x"])


@pytest.mark.parametrize("preset", sorted(NAMING))
def test_a_kan_layers_splines_and_silu_are_named_or_ruled(preset: str):
    """The CNN presets name the splines' products and the SiLU; the transformer presets split the products and
    pass relevance through the SiLU, naming nothing. LRP-0 is gradient × input."""
    torch.manual_seed(0)
    model, x = KolmogorovArnold().double(), {"x": torch.rand(B, 3, dtype=F64) * 1.6 - 0.8}
    relevance, caught, functions = explain(model, x, NAMING[preset](), 0)
    assert functions == ([] if preset in TRANSFORMER_PRESETS else ["mul", "silu"])
    assert (caught == []) == (preset in TRANSFORMER_PRESETS)
    if preset == "LRP-0":
        torch.testing.assert_close(relevance["x"], gradient_times_input(model, x, first_unit)["x"])


# ---------------------------------------------------------- mixture density head, neural ODE, Siamese network


class MixtureDensity(nn.Module):
    """Bishop's mixture density head: mixture weights (softmax), means, scales (exp), concatenated."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
        self.weights, self.means, self.scales = nn.Linear(8, 3), nn.Linear(8, 6), nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.body(x)
        return torch.cat([torch.softmax(self.weights(h), -1), self.means(h), torch.exp(self.scales(h))], -1)


@pytest.mark.parametrize("preset", sorted(CONSERVING))
def test_a_mixture_density_heads_mean_conserves_and_its_scale_is_named(preset: str):
    torch.manual_seed(0)
    model, x = zero_biases(MixtureDensity().double()), {"x": torch.randn(B, 4, dtype=F64)}
    relevance, caught, functions = explain(model, x, CONSERVING[preset](), 4)
    assert "exp" in functions and any("(MixtureDensity) computes" in message for message in caught)
    assert_conserved(relevance, model(x["x"])[:, 4])
    if preset == "LRP-0":
        torch.testing.assert_close(relevance["x"], gradient_times_input(model, x, lambda y: y[:, 4])["x"])


class NeuralODE(nn.Module):
    """Chen et al., fixed-step Euler: ``h ← h + ½ f(h)`` three times, one module ``f`` (or copies of it). The
    presets with modified weights (γ, αβ) keep them for each call of ``f``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.head = nn.Conv2d(2, 4, 3, padding=1), nn.Linear(4, 3)
        field = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1))
        self.fields = nn.ModuleList([field] * 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x))
        for field in self.fields:
            h = h + 0.5 * field(h)
        return self.head(h.mean((2, 3)))


@pytest.mark.parametrize("preset", ["LRP-0", "EpsilonGammaBox", "EpsilonAlpha2Beta1"])
def test_a_neural_ode_reusing_its_field_equals_the_loop_unrolled_into_copies(preset: str):
    torch.manual_seed(0)
    model, x = zero_biases(NeuralODE().double()), {"x": torch.randn(B, 2, 5, 5, dtype=F64)}
    unrolled = copy.deepcopy(model)
    unrolled.fields = nn.ModuleList([copy.deepcopy(field) for field in model.fields])
    relevance, caught, _ = explain(model, x, EVERY_PRESET[preset](), 0)
    assert caught == []
    torch.testing.assert_close(relevance["x"], explain(unrolled, x, EVERY_PRESET[preset](), 0)[0]["x"])
    if preset in CONSERVING:
        assert_conserved(relevance, model(x["x"])[:, 0])


class Siamese(nn.Module):
    """One encoder on two inputs compared by cosine similarity (``F.cosine_similarity``, or ``F.normalize`` and
    a dot product), a dot product, or a distance."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.encoder = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 6))

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        a, b = self.encoder(a), self.encoder(b)
        if self.how == "cosine_similarity":
            return F.cosine_similarity(a, b, dim=-1).unsqueeze(-1)
        if self.how == "normalize":
            return (F.normalize(a, dim=-1) * F.normalize(b, dim=-1)).sum(-1, keepdim=True)
        if self.how == "dot":
            return (a * b).sum(-1, keepdim=True)
        return -torch.norm(a - b, dim=-1, keepdim=True)


@pytest.mark.parametrize("preset", sorted(NAMING))
@pytest.mark.parametrize("how", ["cosine_similarity", "normalize", "dot", "norm"])
def test_a_siamese_similarity_conserves_or_is_named(how: str, preset: str):
    """The transformer presets hold F.normalize's scale and split the product: the similarity is conserved, and
    ``F.cosine_similarity`` is computed so, under the CNN presets too. A distance has no rule under any preset, and
    the product of the two encodings none under a CNN preset: named."""
    torch.manual_seed(0)
    model = zero_biases(Siamese(how).double())
    x = {"a": torch.randn(B, 5, dtype=F64), "b": torch.randn(B, 5, dtype=F64)}
    relevance, caught, functions = explain(model, x, NAMING[preset](), None)
    if how == "cosine_similarity" or (how in ("normalize", "dot") and preset in TRANSFORMER_PRESETS):
        assert caught == [] and functions == []
        assert_conserved(relevance, model(*x.values()))
    else:
        assert how in functions or "mul" in functions
        assert any("(Siamese) computes" in message for message in caught)
