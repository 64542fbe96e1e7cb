"""torchvision's detection and instance-segmentation models under every CNN preset, in float64 with random
weights.

A user explains a detector by wrapping it in a module that takes an image batch and returns a tensor of scores:

* the class logits of each image's first region proposal, before the softmax and NMS (Faster R-CNN);
* the classification head's logits at every anchor or location (RetinaNet, FCOS, SSD), the target their largest;
* the mask logits of each image's top detection after NMS (Mask R-CNN; Keypoint R-CNN's heat maps alike, too slow
  in float64 to run here);
* the top detection's score or box coordinate, through the model's own post-processing (softmax or sigmoid, box
  decoding, NMS, top-k): any model.

Through those run ``GeneralizedRCNNTransform`` (normalisation, resizing by ``interpolate``), the FPN's nearest
upsampling, ``MultiScaleRoIAlign`` on proposals decoded from detached anchors, and index selection. Built with
``weights=None, weights_backbone=None`` (BatchNorm2d, calibrated on random batches as the galleries do) and also
as a pretrained backbone holds them: ``FrozenBatchNorm2d`` and frozen first layers. For each model:

1. every CNN preset runs to finite relevance, the output is unchanged and the model is left bit-identical, with no
   hook or patched ``forward``; every warning names a module;
2. LRP-0 is gradient × input (relative L2 error ≤ 1e-6) where the model is piecewise linear;
3. with bias-like parameters zeroed (biases, BatchNorm means, the transform's image mean), relevance sums to the
   explained logit within 10 % per sample under the presets a user would pick for the backbone's kind;
4. frozen BatchNorms are merged as BatchNorms are: the same relevance, under every preset.

``pytest tests/attribution/test_lrp_detection.py`` runs a narrow Faster R-CNN and RetinaNet on two stages of a
ResNet-18 under a 32-channel FPN, at 32 pixels (about 10 s on one core); ``pytest -m gallery
tests/attribution/test_lrp_detection.py`` every model named above. docs/model_gallery.md gives the findings.
"""

from __future__ import annotations

import copy
import math
import re
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
    CNN_PRESETS,
    CONSERVING,
    DEPTHWISE,
    LRP0_TOLERANCE,
    PRESETS,
    RECTIFIED,
    calibrate,
    changes,
    conserves,
    fingerprint,
)

torchvision = pytest.importorskip("torchvision")
from torchvision.models import detection  # noqa: E402
from torchvision.models.detection.backbone_utils import BackboneWithFPN  # noqa: E402
from torchvision.ops.misc import FrozenBatchNorm2d  # noqa: E402

F64 = torch.float64
BATCH = 2


# --- What a user wraps ---------------------------------------------------------------------------------------------


class ProposalLogits(nn.Module):
    """An R-CNN's class logits of each image's first region proposal, before the softmax and NMS."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.model
        images, _ = m.transform(list(x))
        features = m.backbone(images.tensors)
        proposals, _ = m.rpn(images, features)
        pooled = m.roi_heads.box_roi_pool(features, proposals, images.image_sizes)
        logits, _ = m.roi_heads.box_predictor(m.roi_heads.box_head(pooled))
        first = torch.tensor([0] + [len(p) for p in proposals[:-1]]).cumsum(0)
        return logits[first]


class HeadLogits(nn.Module):
    """A single-stage detector's classification logits at every anchor or location, flattened."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        images, _ = self.model.transform(list(x))
        features = list(self.model.backbone(images.tensors).values())
        return self.model.head(features)["cls_logits"].flatten(1)


class InstanceLogits(nn.Module):
    """Mask R-CNN's mask logits (class 1), or Keypoint R-CNN's heat maps, of each image's top detection after NMS."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        m, heads = self.model, self.model.roi_heads
        images, _ = m.transform(list(x))
        features = m.backbone(images.tensors)
        proposals, _ = m.rpn(images, features)
        detections, _ = heads(features, proposals, images.image_sizes)
        boxes = [d["boxes"][:1] for d in detections]
        if heads.has_mask():
            pooled = heads.mask_roi_pool(features, boxes, images.image_sizes)
            return heads.mask_predictor(heads.mask_head(pooled))[:, 1].flatten(1)
        pooled = heads.keypoint_roi_pool(features, boxes, images.image_sizes)
        return heads.keypoint_predictor(heads.keypoint_head(pooled)).flatten(1)


class TopDetection(nn.Module):
    """The top detection's ``key`` (its score, or its box's coordinates) of each image, through the model's own
    post-processing."""

    def __init__(self, model: nn.Module, key: str) -> None:
        super().__init__()
        self.model, self.key = model, key

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([d[self.key][0].reshape(-1) for d in self.model(list(x))])


# --- The models ----------------------------------------------------------------------------------------------------


def narrow_backbone(norm_layer: Callable[[int], nn.Module]) -> BackboneWithFPN:
    """ResNet-18's stem and first two stages under a 32-channel FPN (two levels and a max-pooled one)."""
    body = torchvision.models.resnet18(weights=None, norm_layer=norm_layer)
    return BackboneWithFPN(body, {"layer1": "0", "layer2": "1"}, [64, 128], 32)


def anchors() -> nn.Module:
    from torchvision.models.detection.anchor_utils import AnchorGenerator

    return AnchorGenerator(((16,), (32,), (64,)), ((0.5, 1.0, 2.0),) * 3)


def narrow_faster_rcnn(size: int) -> nn.Module:
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
    from torchvision.ops import MultiScaleRoIAlign

    return detection.FasterRCNN(
        narrow_backbone(nn.BatchNorm2d),
        min_size=size,
        max_size=size,
        rpn_anchor_generator=anchors(),
        rpn_pre_nms_top_n_test=20,
        rpn_post_nms_top_n_test=10,
        box_roi_pool=MultiScaleRoIAlign(["0", "1"], 7, 2),
        box_head=TwoMLPHead(32 * 7 * 7, 64),
        box_predictor=FastRCNNPredictor(64, 3),
    )


def narrow_retinanet(size: int) -> nn.Module:
    return detection.RetinaNet(
        narrow_backbone(nn.BatchNorm2d), 3, min_size=size, max_size=size, anchor_generator=anchors()
    )


def zoo(name: str, size: int, **kwargs) -> nn.Module:
    """A torchvision detection model, untrained, taking ``size``-pixel images as they are."""
    classes = 2 if name.startswith("keypoint") else 3
    model = getattr(detection, name)(weights=None, weights_backbone=None, num_classes=classes, **kwargs)
    model.transform.min_size, model.transform.max_size = (size,), size
    if model.transform.fixed_size is not None:  # SSD's: it resizes every image to it
        model.transform.fixed_size = (size, size)
    return model


@dataclass(frozen=True)
class Case:
    """A detector, what is explained of it (``wrap``), its input size and its backbone's kind."""

    name: str
    build: Callable[[int], nn.Module] = field(repr=False, compare=False)
    wrap: Callable[[nn.Module], nn.Module] = field(repr=False, compare=False)
    size: int
    kind: str
    piecewise_linear: bool
    explained: str = "logit"  # "logit": conservation is checked; "output": a probability or a box, LRP-0 only
    image_size: int | None = None  # the images' size, where the transform resizes them to ``size``

    @property
    def pixels(self) -> int:
        return self.image_size or self.size

    def __str__(self) -> str:
        return re.sub(r"[ ()/,]+", "-", self.name).strip("-")


SMALL = [
    Case(
        "Faster R-CNN ResNet-18 (2 stages) FPN-32 (proposal logits)",
        narrow_faster_rcnn,
        ProposalLogits,
        32,
        RECTIFIED,
        True,
    ),
    Case("RetinaNet ResNet-18 (2 stages) FPN-32 (head logits)", narrow_retinanet, HeadLogits, 32, RECTIFIED, True),
    # 24-pixel images resized to 32 by the transform's bilinear interpolation (32 needs no padding to a multiple of 32).
    Case(
        "Faster R-CNN ResNet-18 (2 stages) FPN-32 (proposal logits, 24-pixel images resized)",
        narrow_faster_rcnn,
        ProposalLogits,
        32,
        RECTIFIED,
        True,
        image_size=24,
    ),
]

R_CNN = partial(zoo, box_score_thresh=0.0)
ALL = [
    *SMALL,
    Case(
        "fasterrcnn_resnet50_fpn (proposal logits)",
        partial(R_CNN, "fasterrcnn_resnet50_fpn"),
        ProposalLogits,
        64,
        RECTIFIED,
        True,
    ),
    Case(
        "fasterrcnn_resnet50_fpn (top score)",
        partial(R_CNN, "fasterrcnn_resnet50_fpn"),
        partial(TopDetection, key="scores"),
        64,
        RECTIFIED,
        True,
        "output",
    ),
    # Box decoding takes exp of the predicted size, and clips coordinates at the image's border with the pass rule of
    # clips: a coordinate clipped there passes relevance on where its gradient is zero. Not piecewise linear.
    Case(
        "fasterrcnn_resnet50_fpn (top box)",
        partial(R_CNN, "fasterrcnn_resnet50_fpn"),
        partial(TopDetection, key="boxes"),
        64,
        RECTIFIED,
        False,
        "output",
    ),
    Case(
        "fasterrcnn_mobilenet_v3_large_320_fpn (proposal logits)",
        partial(R_CNN, "fasterrcnn_mobilenet_v3_large_320_fpn"),
        ProposalLogits,
        64,
        DEPTHWISE,
        False,
    ),
    Case(
        "retinanet_resnet50_fpn (head logits)", partial(zoo, "retinanet_resnet50_fpn"), HeadLogits, 64, RECTIFIED, True
    ),
    Case(
        "retinanet_resnet50_fpn (top score)",
        partial(zoo, "retinanet_resnet50_fpn", score_thresh=0.0),
        partial(TopDetection, key="scores"),
        64,
        RECTIFIED,
        True,
        "output",
    ),
    # GroupNorm in the head: not piecewise linear.
    Case("fcos_resnet50_fpn (head logits)", partial(zoo, "fcos_resnet50_fpn"), HeadLogits, 64, RECTIFIED, False),
    Case(
        "ssdlite320_mobilenet_v3_large (head logits)",
        partial(zoo, "ssdlite320_mobilenet_v3_large"),
        HeadLogits,
        128,
        DEPTHWISE,
        False,
    ),
    Case("ssd300_vgg16 (head logits)", partial(zoo, "ssd300_vgg16"), HeadLogits, 300, RECTIFIED, False),
    Case(
        "maskrcnn_resnet50_fpn (mask logits)",
        partial(R_CNN, "maskrcnn_resnet50_fpn"),
        InstanceLogits,
        64,
        RECTIFIED,
        True,
    ),
]


# --- Building, freezing, zeroing -----------------------------------------------------------------------------------


def build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    return calibrate(case.wrap(case.build(case.size)).to(F64), case.pixels, sample=torch.rand)


def frozen(model: nn.Module) -> nn.Module:
    """A copy of ``model`` as a pretrained backbone holds it: every BatchNorm2d a ``FrozenBatchNorm2d`` with its
    statistics, and the stem and first stage of the backbone frozen (``requires_grad=False``)."""
    model = copy.deepcopy(model)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, nn.BatchNorm2d):
                norm = FrozenBatchNorm2d(child.num_features, eps=child.eps).to(F64)
                for buffer in ("weight", "bias", "running_mean", "running_var"):
                    getattr(norm, buffer).copy_(getattr(child, buffer).detach())
                setattr(module, name, norm)
    for name, parameter in model.model.backbone.body.named_parameters():
        if not name.startswith(("layer2", "layer3", "layer4")):
            parameter.requires_grad_(False)
    return model


def zero_biases(model: nn.Module) -> nn.Module:
    """Biases, BatchNorm means (and a frozen one's shift) and the transform's image mean: relevance is then
    conserved."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.zero_()
        for module in model.modules():
            if isinstance(module, (nn.modules.batchnorm._BatchNorm, FrozenBatchNorm2d)):
                module.running_mean.zero_()
            if isinstance(module, FrozenBatchNorm2d):
                module.bias.zero_()
            if type(module).__name__ == "GeneralizedRCNNTransform":
                module.image_mean = [0.0] * len(module.image_mean)
    return model


# --- Relevance -----------------------------------------------------------------------------------------------------


def image(size: int) -> torch.Tensor:
    return torch.rand(BATCH, 3, size, size, generator=torch.Generator().manual_seed(2), dtype=F64)


def explain(model: nn.Module, x: torch.Tensor, mapper) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """Relevance of the largest output of each image, the output, and the warnings."""
    lrp = LRP(TensorDictModule(model, in_keys=["x"], out_keys=["y"]), rule_mapper=mapper)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        td = lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))
    return td["relevance", "x"], td["y"], [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def gradient_times_input(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(model(leaf).max(-1).values.sum(), leaf)
    return x * grad


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).norm() / expected.norm()).item()


@dataclass
class Report:
    lrp0_error: float
    ratios: dict[str, tuple[float, ...]]
    relevance: dict[str, torch.Tensor]
    warned: list[str]
    left_changed: list[str]


def measure(model: nn.Module, case: Case) -> Report:
    """LRP-0's error against gradient × input, then, with biases zeroed, each CNN preset's Σ relevance / score."""
    x = image(case.pixels)
    with torch.no_grad():
        plain = model(x)
    left_changed, warned = [], []
    before = fingerprint(model)
    relevance, output, messages = explain(model, x, BaseRuleMapper(stabilizer=1e-12))
    warned += messages
    if not torch.equal(output, plain):
        left_changed.append("LRP-0: output changed")
    expected = gradient_times_input(model, x)
    lrp0_error = relative_error(relevance, expected)
    if (changed := changes(before, fingerprint(model))) is not None:
        left_changed.append(f"LRP-0: {changed}")
    zero_biases(model)
    with torch.no_grad():
        plain = model(x)
    before = fingerprint(model)
    ratios, relevances = {}, {}
    for preset in CNN_PRESETS:
        relevance, output, messages = explain(model, x, PRESETS[preset]())
        warned += messages
        if not torch.equal(output, plain):
            left_changed.append(f"{preset}: output changed")
        relevances[preset] = relevance
        ratios[preset] = tuple((relevance.flatten(1).sum(1) / output.max(-1).values).tolist())
    if (changed := changes(before, fingerprint(model))) is not None:
        left_changed.append(f"presets: {changed}")
    return Report(lrp0_error, ratios, relevances, warned, left_changed)


@cache
def report(case: Case, freeze: bool = False) -> Report:
    model = build(case)
    return measure(frozen(model) if freeze else model, case)


# --- The tests -----------------------------------------------------------------------------------------------------


WARNING_NAMES_A_MODULE = re.compile(r"module 'module\.model(\.[\w.]+)?' \(\w+\)")


class Checks:
    def test_presets_run_and_leave_the_model_unchanged(self, case: Case):
        r = report(case)
        assert r.left_changed == []
        assert all(math.isfinite(v) for ratios in r.ratios.values() for v in ratios), r.ratios
        assert all(WARNING_NAMES_A_MODULE.search(message) for message in r.warned), r.warned

    def test_lrp0_is_gradient_times_input_where_piecewise_linear(self, case: Case):
        r = report(case)
        assert math.isfinite(r.lrp0_error)
        if case.piecewise_linear:
            assert r.lrp0_error <= LRP0_TOLERANCE


class ConservationChecks:
    def test_relevance_is_conserved_under_the_presets_a_user_would_pick(self, case: Case):
        ratios = report(case).ratios
        failed = {p: ratios[p] for p in CONSERVING[case.kind] if not conserves(ratios[p])}
        assert failed == {}


@pytest.mark.parametrize("case", SMALL, ids=str)
class TestSmall(Checks):
    """A narrow Faster R-CNN and RetinaNet on a ResNet-18 FPN."""

    def test_frozen_batch_norms_give_the_relevance_of_batch_norms(self, case: Case):
        """``FrozenBatchNorm2d`` (with the stem frozen, as a pretrained backbone has it) is merged into the
        convolution before it as BatchNorm2d is."""
        plain, held = report(case), report(case, freeze=True)
        assert held.left_changed == [] and held.lrp0_error <= LRP0_TOLERANCE
        for preset in CNN_PRESETS:
            assert relative_error(held.relevance[preset], plain.relevance[preset]) <= 1e-10, preset


def test_roi_align_is_linear_in_the_features():
    """``MultiScaleRoIAlign`` calls torchvision's ``roi_align`` through ``torch.ops``, with the backward torchvision
    registers: bilinear samples of the features at boxes that get no gradient, a linear map whose plain gradient is
    LRP-0. It was taken for a curved function: every preset warned, and a strict mapper refused the R-CNNs."""
    case = SMALL[0]
    model = build(case)
    x = image(case.pixels)
    relevance, _, messages = explain(model, x, BaseRuleMapper(stabilizer=1e-12, strict=True))
    assert messages == []
    assert relative_error(relevance, gradient_times_input(model, x)) <= LRP0_TOLERANCE
    assert report(case).warned == []


@pytest.mark.gallery
@pytest.mark.parametrize("case", ALL, ids=str)
class TestAll(Checks):
    """Every detection model: ``pytest -m gallery``."""


# A probability or a box coordinate has nothing to conserve: the explained logits only.
@pytest.mark.parametrize("case", [c for c in SMALL if c.explained == "logit"], ids=str)
class TestSmallConservation(ConservationChecks):
    """Conservation on the narrow models."""


@pytest.mark.gallery
@pytest.mark.parametrize("case", [c for c in ALL if c.explained == "logit"], ids=str)
class TestAllConservation(ConservationChecks):
    """Conservation on every detection model's logits: ``pytest -m gallery``."""
