"""UniformEpsilon against zennit's LayerMapComposite of Epsilon on Linear and convolutions with its base layer map,
BatchNorm merged by zennit's canonizers, on torchvision's vgg11_bn and resnet18 in float64."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torchvision
from tensordict import TensorDict
from torch import nn
from zennit import types as ztypes
from zennit.composites import LayerMapComposite, layer_map_base
from zennit.rules import Epsilon
from zennit.torchvision import ResNetCanonizer, VGGCanonizer

from tdhook.attribution import LRP, EpsilonRule, PassRule, RecurrentRule, UniformEpsilon
from tests.conftest import relative_error, zennit_model_relevance

MODELS = {
    "vgg11_bn": (torchvision.models.vgg11_bn, VGGCanonizer),
    "resnet18": (torchvision.models.resnet18, ResNetCanonizer),
}


@pytest.fixture(autouse=True, scope="module")
def _free_models_after_this_file():
    yield
    _calibrated.cache_clear()
    _zennit_relevance.cache_clear()


def calibrated(name: str) -> nn.Module:
    """A fresh copy of the calibrated model (built once per file: vgg11_bn's is a GiB in float64)."""
    return copy.deepcopy(_calibrated(name))


@functools.cache
def _calibrated(name: str) -> nn.Module:
    """The model with BatchNorm statistics from a few random batches in train mode.

    Each BatchNorm's ``eps`` is then set to zero: zennit's canonizer leaves a merged BatchNorm computing
    ``x / sqrt(1 + eps)``, which would change the function it explains by about ``eps / 2`` per BatchNorm.
    """
    torch.manual_seed(0)
    model = MODELS[name][0](weights=None, num_classes=10).double().train()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 3, 64, 64, generator=generator, dtype=torch.float64))
    for module in model.modules():
        if isinstance(module, nn.BatchNorm2d):
            module.eps = 0.0
    return model.eval()


def zennit_uniform_epsilon(epsilon: float, stabilizer: float = 1e-6) -> LayerMapComposite:
    return LayerMapComposite([((ztypes.Convolution, ztypes.Linear), Epsilon(epsilon)), *layer_map_base(stabilizer)])


@pytest.mark.parametrize("epsilon", [0.25, 0.01])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_equals_zennit_with_batch_norm_merged(name: str, epsilon: float):
    model = calibrated(name)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    lrp = LRP(model, rule_mapper=UniformEpsilon(epsilon, stabilize_additions=True), in_keys=["image"], out_keys=["y"])
    relevance = lrp(TensorDict(image=x.clone(), batch_size=[2]))["relevance", "image"]
    expected = _zennit_relevance(name, epsilon)
    assert relative_error(relevance, expected) <= 1e-10
    # ε makes a measurable difference: the test can tell.
    other = _zennit_relevance(name, 0.01 if epsilon == 0.25 else 0.25)
    assert relative_error(other, expected) > 1e-3


@functools.cache
def _zennit_relevance(name: str, epsilon: float) -> torch.Tensor:
    """zennit's relevance on the calibrated model and the test's input, computed once per file and ε."""
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    model = calibrated(name)
    return zennit_model_relevance(zennit_uniform_epsilon(epsilon), model, x, canonizers=[MODELS[name][1]()])


def test_defaults_and_rules():
    preset = UniformEpsilon()
    assert (preset.epsilon, preset.stabilizer) == (0.25, 1e-6)
    for layer in (nn.Linear(2, 2), nn.Conv1d(1, 1, 1), nn.Conv2d(1, 1, 1), nn.ConvTranspose2d(1, 1, 1)):
        rule = preset("layer", layer)
        assert type(rule) is EpsilonRule and rule.epsilon == 0.25
    assert type(preset("act", nn.ReLU())) is PassRule
    assert type(preset("lstm", nn.LSTM(2, 3))) is RecurrentRule


def test_arguments_are_checked():
    with pytest.raises(ValueError, match="epsilon"):
        UniformEpsilon(epsilon=-0.1)
    with pytest.raises(ValueError, match="stabilizer"):
        UniformEpsilon(stabilizer=-1.0)
