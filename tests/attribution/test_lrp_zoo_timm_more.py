"""timm families the gallery leaves out, in float64 with random weights, each against an oracle.

Each model is built as the gallery builds it (``pretrained=False``, float64, zero-initialised weights randomised,
BatchNorm calibrated on random batches, eval mode), small: the smallest input it takes (16 to 64 pixels, 56 for
Swin), batch 2, attention models cut to one or two blocks a stage. The families: LeViT (Linear + BatchNorm on
flattened tokens, attention biases), XCiT (cross-covariance attention of normalised queries and keys), PiT, Twins
(SVT and PCPVT), TNT, CrossViT, DaViT, EfficientFormer v2, EfficientViT (MSRA), timm's Swin and Swin v2, ViT with
relative positions and the hybrid ResNet-ViT, MambaOut, ResMLP (``Affine``), gMLP (spatial gating), LambdaNet,
iFormer (at 16 pixels: attention over one token), EdgeNeXt, the legacy SE-ResNet, SK-ResNet (a softmax over kernel
branches), ResNeSt (split attention, a softmax over radix branches) and the legacy Xception.

1. Under every preset tried the outputs are the model's own, and parameters, buffers and hooks are left as they
   were.
2. With every bias-like parameter zeroed (the gallery's zeroing: biases, BatchNorm running means, position
   embeddings and tables, XCiT's and EdgeNeXt's Fourier position encodings, class tokens, CrossViT's class tokens
   of each branch, TNT's pixel and patch positions), CP-LRP conserves: relevance sums to the explained logit within
   1e-6 per sample. AttnLRP creates none (``|Σ R| ≤ 1.1 |logit|``), and conserves within 1e-6 where softmax
   weights mix branches (SK-ResNet, ResNeSt: held, as gates are) or attend one token (iFormer at 16 pixels).
3. The CNN presets (EpsilonPlus, EpsilonGammaBox) conserve within 10 %, or the call warns naming a module of the
   model (attention, selective kernels).
4. LRP-0 is gradient × input on the piecewise-linear nets (SK-ResNet's softmax and LambdaNet's lambdas get their
   plain gradient under LRP-0, so the identity holds there too).
5. With BatchNorm scales of both signs (as trained models have), the relevance under EpsilonPlus, EpsilonGammaBox
   and EpsilonAlpha2Beta1 equals the relevance of the same model with every BatchNorm folded by hand into the
   convolution or Linear layer before it (relative L2 error ≤ 1e-9): SE-ResNet, SK-ResNet, LeViT (whose BatchNorms
   normalise a Linear layer's output flattened over tokens) and EfficientViT (MSRA).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from functools import partial

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import CPLRP, LRP, AttnLRP, BaseRuleMapper, EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus
from tests.attribution.test_lrp_gallery import (
    Case,
    build,
    changes,
    fingerprint,
    gradient_times_input,
    zero_biases,
)
from tests.conftest import relative_error

timm = pytest.importorskip("timm")

F64 = torch.float64
BATCH = 2
CPLRP_TOLERANCE = 1e-6
CNN_TOLERANCE = 0.1
LRP0_TOLERANCE = 1e-6
FOLDED_TOLERANCE = 1e-9


def tm(name: str, **kwargs) -> Callable[[], nn.Module]:
    return partial(timm.create_model, name, pretrained=False, **kwargs)


ONE_A_STAGE = {"depths": (1, 1, 1, 1)}
ATTENTION = [
    Case("levit_128s", tm("levit_128s", img_size=64), 64, "attention"),
    Case("xcit_nano_12_p16_224", tm("xcit_nano_12_p16_224", img_size=32, depth=2), 32, "attention"),
    Case("pit_ti_224", tm("pit_ti_224", img_size=64), 64, "attention"),
    Case("twins_svt_small", tm("twins_svt_small", img_size=64, **ONE_A_STAGE), 64, "attention"),
    Case("twins_pcpvt_small", tm("twins_pcpvt_small", img_size=64, **ONE_A_STAGE), 64, "attention"),
    Case("tnt_s_patch16_224", tm("tnt_s_patch16_224", img_size=32, depth=2), 32, "attention"),
    Case("crossvit_tiny_240", tm("crossvit_tiny_240", img_size=48, img_scale=(1.0, 1.0)), 48, "attention"),
    Case("davit_tiny", tm("davit_tiny", **ONE_A_STAGE), 64, "attention"),
    Case("efficientformerv2_s0", tm("efficientformerv2_s0", img_size=64, **ONE_A_STAGE), 64, "attention"),
    Case("efficientvit_m0", tm("efficientvit_m0", img_size=64), 64, "attention"),
    Case(
        "swin_tiny_patch4_window7_224", tm("swin_tiny_patch4_window7_224", img_size=56, **ONE_A_STAGE), 56, "attention"
    ),
    Case(
        "swinv2_tiny_window8_256",
        tm("swinv2_tiny_window8_256", img_size=64, window_size=2, **ONE_A_STAGE),
        64,
        "attention",
    ),
    Case("vit_relpos_small_patch16_224", tm("vit_relpos_small_patch16_224", img_size=32, depth=2), 32, "attention"),
    Case("vit_tiny_r_s16_p8_224", tm("vit_tiny_r_s16_p8_224", img_size=64, depth=2), 64, "attention"),
    Case("mambaout_femto", tm("mambaout_femto", **ONE_A_STAGE), 64, "attention"),
    Case("resmlp_12_224", tm("resmlp_12_224", img_size=32), 32, "attention"),
    Case("gmlp_ti16_224", tm("gmlp_ti16_224", img_size=32), 32, "attention"),
    Case("lambda_resnet26t", tm("lambda_resnet26t", img_size=64), 64, "attention"),
    Case("iformer_t", tm("iformer_t"), 16, "attention"),
]
CNNS = [
    Case("edgenext_xx_small", tm("edgenext_xx_small"), 64, "cnn"),
    Case("resnest14d", tm("resnest14d"), 16, "cnn"),
    Case("legacy_seresnet18", tm("legacy_seresnet18"), 32, "cnn"),
    Case("skresnet18", tm("skresnet18"), 32, "cnn"),
    Case("legacy_xception", tm("legacy_xception"), 32, "cnn"),
]
CASES = {case.name: case for case in ATTENTION + CNNS}
# The default run: one model of each kind of layer these families add (LeViT's flattened BatchNorms, XCiT's
# normalised cross-covariance, TNT's nested tokens, ResMLP's Affine, relative positions, selective kernels, SE
# gates, EdgeNeXt's transposed attention); ``pytest -m gallery`` every model above.
DEFAULT = {
    "levit_128s",
    "xcit_nano_12_p16_224",
    "tnt_s_patch16_224",
    "resmlp_12_224",
    "vit_relpos_small_patch16_224",
    "edgenext_xx_small",
    "legacy_seresnet18",
    "skresnet18",
}
# Depthwise convolutions on unrectified inputs, where z⁺ drops the relevance of outputs with no positive
# contribution, by design (docs/model_gallery.md): EpsilonGammaBox must conserve, EpsilonPlus is not judged.
DEPTHWISE = {"legacy_xception"}
# Piecewise linear but for functions LRP-0 differentiates as they are (SK-ResNet's softmax, LambdaNet's softmax).
PIECEWISE_LINEAR = ["skresnet18", "legacy_xception", "lambda_resnet26t"]
# Nets whose BatchNorms each follow a convolution or a Linear layer (LeViT's two last ones normalise the pooled
# features: they keep the ε-rule in both models).
FOLDED = ["legacy_seresnet18", "skresnet18", "levit_128s", "efficientvit_m0"]


def marked(names) -> list:
    """The names, those outside the default run marked ``gallery``."""
    return [name if name in DEFAULT else pytest.param(name, marks=pytest.mark.gallery) for name in names]


def inputs(case: Case) -> torch.Tensor:
    return torch.randn(BATCH, 3, case.size, case.size, generator=torch.Generator().manual_seed(2), dtype=F64)


def explain(model: nn.Module, x: torch.Tensor, mapper) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The relevance of the largest logit, the output written, and the messages of the warnings raised."""
    lrp = LRP(TensorDictModule(model, in_keys=["x"], out_keys=["y"]), rule_mapper=mapper)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        td = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))
    return td["relevance", "x"], td["y"], [str(w.message) for w in caught]


_MODELS: dict[str, nn.Module] = {}


def zero_bias_model(name: str) -> nn.Module:
    """The model with its bias-like parameters zeroed, built once per session."""
    if name not in _MODELS:
        _MODELS[name] = zero_biases(build(CASES[name]))
    return _MODELS[name]


def ratios(relevance: torch.Tensor, output: torch.Tensor) -> list[float]:
    return (relevance.flatten(1).sum(1) / output.max(-1).values).tolist()


@pytest.mark.parametrize("name", marked(CASES))
class TestFamilies:
    def test_cplrp_conserves_and_leaves_outputs_and_model_as_they_were(self, name: str):
        model = zero_bias_model(name)
        x = inputs(CASES[name])
        with torch.no_grad():
            expected = model(x)
        before = fingerprint(model)
        relevance, output, _ = explain(model, x, CPLRP())
        assert changes(before, fingerprint(model)) is None
        assert torch.allclose(output, expected, rtol=1e-12, atol=1e-12)
        assert torch.isfinite(relevance).all()
        assert all(abs(r - 1.0) <= CPLRP_TOLERANCE for r in ratios(relevance, output)), ratios(relevance, output)


CNN_PRESET_CASES = [
    pytest.param(name, preset, marks=() if name in DEFAULT else pytest.mark.gallery, id=f"{preset}-{name}")
    for name in CASES
    for preset in ("EpsilonPlus", "EpsilonGammaBox")
    if not (preset == "EpsilonPlus" and name in DEPTHWISE)
]


@pytest.mark.parametrize(("name", "preset"), CNN_PRESET_CASES)
def test_cnn_presets_conserve_or_warn_naming_a_module(name: str, preset: str):
    model = zero_bias_model(name)
    x = inputs(CASES[name])
    mapper = EpsilonPlus() if preset == "EpsilonPlus" else EpsilonGammaBox(-10.0, 10.0)
    before = fingerprint(model)
    relevance, output, messages = explain(model, x, mapper)
    assert changes(before, fingerprint(model)) is None
    with torch.no_grad():
        assert torch.allclose(output, model(x), rtol=1e-12, atol=1e-12)
    assert torch.isfinite(relevance).all()
    if all(abs(r - 1.0) <= CNN_TOLERANCE for r in ratios(relevance, output)):
        return
    modules = {path for path, _ in model.named_modules() if path}
    named = [m for m in messages if any(f"'module.{path}'" in m for path in modules)]
    assert named, f"{preset}: ratios {ratios(relevance, output)} with no warning naming a module ({messages[:2]})"


@pytest.mark.parametrize("name", marked(case.name for case in ATTENTION))
def test_attnlrp_creates_no_relevance(name: str):
    model = zero_bias_model(name)
    relevance, output, _ = explain(model, inputs(CASES[name]), AttnLRP())
    assert all(abs(r) <= 1.0 + CNN_TOLERANCE for r in ratios(relevance, output)), ratios(relevance, output)


# A softmax's weights mixing branches (SK-ResNet's selective kernels, ResNeSt's split attention) and attention over one
# token (iFormer at 16 pixels): AttnLRP summed to 0.02-0.05, 0.11-0.15 and 1.05 / -14.4 times the logit there.
ATTNLRP_CONSERVING = ["skresnet18", "resnest14d", "iformer_t"]


@pytest.mark.parametrize("name", ATTNLRP_CONSERVING)
def test_attnlrp_conserves_where_softmax_weights_mix_branches_or_attend_one_token(name: str):
    model = zero_bias_model(name)
    relevance, output, _ = explain(model, inputs(CASES[name]), AttnLRP())
    assert all(abs(r - 1.0) <= CPLRP_TOLERANCE for r in ratios(relevance, output)), ratios(relevance, output)


@pytest.mark.parametrize("name", marked(PIECEWISE_LINEAR))
def test_lrp0_is_gradient_times_input(name: str):
    model = build(CASES[name])
    x = inputs(CASES[name])
    relevance, _, _ = explain(model, x, BaseRuleMapper(stabilizer=1e-12))
    assert relative_error(relevance, gradient_times_input(model, x)) <= LRP0_TOLERANCE


def with_signed_scales(model: nn.Module) -> nn.Module:
    """BatchNorm scales of both signs and small shifts, as trained models have."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.weight.copy_(torch.randn(module.weight.shape, generator=generator, dtype=F64))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator, dtype=F64))
    return model


def folded(model: nn.Module) -> tuple[nn.Module, int]:
    """A copy of ``model`` with each BatchNorm that follows a convolution or Linear layer (the child registered just
    before it, of matching width) folded into that layer's weight and bias; timm's ``BatchNormAct2d`` leaves its
    activation. The number folded."""
    model, count = copy.deepcopy(model), 0
    for parent in list(model.modules()):
        children = list(parent.named_children())
        for (_, layer), (name, norm) in zip(children, children[1:], strict=False):
            if not (
                isinstance(layer, (nn.Conv2d, nn.Linear))
                and isinstance(norm, nn.modules.batchnorm._BatchNorm)
                and layer.weight.shape[0] == norm.num_features
            ):
                continue
            scale = norm.weight / (norm.running_var + norm.eps).sqrt()
            with torch.no_grad():
                if layer.bias is None:
                    layer.bias = nn.Parameter(torch.zeros(layer.weight.shape[0], dtype=F64))
                layer.weight.mul_(scale.view(-1, *[1] * (layer.weight.dim() - 1)))
                layer.bias.copy_((layer.bias - norm.running_mean) * scale + norm.bias)
            setattr(parent, name, nn.Sequential(norm.drop, norm.act) if hasattr(norm, "act") else nn.Identity())
            count += 1
    return model, count


_FOLDED_PAIRS: dict[str, tuple[nn.Module, nn.Module]] = {}


def folded_pair(name: str) -> tuple[nn.Module, nn.Module]:
    """The model with BatchNorm scales of both signs and its copy folded by hand, built once per session."""
    if name not in _FOLDED_PAIRS:
        model = with_signed_scales(build(CASES[name]))
        by_hand, count = folded(model)
        x = inputs(CASES[name])
        with torch.no_grad():
            assert count > 0 and relative_error(by_hand(x), model(x)) <= 1e-12
        _FOLDED_PAIRS[name] = model, by_hand
    return _FOLDED_PAIRS[name]


@pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox", "EpsilonAlpha2Beta1"])
@pytest.mark.parametrize("name", marked(FOLDED))
def test_batch_norms_merge_as_folded_by_hand(name: str, preset: str):
    model, by_hand = folded_pair(name)
    x = inputs(CASES[name])
    mapper = {
        "EpsilonPlus": EpsilonPlus,
        "EpsilonGammaBox": partial(EpsilonGammaBox, -10.0, 10.0),
        "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
    }[preset]
    relevance, _, _ = explain(model, x, mapper())
    expected, _, _ = explain(by_hand, x, mapper())
    assert relative_error(relevance, expected) <= FOLDED_TOLERANCE
