"""Vision blocks and timm families the gallery leaves out, in float64 with random weights, each against an oracle.

Research blocks written as a user writes them, on a small CNN (torchvision's ``Conv2dNormActivation`` and ``MLP``):
CBAM (a channel gate from average- and max-pooled features, then a spatial gate from the channels' mean and maximum),
coordinate attention (two gates, pooled along each axis), torchvision's ``SqueezeExcitation`` beside a residual block
with ``StochasticDepth``, and a stem normalised by ``FrozenBatchNorm2d``:

1. under EpsilonPlus, EpsilonGammaBox, EpsilonAlpha2Beta1 and CP-LRP the relevance equals that of the same model with
   every gate detached by hand (relative L2 error ≤ 1e-12), with no warning: the gates are held, as the rules say;
2. with biases zeroed (the frozen BatchNorm's shift and mean too), CP-LRP conserves the logit within 1e-9;
3. ``DeformConv2d`` (offsets computed from the input) is named under every preset, not explained in silence.

timm families beside the gallery's (recent CNNs, attention modules a ResNet takes by ``attn_layer``, global pooling
variants, and attention models: MobileViT v2, Visformer, SHViT, GCViT, EfficientViM, LowFormer, MViT v2, FastViT MCi,
EfficientViT (MIT), CoaT-lite, ConvFormer), built as the gallery builds them (BatchNorm calibrated):

4. the outputs and the model are left as they were, and the relevance is finite, under every preset;
5. with bias-like parameters zeroed, CP-LRP conserves within 1e-5 (the BatchNorms left unmerged in front of a block
   keep the stabiliser's 1e-6) with no warning, or warns naming the modules whose plain gradient it uses (the linear
   attention of EfficientViT, whose normaliser is a division);
6. EpsilonGammaBox conserves within 1e-4 with no warning on the CNNs, and on attention models within 10 % or with a
   warning naming a module.

``pytest tests/attribution/test_lrp_zoo_vision_more.py`` runs the blocks and the fast timm models (a few seconds
each); ``pytest -m gallery`` adds the rest.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from functools import cache, partial

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tdhook.attribution import CPLRP, AttnLRP, EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus
from tests.attribution.test_lrp_detection import explain
from tests.attribution.test_lrp_gallery import Case, build, changes, fingerprint, zero_biases
from tests.conftest import relative_error

torchvision = pytest.importorskip("torchvision")
timm = pytest.importorskip("timm")

from torchvision.ops import MLP as TorchvisionMLP  # noqa: E402
from torchvision.ops import Conv2dNormActivation, DeformConv2d, SqueezeExcitation, StochasticDepth  # noqa: E402
from torchvision.ops.misc import FrozenBatchNorm2d  # noqa: E402

F64 = torch.float64
PRESETS: dict[str, Callable] = {
    "EpsilonPlus": EpsilonPlus,
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-10.0, 10.0),
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
    "CPLRP": CPLRP,
}
TWIN_TOLERANCE = 1e-12
BLOCK_CONSERVATION = 1e-9
CPLRP_TOLERANCE = 1e-5
CNN_TOLERANCE = 1e-4
ATTENTION_TOLERANCE = 0.1


# --- Research blocks -----------------------------------------------------------------------------------------------


class Held:
    """Whether the blocks detach their gates by hand (the oracle's twin)."""

    detached = False


def gate(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach() if Held.detached else tensor


class CBAM(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Conv2d(channels, channels // 2, 1), nn.ReLU(), nn.Conv2d(channels // 2, channels, 1)
        )
        self.spatial = nn.Conv2d(2, 1, 7, padding=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * gate(torch.sigmoid(self.mlp(F.adaptive_avg_pool2d(x, 1)) + self.mlp(F.adaptive_max_pool2d(x, 1))))
        pooled = torch.cat([x.mean(1, keepdim=True), x.amax(1, keepdim=True)], 1)
        return x * gate(torch.sigmoid(self.spatial(pooled)))


class CoordinateAttention(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.reduce = Conv2dNormActivation(channels, 4, 1, activation_layer=nn.Hardswish)
        self.along_h, self.along_w = nn.Conv2d(4, channels, 1), nn.Conv2d(4, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, w = x.shape[-2:]
        pooled = torch.cat([F.adaptive_avg_pool2d(x, (h, 1)), F.adaptive_avg_pool2d(x, (1, w)).transpose(2, 3)], 2)
        along_h, along_w = self.reduce(pooled).split([h, w], 2)
        return x * gate(self.along_h(along_h).sigmoid()) * gate(self.along_w(along_w.transpose(2, 3)).sigmoid())


class HeldSqueezeExcitation(SqueezeExcitation):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * gate(self._scale(x))


class Residual(nn.Module):
    def __init__(self, channels: int, norm: type[nn.Module]) -> None:
        super().__init__()
        self.body = Conv2dNormActivation(channels, channels, 3, norm_layer=norm)
        self.drop = StochasticDepth(0.2, "row")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.body(x))


class Deformable(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.offsets, self.conv = nn.Conv2d(channels, 18, 3, padding=1), DeformConv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x, self.offsets(x))


def small_cnn(block: Callable[[int], nn.Module], frozen: bool = False) -> nn.Module:
    norm = FrozenBatchNorm2d if frozen else nn.BatchNorm2d
    return nn.Sequential(
        Conv2dNormActivation(3, 8, 3, norm_layer=norm),
        block(8),
        Residual(8, norm),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        TorchvisionMLP(8, [16, 5], activation_layer=nn.ReLU),
    )


BLOCKS: dict[str, Callable[[], nn.Module]] = {
    "CBAM": partial(small_cnn, CBAM),
    "coordinate attention": partial(small_cnn, CoordinateAttention),
    "SqueezeExcitation": partial(small_cnn, lambda c: HeldSqueezeExcitation(c, 4)),
    "FrozenBatchNorm2d": partial(small_cnn, lambda c: HeldSqueezeExcitation(c, 4), frozen=True),
}


def built_block(name: str) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = BLOCKS[name]().to(F64)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, FrozenBatchNorm2d):  # statistics and an affine map as a trained backbone has them
                module.weight.uniform_(0.5, 1.5), module.running_var.uniform_(0.5, 1.5)
                module.bias.normal_(), module.running_mean.normal_()
    model = build(Case(name, lambda: model, 12, "cnn"))
    return model, torch.randn(2, 3, 12, 12, generator=torch.Generator().manual_seed(2), dtype=F64)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", BLOCKS)
def test_a_blocks_gates_are_held_as_if_detached_by_hand(name: str, preset: str):
    model, x = built_block(name)
    relevance, _, messages = explain(model, x, PRESETS[preset]())
    Held.detached = True
    try:
        twin, _, _ = explain(model, x, PRESETS[preset]())
    finally:
        Held.detached = False
    assert messages == []
    assert relative_error(relevance, twin) <= TWIN_TOLERANCE


@pytest.mark.parametrize("name", BLOCKS)
def test_cplrp_conserves_on_a_block_with_its_biases_zeroed(name: str):
    model, x = built_block(name)
    zero_biases(model)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, FrozenBatchNorm2d):  # buffers, which the gallery's zeroing leaves
                module.bias.zero_(), module.running_mean.zero_()
    relevance, y, messages = explain(model, x, CPLRP(epsilon=1e-12))
    ratios = relevance.flatten(1).sum(1) / y.max(-1).values
    assert messages == [] and (ratios - 1).abs().max() <= BLOCK_CONSERVATION, ratios


@pytest.mark.parametrize("preset", PRESETS)
def test_a_deformable_convolution_is_named(preset: str):
    model, x = built_block("CBAM")
    model[1] = Deformable(8).to(F64)
    _, _, messages = explain(model, x, PRESETS[preset]())
    assert any("module 'module.1.conv' (DeformConv2d)" in m and "deform_conv2d" in m for m in messages), messages


# --- timm families beside the gallery's ----------------------------------------------------------------------------


def tm(name: str, **kwargs) -> Callable[[], nn.Module]:
    return partial(timm.create_model, name, pretrained=False, num_classes=5, **kwargs)


CNNS = [
    Case("resnetblur18", tm("resnetblur18"), 32, "cnn"),
    *(
        Case(f"resnet18 ({attn})", tm("resnet18", block_args={"attn_layer": attn}), 32, "cnn")
        for attn in ("cbam", "gc")
    ),
    *(Case(f"resnet18 ({pool})", tm("resnet18", global_pool=pool), 32, "cnn") for pool in ("catavgmax", "max")),
    Case("resnet18 (lcbam)", tm("resnet18", block_args={"attn_layer": "lcbam"}), 32, "cnn"),
    Case("resnet18 (ceca)", tm("resnet18", block_args={"attn_layer": "ceca"}), 32, "cnn"),
    Case("seresnet33ts", tm("seresnet33ts"), 64, "cnn"),
    Case("resnetaa34d", tm("resnetaa34d"), 32, "cnn"),
    Case("cs3se_edgenet_x", tm("cs3se_edgenet_x"), 64, "cnn"),
    Case("convformer_s18", tm("convformer_s18"), 64, "cnn"),
    Case("mixer_s32_224", tm("mixer_s32_224", img_size=64), 64, "cnn"),
]
ATTENTION = [
    Case("mobilevitv2_050", tm("mobilevitv2_050"), 64, "attention"),
    Case("visformer_tiny", tm("visformer_tiny", img_size=64), 64, "attention"),
    Case("shvit_s1", tm("shvit_s1"), 64, "attention"),
    Case("gcvit_xxtiny", tm("gcvit_xxtiny", img_size=64), 64, "attention"),
    Case("efficientvim_m1", tm("efficientvim_m1"), 64, "attention"),
    Case("lowformer_b0", tm("lowformer_b0"), 64, "attention"),
    Case("mvitv2_tiny", tm("mvitv2_tiny", img_size=64), 64, "attention"),
    Case("fastvit_mci0", tm("fastvit_mci0"), 64, "attention"),
    Case("efficientvit_b0", tm("efficientvit_b0"), 64, "attention"),
    Case("coat_lite_tiny (avg pool)", tm("coat_lite_tiny", img_size=64, global_pool="avg"), 64, "attention"),
    Case("gcresnet33ts", tm("gcresnet33ts"), 64, "attention"),
]
CASES = {case.name: case for case in CNNS + ATTENTION}
DEFAULT = {"resnetblur18", "resnet18 (cbam)", "resnet18 (catavgmax)", "mixer_s32_224", "mobilevitv2_050"}
# Modules whose plain gradient CP-LRP uses, and names: EfficientViT's ReLU linear attention divides by its
# normaliser, a function of the same activations.
CPLRP_NAMED = {"efficientvit_b0": "LiteMLA"}


def marked(names) -> list:
    return [name if name in DEFAULT else pytest.param(name, marks=pytest.mark.gallery) for name in names]


@cache
def measured(name: str) -> dict:
    """Per preset: the ratios of relevance to logit with bias-like parameters zeroed and the warnings; and what the
    calls left changed."""
    case = CASES[name]
    model = zero_biases(build(case))
    x = torch.randn(2, 3, case.size, case.size, generator=torch.Generator().manual_seed(2), dtype=F64)
    with torch.no_grad():
        plain = model(x)
    before = fingerprint(model)
    result: dict = {"changed": [], "names": {n for n, _ in model.named_modules()}}
    for preset, mapper in {**PRESETS, "AttnLRP": AttnLRP}.items():
        relevance, y, messages = explain(model, x, mapper())
        if not torch.equal(y, plain) or not torch.isfinite(relevance).all():
            result["changed"].append(f"{preset}: output changed or relevance not finite")
        result[preset] = ((relevance.flatten(1).sum(1) / y.max(-1).values).tolist(), messages)
    changed = changes(before, fingerprint(model))
    if changed:
        result["changed"].append(changed)
    return result


def names_a_module(result: dict, message: str, kind: str = r"\w+") -> bool:
    found = re.search(rf"module 'module\.([\w.]+)' (?:\(also named [^)]*\) )?\(({kind})\)", message)
    return found is not None and found.group(1) in result["names"]


@pytest.mark.parametrize("name", marked(CASES))
def test_every_preset_leaves_the_output_and_the_model_as_they_were(name: str):
    assert measured(name)["changed"] == []


@pytest.mark.parametrize("name", marked(CASES))
def test_cplrp_conserves_or_names_the_modules_it_leaves_to_their_plain_gradient(name: str):
    result = measured(name)
    ratios, messages = result["CPLRP"]
    if name in CPLRP_NAMED:
        assert messages and all(names_a_module(result, m, CPLRP_NAMED[name]) for m in messages), messages
    else:
        assert messages == [] and all(abs(r - 1) <= CPLRP_TOLERANCE for r in ratios), (ratios, messages)


@pytest.mark.parametrize("name", marked(CASES))
def test_epsilon_gamma_box_conserves_or_names_a_module(name: str):
    result = measured(name)
    ratios, messages = result["EpsilonGammaBox"]
    if CASES[name].kind == "cnn":
        assert messages == [] and all(abs(r - 1) <= CNN_TOLERANCE for r in ratios), (ratios, messages)
    else:
        conserved = all(abs(r - 1) <= ATTENTION_TOLERANCE for r in ratios)
        assert conserved or (messages and all(names_a_module(result, m) for m in messages)), (ratios, messages)
