"""Vision models beyond image classification under every preset, in float64 with random weights.

Segmentation (torchvision's FCN, DeepLabV3 and LR-ASPP, Hugging Face's SegFormer and DPT: a pixel's class score
and a class's summed mask, given as callable targets), video (torchvision's R3D, MC3, R(2+1)D, S3D, MViT and
Swin3D on short clips), torchvision's quantization-ready models built with ``quantize=False`` (``QuantStub``,
``DeQuantStub``, ``FloatFunctional`` additions; also after ``fuse_model()`` in eval mode), and Hugging Face vision
CNNs and hybrids from tiny random configurations. Each is judged as the classification gallery judges
(tests/attribution/test_lrp_gallery.py, whose helpers it reuses): BatchNorm calibrated on random batches, then

1. every CNN preset and CP-LRP runs to finite relevance, the output is unchanged and the model is left
   bit-identical, with no hook or patched ``forward``;
2. LRP-0 is gradient × input (relative L2 error ≤ 1e-6) where the model is piecewise linear and homogeneous;
3. with bias-like parameters zeroed, relevance sums to the explained score within 10 % per sample under the
   presets a user would pick for the model's kind (and CP-LRP on gated models);
4. a CNN preset on an attention model conserves within 10 %, or raises or warns naming an attention module
   whose plain gradient it would use;
5. AttnLRP, where it runs, creates no relevance: ``|Σ relevance| ≤ 1.1 |score|``;
6. the presets a user would pick give no warning (but the ones ``EXPECTED_WARNINGS`` names).

``pytest tests/attribution/test_lrp_vision_tasks.py`` runs the small ones and the quantization-aware ResNet
(about 12 s on one core); ``pytest -m gallery tests/attribution/test_lrp_vision_tasks.py`` every model.
docs/model_gallery.md gives the figures (``python -m tests.attribution.test_lrp_vision_tasks --all`` prints
them).
"""

from __future__ import annotations

import math
import re
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache, partial

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, BaseRuleMapper
from tests.attribution.test_lrp_gallery import (
    ATTENTION,
    CNN_PRESETS,
    CONSERVATION_TOLERANCE,
    DEPTHWISE,
    LRP0_TOLERANCE,
    NARROW,
    PRESETS,
    RECTIFIED,
    changes,
    conserves,
    conserving,
    fingerprint,
    has_gates,
    piecewise_linear,
    randomise_zero_initialised,
)

torchvision = pytest.importorskip("torchvision")
transformers = pytest.importorskip("transformers")

F64 = torch.float64


# --- The models ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """A model: how to build it, its input shape, its kind and what is explained (``target``)."""

    name: str
    build: Callable[[], nn.Module] = field(repr=False, compare=False)
    shape: tuple[int, ...]
    kind: str
    target: str = "logit"  # "logit": the largest; "pixel": the centre pixel's top class; "mask": a class's map

    def __str__(self) -> str:
        return re.sub(r"[ ()/,]+", "-", self.name).strip("-")


class Output(nn.Module):
    """The model as a user wraps it: the tensor of a segmentation dict's ``"out"``, or a Hugging Face output's
    ``logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.model(x)
        if isinstance(y, dict) and "out" in y:
            return y["out"]
        return y.logits if hasattr(y, "logits") else y


def segmentation(name: str) -> Callable[[], nn.Module]:
    build = getattr(torchvision.models.segmentation, name)
    return partial(build, weights=None, weights_backbone=None, num_classes=5, aux_loss=False)


def video(name: str, **kwargs) -> Callable[[], nn.Module]:
    return partial(getattr(torchvision.models.video, name), weights=None, num_classes=5, **kwargs)


def s3d() -> nn.Module:
    """S3D with an adaptive last pooling: its own (2, 7, 7) pooling needs clips of 16 frames of 224 pixels."""
    model = torchvision.models.video.s3d(weights=None, num_classes=5)
    model.avgpool = nn.AdaptiveAvgPool3d(1)
    return model


def mvit(version: str) -> nn.Module:
    """MViT's block settings on 4 frames of 32 pixels (its position embeddings are sized by the clip)."""
    from torchvision.models.video import mvit as module

    build = module._mvit

    def small(**kwargs):
        return build(**{**kwargs, "spatial_size": (32, 32), "temporal_size": 4})

    module._mvit = small
    try:
        return getattr(module, f"mvit_{version}")(weights=None, num_classes=5)
    finally:
        module._mvit = build


def tiny_swin3d() -> nn.Module:
    from torchvision.models.video.swin_transformer import SwinTransformer3d

    return SwinTransformer3d(
        patch_size=[2, 4, 4],
        embed_dim=16,
        depths=[2, 2],
        num_heads=[2, 2],
        window_size=[2, 4, 4],
        stochastic_depth_prob=0.0,
        num_classes=5,
    )


def quantizable(name: str, fused: bool = False, **kwargs) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        model = getattr(torchvision.models.quantization, name)(weights=None, quantize=False, num_classes=5, **kwargs)
        if fused:  # calibrated first: fusing folds the BatchNorms into the convolutions
            model = calibrate(model.to(F64), (4, 3, 16, 16))
            model.fuse_model()
        return model

    return build


def hugging_face(model_class: str, config_class: str, **config) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        return getattr(transformers, model_class)(getattr(transformers, config_class)(num_labels=5, **config))

    return build


def unit_norm_scales(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    """BatchNorm scales of 1: Hugging Face's EfficientNet draws them as its weights, from N(0, 0.02²), and its
    activations vanish with depth (logits of 1e-35), below what any stabiliser leaves."""

    def with_unit_scales() -> nn.Module:
        model = build()
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.weight.fill_(1.0)
        return model

    return with_unit_scales


IMAGE, SMALL_CLIP = (2, 3, 32, 32), (2, 3, 4, 32, 32)
HF = {
    "ConvNext": hugging_face(
        "ConvNextForImageClassification", "ConvNextConfig", hidden_sizes=[8, 16], depths=[1, 1], num_stages=2
    ),
    "ConvNextV2": hugging_face(
        "ConvNextV2ForImageClassification", "ConvNextV2Config", hidden_sizes=[8, 16], depths=[1, 1], num_stages=2
    ),
    "ResNet": hugging_face(
        "ResNetForImageClassification",
        "ResNetConfig",
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        layer_type="basic",
    ),
    "ResNet (bottleneck)": hugging_face(
        "ResNetForImageClassification", "ResNetConfig", embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1]
    ),
    "RegNet": hugging_face(
        "RegNetForImageClassification",
        "RegNetConfig",
        embedding_size=8,
        hidden_sizes=[8, 16],
        depths=[1, 1],
        groups_width=4,
    ),
    "MobileNetV1": hugging_face(
        "MobileNetV1ForImageClassification", "MobileNetV1Config", image_size=32, depth_multiplier=0.25
    ),
    "MobileNetV2": hugging_face(
        "MobileNetV2ForImageClassification", "MobileNetV2Config", image_size=32, depth_multiplier=0.35
    ),
    "EfficientNet": unit_norm_scales(
        hugging_face(
            "EfficientNetForImageClassification",
            "EfficientNetConfig",
            image_size=32,
            width_coefficient=0.25,
            depth_coefficient=0.25,
            hidden_dim=320,
        )
    ),
    "PoolFormer": hugging_face(
        "PoolFormerForImageClassification", "PoolFormerConfig", hidden_sizes=[8, 16, 16, 32], depths=[1, 1, 1, 1]
    ),
    "MobileViT": hugging_face(
        "MobileViTForImageClassification",
        "MobileViTConfig",
        image_size=32,
        patch_size=2,
        hidden_sizes=[16, 16, 16],
        neck_hidden_sizes=[8, 8, 16, 16, 16, 32, 64],
        num_attention_heads=2,
    ),
    "LeViT": hugging_face(
        "LevitForImageClassification",
        "LevitConfig",
        image_size=64,
        hidden_sizes=[16, 32, 48],
        num_attention_heads=[1, 2, 3],
        depths=[1, 1, 1],
        key_dim=[8, 8, 8],
    ),
    "Swinv2": hugging_face(
        "Swinv2ForImageClassification",
        "Swinv2Config",
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 2],
        window_size=4,
    ),
    "SegFormer": hugging_face(
        "SegformerForSemanticSegmentation",
        "SegformerConfig",
        hidden_sizes=[8, 16],
        depths=[1, 1],
        num_encoder_blocks=2,
        sr_ratios=[2, 1],
        num_attention_heads=[1, 2],
        decoder_hidden_size=16,
        patch_sizes=[7, 3],
        strides=[4, 2],
    ),
    "DPT": hugging_face(
        "DPTForSemanticSegmentation",
        "DPTConfig",
        image_size=32,
        patch_size=16,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=2,
        intermediate_size=64,
        backbone_out_indices=[0, 1, 2, 3],
        neck_hidden_sizes=[8, 8, 8, 8],
        fusion_hidden_size=16,
    ),
}
HF_KINDS = {
    "ConvNext": DEPTHWISE,
    "ConvNextV2": DEPTHWISE,
    "ResNet": RECTIFIED,
    "ResNet (bottleneck)": NARROW,
    "RegNet": NARROW,
    "MobileNetV1": DEPTHWISE,
    "MobileNetV2": DEPTHWISE,
    "EfficientNet": DEPTHWISE,
    "PoolFormer": DEPTHWISE,  # GroupNorm'd, unrectified inputs to its 1×1 convolutions
}
HF_SHAPES = {"LeViT": (2, 3, 64, 64)}
HF_TARGETS = {"SegFormer": "pixel", "DPT": "pixel"}


def hf_case(name: str) -> Case:
    return Case(
        f"transformers/{name}",
        HF[name],
        HF_SHAPES.get(name, IMAGE),
        HF_KINDS.get(name, ATTENTION),
        HF_TARGETS.get(name, "logit"),
    )


# The default run: about 10 s on one core.
SMALL = [
    Case(
        "torchvision/lraspp_mobilenet_v3_large (pixel)",
        segmentation("lraspp_mobilenet_v3_large"),
        IMAGE,
        DEPTHWISE,
        "pixel",
    ),
    Case("torchvision/SwinTransformer3d (4 blocks)", tiny_swin3d, SMALL_CLIP, ATTENTION),
    Case("torchvision/s3d (adaptive pooling)", s3d, (2, 3, 8, 32, 32), RECTIFIED),
    Case("torchvision/quantization/shufflenet_v2_x0_5", quantizable("shufflenet_v2_x0_5"), (2, 3, 16, 16), DEPTHWISE),
    Case(
        "torchvision/quantization/mobilenet_v2 (fused)",
        quantizable("mobilenet_v2", fused=True),
        (2, 3, 16, 16),
        DEPTHWISE,
    ),
    *(hf_case(name) for name in ("ConvNext", "ResNet", "MobileNetV1", "LeViT", "Swinv2", "SegFormer", "MobileViT")),
]

ALL = [
    *(
        Case(f"torchvision/{name} ({target})", segmentation(name), IMAGE, kind, target)
        for name, kind in (
            ("fcn_resnet50", RECTIFIED),
            ("deeplabv3_resnet50", RECTIFIED),
            ("deeplabv3_mobilenet_v3_large", DEPTHWISE),
            ("lraspp_mobilenet_v3_large", DEPTHWISE),
        )
        for target in ("pixel", "mask")
    ),
    *(Case(f"torchvision/{name}", video(name), SMALL_CLIP, RECTIFIED) for name in ("r3d_18", "mc3_18", "r2plus1d_18")),
    Case("torchvision/s3d (adaptive pooling)", s3d, (2, 3, 8, 32, 32), RECTIFIED),
    Case("torchvision/mvit_v1_b (4×32² clips)", partial(mvit, "v1_b"), SMALL_CLIP, ATTENTION),
    Case("torchvision/mvit_v2_s (4×32² clips)", partial(mvit, "v2_s"), SMALL_CLIP, ATTENTION),
    Case("torchvision/swin3d_t", video("swin3d_t"), SMALL_CLIP, ATTENTION),
    *(
        Case(
            f"torchvision/quantization/{name}{' (fused)' if fused else ''}",
            quantizable(name, fused, **extra),
            (2, 3, size, size),
            kind,
        )
        for name, kind, size, extra in (
            ("resnet18", RECTIFIED, 16, {}),
            ("googlenet", RECTIFIED, 16, {"init_weights": True, "aux_logits": False}),
            ("inception_v3", RECTIFIED, 75, {"init_weights": True, "aux_logits": False}),
            ("mobilenet_v2", DEPTHWISE, 16, {}),
            ("mobilenet_v3_large", DEPTHWISE, 16, {}),
            ("shufflenet_v2_x0_5", DEPTHWISE, 16, {}),
        )
        for fused in (False, True)
        if not (fused and name in ("googlenet", "inception_v3"))
    ),
    *(hf_case(name) for name in HF),
]


# --- Building and measuring --------------------------------------------------------------------------------------


def calibrate(model: nn.Module, shape: tuple[int, ...], batches: int = 2) -> nn.Module:
    """BatchNorm running statistics of a few random batches (only the BatchNorms in training mode)."""
    model.eval()
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
        norm.train()
    if norms:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for _ in range(batches):
                model(torch.randn(4, *shape[1:], generator=generator, dtype=F64))
    return model.eval()


def build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    model = Output(case.build()).to(F64)
    randomise_zero_initialised(model)
    return calibrate(model, case.shape)


# The classification gallery's, and MViT's position encodings, LeViT's attention biases, relative position tables.
BIAS_LIKE = re.compile(
    r"(^|\.)(bias|\w*pos\w*embed\w*|\w*position_embeddings?|pos_embedding|cls_token|class_token|"
    r"\w*_pos|rel_pos_\w|attention_biases)$"
)


def zero_biases(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if BIAS_LIKE.search(name) or "relative_position_bias" in name:
                parameter.zero_()
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.running_mean is not None:
                module.running_mean.zero_()
    return model


def seed(output: torch.Tensor, target: str) -> torch.Tensor:
    """The initial gradient: one at the largest logit, at the centre pixel's top class, or over a class's map."""
    batch = torch.arange(output.shape[0])
    one_hot = torch.zeros_like(output)
    if target == "logit":
        one_hot[batch, output.argmax(-1)] = 1
    elif target == "pixel":
        h, w = output.shape[-2] // 2, output.shape[-1] // 2
        one_hot[batch, output[:, :, h, w].argmax(1), h, w] = 1
    else:
        one_hot[batch, output.mean((-2, -1)).argmax(1)] = 1
    return one_hot


@dataclass
class Report:
    case: Case
    piecewise_linear: bool
    gated: bool
    lrp0_error: float | str
    ratios: dict[str, tuple[float, ...] | str]
    warned: dict[str, list[str]]
    left_changed: dict[str, str]
    module_names: frozenset[str]
    seconds: float

    def names_a_module(self, text: str) -> bool:
        return any(re.search(rf"'module\.{re.escape(name)}'", text) for name in self.module_names if name)


def explain(model: nn.Module, x: torch.Tensor, mapper, target: str):
    lrp = LRP(
        TensorDictModule(model, in_keys=["x"], out_keys=["y"]),
        rule_mapper=mapper,
        target=lambda y: y * seed(y.detach(), target),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        td = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))
    return td["relevance", "x"], td["y"], [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def measure(case: Case) -> Report:
    start = time.perf_counter()
    model = build(case)
    x = torch.randn(case.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    with torch.no_grad():
        plain_output = model(x)
    left_changed: dict[str, str] = {}
    warned: dict[str, list[str]] = {}
    before = fingerprint(model)

    def run(label: str, mapper):
        try:
            relevance, output, messages = explain(model, x, mapper, case.target)
        except Exception as error:  # noqa: BLE001 - recorded, and judged by the tests
            return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"
        warned[label] = messages
        if not torch.equal(output, plain_output):
            left_changed[label] = "output changed"
        return relevance, output

    result = run("LRP-0", BaseRuleMapper(stabilizer=1e-12))
    if isinstance(result, str):
        lrp0_error: float | str = result
    else:
        leaf = x.clone().requires_grad_(True)
        output = model(leaf)
        (grad,) = torch.autograd.grad((output * seed(output.detach(), case.target)).sum(), leaf)
        lrp0_error = ((result[0] - x * grad).norm() / (x * grad).norm()).item()
    changed = changes(before, fingerprint(model))
    if changed:
        left_changed["LRP-0"] = changed

    zero_biases(model)
    with torch.no_grad():
        plain_output = model(x)
    before = fingerprint(model)
    gated = has_gates(model)
    ratios: dict[str, tuple[float, ...] | str] = {}
    for preset in (p for p in PRESETS if p != "AttnLRP" or case.kind == ATTENTION or gated):
        result = run(preset, PRESETS[preset]())
        if isinstance(result, str):
            ratios[preset] = result
            continue
        relevance, output = result
        score = (output * seed(output, case.target)).flatten(1).sum(1)
        finite = bool(torch.isfinite(relevance).all())
        ratios[preset] = tuple((relevance.flatten(1).sum(1) / score).tolist()) if finite else "relevance not finite"
    changed = changes(before, fingerprint(model))
    if changed:
        left_changed["presets"] = changed
    return Report(
        case,
        piecewise_linear(model.model),
        gated,
        lrp0_error,
        ratios,
        warned,
        left_changed,
        frozenset(name for name, _ in model.named_modules()),
        time.perf_counter() - start,
    )


@cache
def report(case: Case) -> Report:
    """The model's report, measured once per session (every test of a model reads the same one)."""
    return measure(case)


# Warnings a model is expected to give under every conserving preset, by case. None now: Hugging Face's ConvNeXt V2
# global response norm (ConvNextV2GRN, x * vector_norm(x) / mean(vector_norm(x)), in a module not named like a norm)
# had its plain gradient and a warning; its statistic is now held as F.normalize's is, the relevance equal to that of
# the same model with the statistic detached, and no warning is given.
EXPECTED_WARNINGS: dict[str, str] = {}

ATTENTION_MODULE = re.compile(r"module 'module\.[\w.]+' \((\w*Attention\w*)\) computes")


# --- The tests ---------------------------------------------------------------------------------------------------


class Checks:
    def test_presets_run_and_leave_the_model_unchanged(self, case: Case):
        r = report(case)
        assert r.left_changed == {}
        for preset in (*CNN_PRESETS, "CPLRP"):
            outcome = r.ratios[preset]
            if isinstance(outcome, str):  # only a CNN preset on an attention model may refuse, by name
                assert case.kind == ATTENTION and preset != "CPLRP" and r.names_a_module(outcome), outcome
            else:
                assert all(math.isfinite(v) for v in outcome), (preset, outcome)

    def test_lrp0_is_gradient_times_input_on_piecewise_linear_models(self, case: Case):
        r = report(case)
        assert not isinstance(r.lrp0_error, str), r.lrp0_error
        if r.piecewise_linear:
            assert r.lrp0_error <= LRP0_TOLERANCE

    def test_relevance_is_conserved_under_the_presets_a_user_would_pick(self, case: Case):
        r = report(case)
        failed = {p: r.ratios[p] for p in conserving(r) if not conserves(r.ratios[p])}
        assert failed == {}

    def test_the_presets_a_user_would_pick_warn_only_where_expected(self, case: Case):
        r = report(case)
        expected = EXPECTED_WARNINGS.get(case.name)
        for preset in conserving(r):
            messages = r.warned.get(preset, [])
            if expected is None:
                assert messages == [], (preset, messages)
            else:
                assert messages and all(expected in message for message in messages), (preset, messages)

    def test_attnlrp_creates_no_relevance(self, case: Case):
        outcome = report(case).ratios.get("AttnLRP")
        if outcome is not None:
            assert not isinstance(outcome, str) and all(abs(v) <= 1.0 + CONSERVATION_TOLERANCE for v in outcome)


class AttentionChecks:
    def test_cnn_presets_on_attention_conserve_or_name_the_attention(self, case: Case):
        r = report(case)
        for preset in CNN_PRESETS:
            outcome = r.ratios[preset]
            named = isinstance(outcome, str) and r.names_a_module(outcome)
            warned = any(ATTENTION_MODULE.search(message) for message in r.warned.get(preset, ()))
            assert conserves(outcome) or named or warned, (preset, outcome)


@pytest.mark.parametrize("case", SMALL, ids=str)
class TestSmall(Checks):
    """A segmentation, a video, two quantization-ready and seven Hugging Face models, small."""


@pytest.mark.gallery
@pytest.mark.parametrize("case", ALL, ids=str)
class TestAll(Checks):
    """Every model: ``pytest -m gallery``."""


@pytest.mark.parametrize("case", [c for c in SMALL if c.kind == ATTENTION], ids=str)
class TestSmallAttention(AttentionChecks):
    """CNN presets on the small attention models."""


@pytest.mark.gallery
@pytest.mark.parametrize("case", [c for c in ALL if c.kind == ATTENTION], ids=str)
class TestAllAttention(AttentionChecks):
    """CNN presets on every attention model: ``pytest -m gallery``."""


@cache
def quantization_aware_resnet18() -> nn.Module:
    """torchvision's quantization-ready ResNet-18 prepared for quantization-aware training (``prepare_qat``), its
    fake quantisation and observers off: it computes what the float model computes, with ConvBnReLU2d layers."""
    from torch.ao import quantization

    model = calibrate(quantizable("resnet18")().to(F64), (4, 3, 16, 16)).float().train()
    model.fuse_model(is_qat=True)
    model.qconfig = quantization.get_default_qat_qconfig("x86")
    quantization.prepare_qat(model, inplace=True)
    with torch.no_grad():  # the observers see one batch: the fake quantisers' scales are then defined
        model(torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1)))
    model.apply(quantization.disable_observer)
    model.apply(quantization.disable_fake_quant)  # fake quantisation runs in float32 only
    return model.to(F64).eval()


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
@pytest.mark.parametrize("preset", CNN_PRESETS)
def test_quantization_aware_model_is_refused_by_its_fused_layers(preset: str):
    """The modified rules would run through the ReLU inside ConvBnReLU2d (α2β1 gave 79 times the logit, z⁺ a
    relevance 61 % away from the float model's, with no error): they refuse, naming the layer."""
    model = quantization_aware_resnet18()
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2), dtype=F64)
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"ConvBnReLU2d: its forward is not affine"):
        explain(model, x, PRESETS[preset](), "logit")
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())


# --- The figures of docs/model_gallery.md --------------------------------------------------------------------------


def row(r: Report) -> str:
    def cell(preset: str) -> str:
        outcome = r.ratios.get(preset)
        if outcome is None:
            return "—"
        if isinstance(outcome, str):
            return f"raises {outcome.split(':')[0]}"
        low, high = min(outcome), max(outcome)
        text = f"{low:.3g}" if f"{low:.3g}" == f"{high:.3g}" else f"{low:.3g}–{high:.3g}"
        text = f"**{text}**" if preset in conserving(r) else text
        return text + (" (warns)" if r.warned.get(preset) else "")

    lrp0 = r.lrp0_error if isinstance(r.lrp0_error, str) else f"{r.lrp0_error:.1e}"
    lrp0 += " (p.l.)" if r.piecewise_linear else ""
    shape = "×".join(str(s) for s in r.case.shape[1:])
    cells = [r.case.name, shape, r.case.kind, r.case.target, lrp0, *(cell(p) for p in PRESETS)]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    cases = ALL if "--all" in (argv or sys.argv[1:]) else SMALL
    torch.set_num_threads(1)
    print("| model | input | kind | target | LRP-0 rel. error | " + " | ".join(PRESETS) + " |")
    print("| --- " * (5 + len(PRESETS)) + "|")
    for case in cases:
        r = measure(case)
        print(row(r), flush=True)
        print(f"{case.name}: {r.seconds:.1f} s {r.left_changed}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
