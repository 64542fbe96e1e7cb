"""The rest of torchvision's classifiers and its video models against zennit, under every CNN preset.

Each model is built untrained (``weights=None``) in float64 and in eval mode, its BatchNorm statistics calibrated
on two random batches first (random weights make activations vanish with depth), at a small input: batch 1-2 at
32×32, 64×64 for AlexNet, 75×75 for Inception v3, four frames of 32×32 for the video models. Each BatchNorm's
``eps`` is folded into its running variance (``var + eps``, ``eps = 0``): the model computes the same function,
and zennit's merging canonizer, which leaves a merged BatchNorm computing ``x / sqrt(1 + eps)``, computes it too.

tdhook runs with no canonizer; zennit runs the matching composite with ``SequentialMergeBatchNorm`` (or its
``ResNetCanonizer`` on ResNeXt and Wide ResNet). Where zennit finds no module to give a rule to, its relevance
is not LRP's, and the oracle gets the rule's definition written with zennit's own pieces, in the canonizers of
this file:

* residual additions written in a ``forward`` (MobileNet v2 and v3, MnasNet, EfficientNet, RegNet, the video
  ResNets): zennit passes the sum's relevance whole to both terms (relevance is its gradient), doubling it at each
  block. They go through zennit's ``Sum`` under its ``Norm``, as its ResNet canonizer does for torchvision's
  ResNets, and tdhook runs with ``stabilize_additions=True``, which is that rule;
* squeeze-excite gates (``x * sigmoid(fc(pool(x)))`` in MobileNet v3 and EfficientNet): zennit has no rule for
  a product of two activations. Its ``Pass`` on the sigmoid and the plain gradient of the product give
  ``R_x = s · R`` and the gate's branch ``x · R`` on top (50-230 times the relevance on these models). tdhook's
  ``GateRule`` is signal-take-all (``R_x = R``, the gate held constant, its branch gets nothing): written in zennit
  as the product with a detached gate, under ``Pass``. SiLU and Hardswish get ``Pass`` in both;
* the average pools Inception v3 calls as functions (``F.avg_pool2d`` in its A, C and E blocks): zennit's plain
  gradient gives ``R_in = Σ R_out / 9`` with no input weighting, not an LRP rule; they become ``nn.AvgPool2d``
  modules under zennit's ``Norm`` with a vanishing stabilizer: LRP-0, the plain gradient tdhook gives a pooling
  function (an ``nn.AvgPool2d`` module gets ``Norm``'s stabilizer, 1e-6, in both; with it on the functional pools
  too, the two differ by 5e-6).

With these, every preset equals zennit's composite within 1e-8 relative L2 error (observed: 1e-16 to 1e-10).

``pytest tests/attribution/test_lrp_vision_zoo.py`` runs SqueezeNet and small MobileNet v3 and EfficientNet
built from three blocks each (gates, residual sums, Hardswish and SiLU), in about two seconds;
``pytest -m gallery`` adds the full-size models.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from torch.overrides import TorchFunctionMode

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import (
    EpsilonAlpha2Beta1,
    EpsilonAlpha2Beta1Flat,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    EpsilonRule,
)
from tests.conftest import relative_error, zennit_model_relevance

torchvision = pytest.importorskip("torchvision")
zennit = pytest.importorskip("zennit")

from torchvision import models as tvm  # noqa: E402
from torchvision.models import efficientnet, mobilenetv3  # noqa: E402
from zennit import composites as zcomposites  # noqa: E402
from zennit.canonizers import AttributeCanonizer, NamedMergeBatchNorm, SequentialMergeBatchNorm  # noqa: E402
from zennit.layer import Sum  # noqa: E402
from zennit.rules import Epsilon, Norm, Pass  # noqa: E402
from zennit.torchvision import ResNetCanonizer  # noqa: E402

F64 = torch.float64
TOLERANCE = 1e-8

PRESETS = {
    "EpsilonPlus": (EpsilonPlus, zcomposites.EpsilonPlus),
    "EpsilonPlusFlat": (EpsilonPlusFlat, zcomposites.EpsilonPlusFlat),
    "EpsilonAlpha2Beta1": (EpsilonAlpha2Beta1, zcomposites.EpsilonAlpha2Beta1),
    "EpsilonAlpha2Beta1Flat": (EpsilonAlpha2Beta1Flat, zcomposites.EpsilonAlpha2Beta1Flat),
    "EpsilonGammaBox": (
        lambda **kw: EpsilonGammaBox(-3.0, 3.0, **kw),
        lambda: zcomposites.EpsilonGammaBox(low=-3.0, high=3.0),
    ),
}


# --- The oracle's canonizers: the rules' definitions where zennit finds no module --------------------------------


class HeldGate(nn.Module):
    """``x · gate`` with the gate set just before the call and detached: zennit's ``Pass`` on it is
    signal-take-all."""

    gate: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gate


def _summed(module: nn.Module, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return module.canonizer_sum(torch.stack([a, b], dim=-1))


def _residual(body: Callable[[nn.Module, torch.Tensor], torch.Tensor], flag: str):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _summed(self, x, body(self, x)) if getattr(self, flag) else body(self, x)

    return forward


def _regnet_block(self, x: torch.Tensor) -> torch.Tensor:
    skip = x if self.proj is None else self.proj(x)
    return self.activation(_summed(self, skip, self.f(x)))


def _video_block(self, x: torch.Tensor) -> torch.Tensor:
    skip = x if self.downsample is None else self.downsample(x)
    return self.relu(_summed(self, self.conv2(self.conv1(x)), skip))


def _squeeze_excitation(self, x: torch.Tensor) -> torch.Tensor:
    self.canonizer_gate.gate = self._scale(x).detach()
    return self.canonizer_gate(x)


# The forward of each block whose residual sum or gate is written in its own forward, as zennit's Sum or HeldGate.
BLOCKS: dict[type, tuple[Callable, str, Callable[[], nn.Module]]] = {
    tvm.mobilenetv2.InvertedResidual: (_residual(lambda m, x: m.conv(x), "use_res_connect"), "canonizer_sum", Sum),
    mobilenetv3.InvertedResidual: (_residual(lambda m, x: m.block(x), "use_res_connect"), "canonizer_sum", Sum),
    efficientnet.MBConv: (
        _residual(lambda m, x: m.stochastic_depth(m.block(x)), "use_res_connect"),
        "canonizer_sum",
        Sum,
    ),
    tvm.mnasnet._InvertedResidual: (_residual(lambda m, x: m.layers(x), "apply_residual"), "canonizer_sum", Sum),
    tvm.regnet.ResBottleneckBlock: (_regnet_block, "canonizer_sum", Sum),
    tvm.video.resnet.BasicBlock: (_video_block, "canonizer_sum", Sum),
    torchvision.ops.SqueezeExcitation: (_squeeze_excitation, "canonizer_gate", HeldGate),
}


class BlockCanonizer(AttributeCanonizer):
    """Residual sums through zennit's ``Sum`` and squeeze-excite gates held constant, in the blocks of ``BLOCKS``."""

    def __init__(self) -> None:
        super().__init__(self._attributes)

    @staticmethod
    def _attributes(name: str, module: nn.Module) -> dict | None:
        if type(module) not in BLOCKS:
            return None
        forward, attribute, make = BLOCKS[type(module)]
        return {"forward": forward.__get__(module), attribute: make()}

    def copy(self) -> BlockCanonizer:
        return BlockCanonizer()


class PoolsAsModules(TorchFunctionMode):
    """Runs ``F.avg_pool2d`` calls through ``pool``, a module zennit gives its ``Norm`` rule."""

    def __init__(self, pool: nn.Module) -> None:
        super().__init__()
        self.pool = pool

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.avg_pool2d:
            return self.pool(args[0])
        return func(*args, **(kwargs or {}))


class CalledPool(nn.AvgPool2d):
    """An average pool the model calls as a function: tdhook gives it the plain gradient (LRP-0, no stabilizer)."""


def _pooled_forward(self, x: torch.Tensor):
    with PoolsAsModules(self.canonizer_pool):
        return type(self)._forward(self, x)


class InceptionPoolCanonizer(AttributeCanonizer):
    """The 3×3 average pools of Inception v3's A, C and E blocks as ``nn.AvgPool2d`` modules (the same function)."""

    BLOCKS = (tvm.inception.InceptionA, tvm.inception.InceptionC, tvm.inception.InceptionE)

    def __init__(self) -> None:
        super().__init__(self._attributes)

    @classmethod
    def _attributes(cls, name: str, module: nn.Module) -> dict | None:
        if type(module) not in cls.BLOCKS:
            return None
        return {"_forward": _pooled_forward.__get__(module), "canonizer_pool": CalledPool(3, 1, 1)}

    def copy(self) -> InceptionPoolCanonizer:
        return InceptionPoolCanonizer()


def densenet_merging() -> list:
    """zennit's ``NamedMergeBatchNorm`` on the BatchNorms that follow a convolution (the stem's, and the second
    of each dense layer). ``SequentialMergeBatchNorm`` merges each dense layer's first BatchNorm, which
    normalises the concatenation of all earlier features, into the convolution listed before it, fails on the
    shapes, and leaves that convolution with a one-element bias."""
    model = _pristine("densenet121")
    pairs = [(("features.conv0",), "features.norm0")]
    pairs += [((f"{name}.conv1",), f"{name}.norm2") for name, m in model.named_modules() if hasattr(m, "norm2")]
    return [NamedMergeBatchNorm(pairs)]


def unmerged_batch_norms(model_name: str) -> frozenset[str]:
    """The BatchNorms no zennit canonizer can merge: DenseNet's, after a concatenation or a pooling."""
    if model_name != "densenet121":
        return frozenset()
    merged = {name for _, name in densenet_merging()[0].name_map}
    model = _pristine(model_name)
    return frozenset(
        name for name, module in model.named_modules() if isinstance(module, nn.BatchNorm2d) and name not in merged
    )


def merging() -> list:
    return [SequentialMergeBatchNorm(), BlockCanonizer()]


def resnet_merging() -> list:
    return [ResNetCanonizer()]


def inception_merging() -> list:
    return [SequentialMergeBatchNorm(), InceptionPoolCanonizer()]


# --- The models ---------------------------------------------------------------------------------------------------


def tiny_mobilenet_v3() -> nn.Module:
    """Three blocks of MobileNet v3: squeeze-excite with Hardsigmoid gates, Hardswish, a residual sum."""
    config = functools.partial(mobilenetv3.InvertedResidualConfig, dilation=1, width_mult=1.0)
    setting = [
        config(16, 3, 16, 16, True, "RE", 2),
        config(16, 3, 48, 24, False, "HS", 2),
        config(24, 3, 64, 24, True, "HS", 1),
    ]
    return mobilenetv3.MobileNetV3(setting, last_channel=32, num_classes=10)


def tiny_efficientnet() -> nn.Module:
    """Three MBConv blocks of EfficientNet: SiLU, squeeze-excite with sigmoid gates, a residual sum."""
    setting = [
        efficientnet.MBConvConfig(1, 3, 1, 32, 16, 1),
        efficientnet.MBConvConfig(4, 3, 2, 16, 24, 2),
    ]
    return efficientnet.EfficientNet(setting, dropout=0.2, num_classes=10, last_channel=64)


def tv(name: str, **kwargs) -> Callable[[], nn.Module]:
    return functools.partial(getattr(tvm, name), weights=None, num_classes=10, **kwargs)


def video(name: str) -> Callable[[], nn.Module]:
    return functools.partial(getattr(tvm.video, name), weights=None, num_classes=10)


IMAGE, SMALL_IMAGE, CLIP = (2, 3, 32, 32), (1, 3, 32, 32), (1, 3, 4, 32, 32)
INCEPTION = {"aux_logits": False, "transform_input": False, "init_weights": True}

# name: (build, input shape, zennit's canonizers)
MODELS: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...], Callable[[], list]]] = {
    "squeezenet1_1": (tv("squeezenet1_1"), IMAGE, merging),
    "mobilenet_v3 (3 blocks)": (tiny_mobilenet_v3, IMAGE, merging),
    "efficientnet (3 blocks)": (tiny_efficientnet, IMAGE, merging),
    "alexnet": (tv("alexnet"), (2, 3, 64, 64), merging),
    "googlenet": (tv("googlenet", **INCEPTION), IMAGE, merging),
    "inception_v3": (tv("inception_v3", **INCEPTION), (1, 3, 75, 75), inception_merging),
    "mobilenet_v2": (tv("mobilenet_v2"), IMAGE, merging),
    "mobilenet_v3_small": (tv("mobilenet_v3_small"), IMAGE, merging),
    "densenet121": (tv("densenet121"), IMAGE, densenet_merging),
    "shufflenet_v2_x0_5": (tv("shufflenet_v2_x0_5"), IMAGE, merging),
    "mnasnet0_5": (tv("mnasnet0_5"), IMAGE, merging),
    "regnet_x_400mf": (tv("regnet_x_400mf"), IMAGE, merging),
    "efficientnet_b0": (tv("efficientnet_b0"), IMAGE, merging),
    "resnext50_32x4d": (tv("resnext50_32x4d"), SMALL_IMAGE, resnet_merging),
    "wide_resnet50_2": (tv("wide_resnet50_2"), SMALL_IMAGE, resnet_merging),
    "r3d_18": (video("r3d_18"), CLIP, merging),
    "mc3_18": (video("mc3_18"), CLIP, merging),
    "r2plus1d_18": (video("r2plus1d_18"), CLIP, merging),
}


def calibrate(model: nn.Module, shape: tuple[int, ...], batches: int = 2) -> nn.Module:
    """BatchNorm statistics of a few random batches (only the BatchNorms in training mode), ``eps`` folded into
    the running variance."""
    model.eval()
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for norm in norms:
        norm.reset_running_stats()
        norm.momentum = None
        norm.train()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(batches if norms else 0):
            model(torch.randn(4, *shape[1:], generator=generator, dtype=F64))
        for norm in norms:
            norm.running_var.add_(norm.eps)
            norm.eps = 0.0
    return model.eval()


@functools.lru_cache(maxsize=1)  # the tests run model by model: one model held at a time (wide_resnet50_2: 0.5 GiB)
def _pristine(name: str) -> nn.Module:
    build, shape, _ = MODELS[name]
    torch.manual_seed(0)
    return calibrate(build().to(F64), shape)


@pytest.fixture(autouse=True, scope="module")
def _free_models_after_this_file():
    yield
    _pristine.cache_clear()


def model_and_input(name: str) -> tuple[nn.Module, torch.Tensor]:
    shape = MODELS[name][1]
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    return copy.deepcopy(_pristine(name)), x


def tdhook_model_relevance(model: nn.Module, rule_mapper, x: torch.Tensor) -> torch.Tensor:
    lrp = LRP(model, rule_mapper=rule_mapper, in_keys=["x"], out_keys=["logits"])
    return lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]


def zennit_composite(preset: str, unmerged: frozenset[str] = frozenset()):
    """zennit's composite, with ``Pass`` on the held gates of ``BlockCanonizer`` and the ε-rule of their affine
    map on the BatchNorms named in ``unmerged``."""
    composite = PRESETS[preset][1]()
    composite.layer_map = [(HeldGate, Pass()), (CalledPool, Norm(stabilizer=1e-30)), *composite.layer_map]
    if unmerged:
        by_type = composite.module_map
        affine = Epsilon(epsilon=1e-6)

        def mapping(ctx, name, module):
            return affine if name in unmerged else by_type(ctx, name, module)

        composite.module_map = mapping
    return composite


# The default run: every preset on the small MobileNet v3 and EfficientNet (gates, residual sums, Hardswish and
# SiLU), SqueezeNet (concatenations) under the two with a first-layer rule of their own.
DEFAULT = {
    *((name, preset) for name in ("mobilenet_v3 (3 blocks)", "efficientnet (3 blocks)") for preset in PRESETS),
    ("squeezenet1_1", "EpsilonPlusFlat"),
    ("squeezenet1_1", "EpsilonGammaBox"),
}


def case(name: str, preset: str):
    marks = () if (name, preset) in DEFAULT else (pytest.mark.gallery,)
    return pytest.param(name, preset, id=f"{name.replace(' ', '-')}-{preset}", marks=marks)


# tdhook's EpsilonGammaBox on wide_resnet50_2 peaks at 9.1 GB at batch 1 (EpsilonPlus 4.8 GB, zennit's
# EpsilonGammaBox 2.7 GB; the model and its copy alone 1.7 GB): left out so that the gallery fits a 24 GiB machine.
TOO_BIG = {("wide_resnet50_2", "EpsilonGammaBox")}


@pytest.mark.parametrize(
    ("model_name", "preset"),
    [case(name, preset) for name in MODELS for preset in PRESETS if (name, preset) not in TOO_BIG],
)
def test_preset_matches_zennit(model_name: str, preset: str):
    model, x = model_and_input(model_name)
    unmerged = unmerged_batch_norms(model_name)
    # DenseNet: tdhook merges a BatchNorm after a concatenation into the layers it concatenates, channel by channel
    # (test_batch_norm_after_a_concatenation_merges_into_its_layers), which no zennit canonizer does; here both give
    # those BatchNorms the ε-rule of their affine map, and the rest of the model is compared.
    affine = EpsilonRule(1e-6)
    mapper = (lambda name, module: affine if name in unmerged else None) if unmerged else None
    relevance = tdhook_model_relevance(model, PRESETS[preset][0](stabilize_additions=True, rule_mapper=mapper), x)
    composite = zennit_composite(preset, unmerged)
    expected = zennit_model_relevance(composite, model, x, canonizers=MODELS[model_name][2]())
    assert relative_error(relevance, expected) <= TOLERANCE


@pytest.mark.parametrize("model_name", ["mobilenet_v3 (3 blocks)", "efficientnet (3 blocks)"])
def test_stock_zennit_differs_at_gates_and_sums(model_name: str):
    """The test can tell: zennit with only its BatchNorm canonizer (relevance of a residual sum passed whole to
    both terms, a gate's product split by its gradient) is far from tdhook, and from the definitions above."""
    model, x = model_and_input(model_name)
    relevance = tdhook_model_relevance(model, EpsilonPlus(stabilize_additions=True), x)
    stock = zennit_model_relevance(zcomposites.EpsilonPlus(), model, x, canonizers=[SequentialMergeBatchNorm()])
    assert relative_error(relevance, stock) > 0.1


# --- A BatchNorm after a concatenation: merged into the concatenated layers -----------------------------------------


class DenseBlock(nn.Module):
    """Two dense layers as in DenseNet: each BatchNorm normalises the concatenation of a pooled stem and the
    earlier layers' outputs, and ``conv1``'s output reaches two BatchNorms."""

    def __init__(self) -> None:
        super().__init__()
        self.conv0, self.pool = nn.Conv2d(3, 4, 3, padding=1), nn.MaxPool2d(2)
        self.bn1, self.conv1 = nn.BatchNorm2d(4), nn.Conv2d(4, 3, 3, padding=1)
        self.bn2, self.conv2 = nn.BatchNorm2d(7), nn.Conv2d(7, 3, 3, padding=1)
        self.bn3 = nn.BatchNorm2d(10)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(10, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.pool(torch.relu(self.conv0(x)))
        c1 = self.conv1(torch.relu(self.bn1(p)))
        c2 = self.conv2(torch.relu(self.bn2(torch.cat([p, c1], 1))))
        return self.head(torch.relu(self.bn3(torch.cat([p, c1, c2], 1))))


def _channels(norm: nn.BatchNorm2d, channels: slice) -> nn.BatchNorm2d:
    part = nn.BatchNorm2d(channels.stop - channels.start, eps=norm.eps).to(F64).eval()
    part.load_state_dict({k: v[channels] if v.dim() else v for k, v in norm.state_dict().items()})
    return part


def _merged(conv: nn.Conv2d, norm: nn.BatchNorm2d, channels: slice) -> nn.Conv2d:
    scale = norm.weight[channels] / (norm.running_var[channels] + norm.eps).sqrt()
    layer = copy.deepcopy(conv)
    with torch.no_grad():
        layer.weight.mul_(scale.view(-1, 1, 1, 1))
        layer.bias.copy_((conv.bias - norm.running_mean[channels]) * scale + norm.bias[channels])
    return layer


class MergedDenseBlock(nn.Module):
    """``DenseBlock`` with each BatchNorm after a concatenation merged into the layers it concatenates: one merged
    copy of a layer per BatchNorm its output reaches, the pooled stem's channels as BatchNorms of their own. The
    same function."""

    def __init__(self, block: DenseBlock) -> None:
        super().__init__()
        stem, first, second = slice(0, 4), slice(4, 7), slice(7, 10)
        self.conv0, self.pool, self.bn1, self.conv1, self.head = (
            block.conv0,
            block.pool,
            block.bn1,
            block.conv1,
            block.head,
        )
        self.bn2_stem, self.conv1_bn2 = _channels(block.bn2, stem), _merged(block.conv1, block.bn2, first)
        self.conv2 = block.conv2
        self.bn3_stem, self.conv1_bn3 = _channels(block.bn3, stem), _merged(block.conv1, block.bn3, first)
        self.conv2_bn3 = _merged(block.conv2, block.bn3, second)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.pool(torch.relu(self.conv0(x)))
        a = torch.relu(self.bn1(p))
        h = torch.relu(torch.cat([self.bn2_stem(p), self.conv1_bn2(a)], 1))
        return self.head(torch.relu(torch.cat([self.bn3_stem(p), self.conv1_bn3(a), self.conv2_bn3(h)], 1)))


@pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonAlpha2Beta1"])
def test_batch_norm_after_a_concatenation_merges_into_its_layers(preset: str):
    """A BatchNorm after a concatenation of layers' outputs is merged into each of them, channel by channel, and
    into each layer once per BatchNorm its output reaches; the channels of other parts get the ε-rule of their
    affine map. zennit on the model with those merges written out, ``Epsilon`` on its BatchNorms, is the oracle."""
    torch.manual_seed(0)
    block = DenseBlock().to(F64).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for norm in (block.bn1, block.bn2, block.bn3):
            n = norm.num_features
            norm.eps = 0.0
            norm.running_mean.copy_(torch.randn(n, generator=generator, dtype=F64) * 0.3)
            norm.running_var.copy_(torch.rand(n, generator=generator, dtype=F64) + 0.5)
            norm.weight.copy_(torch.rand(n, generator=generator, dtype=F64) + 0.5)
            norm.bias.copy_(torch.randn(n, generator=generator, dtype=F64) * 0.3)
    merged = MergedDenseBlock(block).eval()
    x = torch.randn(2, 3, 8, 8, generator=generator, dtype=F64)
    torch.testing.assert_close(merged(x), block(x), rtol=1e-12, atol=1e-12)

    def composite():
        composite = PRESETS[preset][1]()
        composite.layer_map = [(nn.BatchNorm2d, Epsilon(epsilon=1e-6)), *composite.layer_map]
        return composite

    relevance = tdhook_model_relevance(block, PRESETS[preset][0](), x)
    assert relative_error(relevance, zennit_model_relevance(composite(), merged, x, canonizers=[])) <= TOLERANCE
    # Each BatchNorm under the ε-rule of its affine map instead: measurably different, the test can tell.
    assert relative_error(relevance, zennit_model_relevance(composite(), block, x, canonizers=[])) > 1e-2
