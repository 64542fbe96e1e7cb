"""Whole torchvision models against zennit: presets, automatic BatchNorm merging, restoration.

zennit needs its canonizers to merge BatchNorm into the convolutions and to
give the residual additions a rule; tdhook gets the same relevance with no
canonizer, and leaves the model exactly as it found it. zennit's residual
additions sit under a stabilised ``Norm``; ``stabilize_additions=True`` asks
tdhook for the same, otherwise it splits the sums exactly.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
import torchvision
from tensordict import TensorDict
from torch import nn
from zennit import composites as zcomposites
from zennit.canonizers import CompositeCanonizer, SequentialMergeBatchNorm
from zennit.layer import Sum
from zennit.rules import Norm
from zennit.torchvision import ResNetBasicBlockCanonizer, ResNetBottleneckCanonizer, ResNetCanonizer, VGGCanonizer

from tdhook.attribution import LRP
from tdhook.attribution.lrp_helpers.rules import (
    BaseRuleMapper,
    EpsilonAlpha2Beta1,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    EpsilonRule,
    raise_for_unconserved_rel_factory,
)
from tdhook.attribution.rules import _input_gradients as input_gradients
from tests.conftest import relative_error, zennit_model_relevance


@pytest.fixture(autouse=True)
def few_channel_products_at_test_sizes(monkeypatch):
    """The first layers' products take their few-channel paths (stride phases, shifted sums) at these small
    image sizes too, so that the comparisons with zennit cover them."""
    monkeypatch.setattr(input_gradients, "_MIN_FEW_CHANNEL_GRADIENT", 1)


MODELS = {
    "vgg11": (torchvision.models.vgg11, VGGCanonizer),
    "vgg11_bn": (torchvision.models.vgg11_bn, VGGCanonizer),
    "resnet18": (torchvision.models.resnet18, ResNetCanonizer),
    "resnet50": (torchvision.models.resnet50, ResNetCanonizer),
}

PRESETS = {
    "EpsilonPlusFlat": (lambda **kw: EpsilonPlusFlat(**kw), lambda: zcomposites.EpsilonPlusFlat()),
    "EpsilonGammaBox": (
        lambda **kw: EpsilonGammaBox(-3.0, 3.0, **kw),
        lambda: zcomposites.EpsilonGammaBox(low=-3.0, high=3.0),
    ),
    "EpsilonAlpha2Beta1": (lambda **kw: EpsilonAlpha2Beta1(**kw), lambda: zcomposites.EpsilonAlpha2Beta1()),
}


def unstabilised_sum(composite):
    """``composite`` with the residual additions of zennit's ResNet canonizer under an unstabilised Norm."""
    composite.layer_map = [(Sum, Norm(stabilizer=1e-30)), *composite.layer_map]
    return composite


def randomise_batch_norms(model: nn.Module, generator: torch.Generator, eps: float = 0.0) -> None:
    """Give every BatchNorm statistics and affine parameters far from the identity.

    ``eps`` defaults to zero because zennit's canonizer leaves each merged
    BatchNorm computing ``x / sqrt(1 + eps)`` rather than the identity, which
    shifts its forward pass by about ``eps / 2`` per BatchNorm; tdhook keeps the
    model's exact function. With ``eps = 0`` both compute the same function.
    """
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                module.eps = eps
                n = module.num_features
                module.running_mean.copy_(torch.randn(n, generator=generator) * 0.2)
                module.running_var.copy_(torch.rand(n, generator=generator) * 1.5 + 0.5)
                module.weight.copy_(torch.rand(n, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(n, generator=generator) * 0.1)


@functools.cache
def _pristine(name: str, eps: float) -> nn.Module:
    torch.manual_seed(0)
    model = MODELS[name][0](weights=None, num_classes=10).double().eval()
    randomise_batch_norms(model, torch.Generator().manual_seed(1), eps)
    return model


@pytest.fixture(autouse=True, scope="module")
def _free_models_after_this_file():
    yield
    _pristine.cache_clear()


def build(name: str, eps: float = 0.0) -> nn.Module:
    """A fresh copy of the model: each is built and randomised once per session (vgg11's is a GiB in float64)."""
    return copy.deepcopy(_pristine(name, eps))


def snapshot(model: nn.Module) -> tuple[dict[str, torch.Tensor], str, list]:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()]
    return state, repr(model), hooks


def assert_unchanged(model: nn.Module, before: tuple[dict[str, torch.Tensor], str, list]) -> None:
    state, structure, hooks = before
    after = model.state_dict()
    assert list(after) == list(state)
    for key, value in state.items():
        assert torch.equal(after[key], value), key
        assert after[key].dtype == value.dtype, key
    assert repr(model) == structure
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks)) for m in model.modules()] == (
        hooks
    )


def image(batch: int = 2, size: int = 32) -> torch.Tensor:
    return torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def tdhook_model_relevance(model: nn.Module, rule_mapper, x: torch.Tensor, **kwargs) -> TensorDict:
    lrp = LRP(model, rule_mapper=rule_mapper, in_keys=["image"], out_keys=["logits"], **kwargs)
    return lrp(TensorDict(image=x.clone(), batch_size=[x.shape[0]]))


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("model_name", sorted(MODELS))
def test_preset_matches_zennit_with_canonizers(model_name: str, preset: str):
    model = build(model_name)
    ours, theirs = PRESETS[preset]
    x = image()
    before = snapshot(model)

    relevance = tdhook_model_relevance(model, ours(stabilize_additions=True), x)["relevance", "image"]
    assert_unchanged(model, before)

    expected = zennit_model_relevance(theirs(), model, x, canonizers=[MODELS[model_name][1]()])
    assert relative_error(relevance, expected) <= 1e-10
    # Without merging, the result is measurably different: the test can tell.
    if model_name != "vgg11":
        unmerged = zennit_model_relevance(theirs(), model, x, canonizers=[])
        assert relative_error(unmerged, expected) > 1e-3


class _MergeToExactIdentity(SequentialMergeBatchNorm):
    """zennit's merge, the merged BatchNorm left computing the identity exactly: zennit 0.5.1 resets its variance to
    1 and keeps its ``eps``, so that it divides by ``sqrt(1 + eps)``, and the model zennit explains is another."""

    @staticmethod
    def merge_batch_norm(modules, batch_norm):
        SequentialMergeBatchNorm.merge_batch_norm(modules, batch_norm)
        batch_norm.running_var.data = torch.full_like(batch_norm.running_var, 1.0 - batch_norm.eps)


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_preset_matches_zennit_with_batch_norms_of_torchs_default_eps(preset: str):
    """With torch's ``eps = 1e-5``, tdhook explains the model itself: zennit's canonizers, their merged BatchNorms
    made the identity, give the same relevance; stock, they explain the model with its activations scaled by
    ``1 / sqrt(1 + eps)`` after every merged BatchNorm, which the later biases do not follow."""
    model = build("resnet18", eps=1e-5)
    ours, theirs = PRESETS[preset]
    x = image()
    relevance = tdhook_model_relevance(model, ours(stabilize_additions=True), x)["relevance", "image"]
    exact = [CompositeCanonizer([_MergeToExactIdentity(), ResNetBottleneckCanonizer(), ResNetBasicBlockCanonizer()])]
    assert relative_error(relevance, zennit_model_relevance(theirs(), model, x, canonizers=exact)) <= 1e-10
    stock = zennit_model_relevance(theirs(), model, x, canonizers=[ResNetCanonizer()])
    assert relative_error(relevance, stock) > 1e-6  # the test can tell the two models apart


@pytest.mark.parametrize("model_name", ["resnet18", "vgg11_bn"])
def test_later_calls_in_one_context_match_zennit(model_name: str):
    # From the second call on, layers merged with a BatchNorm skip copying their outputs and the input layer
    # reuses its one-sample offset: other inputs, another batch size and another image size must not notice.
    model = build(model_name)
    ours, theirs = PRESETS["EpsilonGammaBox"]
    inputs = [image(), image(batch=3).mul(0.5), image(size=40)]
    expected = [zennit_model_relevance(theirs(), model, x, canonizers=[MODELS[model_name][1]()]) for x in inputs]
    with LRP(model, rule_mapper=ours(stabilize_additions=True), in_keys=["image"], out_keys=["logits"]) as lrp:
        for x, want in zip(inputs * 2, expected * 2, strict=True):
            relevance = lrp(TensorDict(image=x.clone(), batch_size=[x.shape[0]]))["relevance", "image"]
            assert relative_error(relevance, want) <= 1e-10


@pytest.mark.parametrize("preset", ["EpsilonPlusFlat", "EpsilonAlpha2Beta1"])
def test_residual_sums_split_exactly_by_default(preset: str):
    """By default a residual sum passes its relevance on exactly: zennit's Sum under an unstabilised Norm."""
    model = build("resnet18")
    ours, theirs = PRESETS[preset]
    x = image()
    relevance = tdhook_model_relevance(model, ours(), x)["relevance", "image"]
    exact = zennit_model_relevance(unstabilised_sum(theirs()), model, x, canonizers=[ResNetCanonizer()])
    assert relative_error(relevance, exact) <= 1e-10
    # The stabiliser of zennit's stock composite makes a measurable difference: the test can tell.
    stock = zennit_model_relevance(theirs(), model, x, canonizers=[ResNetCanonizer()])
    assert relative_error(relevance, stock) > 1e-6


class BatchAffine(nn.Module):
    """``x · s + t`` per channel with ``s``, ``t`` fixed: a training-mode BatchNorm of one batch."""

    def __init__(self, scale: torch.Tensor, shift: torch.Tensor) -> None:
        super().__init__()
        self.scale, self.shift = scale.view(1, -1, 1, 1), shift.view(1, -1, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale + self.shift


def with_batch_statistics_fixed(model: nn.Module, x: torch.Tensor) -> nn.Module:
    """A copy of ``model`` whose training-mode BatchNorms are affine maps with this batch's statistics."""
    fixed, hooks = copy.deepcopy(model), []
    for name, norm in list(fixed.named_modules()):
        if isinstance(norm, nn.BatchNorm2d):

            def replace(module, args, name=name):
                var, mean = torch.var_mean(args[0].detach(), dim=(0, 2, 3), unbiased=False)
                scale = module.weight.detach() * torch.rsqrt(var + module.eps)
                parent, _, child = name.rpartition(".")
                setattr(
                    fixed.get_submodule(parent) if parent else fixed,
                    child,
                    BatchAffine(scale, module.bias - mean * scale),
                )

            hooks.append(norm.register_forward_pre_hook(replace))
    with torch.no_grad():
        fixed(x)
    for hook in hooks:
        hook.remove()
    return fixed


def test_batch_norm_in_training_mode_is_not_merged():
    model = build("resnet18", eps=1e-5).train()
    x = image()
    # Before the call: the running statistics change in it, the batch statistics do not.
    fixed = with_batch_statistics_fixed(model, x).eval()
    before = snapshot(model)
    relevance = tdhook_model_relevance(model, EpsilonPlusFlat(), x)["relevance", "image"]
    # Training mode updates running statistics in the forward pass, as the model itself would.
    state, _, _ = before
    assert not torch.equal(model.state_dict()["bn1.running_mean"], state["bn1.running_mean"])
    # Not merged: each BatchNorm is the affine map of its batch statistics under the ε-rule, as an explicit
    # affine module with those statistics is.
    explicit = tdhook_model_relevance(fixed, EpsilonPlusFlat(rule_mapper={BatchAffine: EpsilonRule(1e-6)}), x)
    assert relative_error(relevance, explicit["relevance", "image"]) <= 1e-10
    merged = tdhook_model_relevance(model.eval(), EpsilonPlusFlat(), x)["relevance", "image"]
    assert relative_error(relevance, merged) > 1e-3


def zero_biases(model: nn.Module) -> nn.Module:
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                # A merged bias (b - μ) s + β is zero when μ and β are.
                module.running_mean.zero_()
                module.bias.zero_()
            elif getattr(module, "bias", None) is not None:
                module.bias.zero_()
    return model


class ResidualCNN(nn.Module):
    """BatchNorm, residual blocks, pooling and in-place ReLU, as in a small ResNet."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.pool = nn.MaxPool2d(2)
        self.block = torchvision.models.resnet.BasicBlock(8, 8)
        downsample = nn.Sequential(nn.Conv2d(8, 16, 1, stride=2), nn.BatchNorm2d(16))
        self.down = torchvision.models.resnet.BasicBlock(8, 16, stride=2, downsample=downsample)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 5))

    def forward(self, x):
        return self.head(self.down(self.block(self.pool(self.stem(x)))))


@pytest.mark.parametrize(
    "rule_mapper",
    [
        BaseRuleMapper(stabilizer=1e-12),
        EpsilonPlusFlat(epsilon=0.0, stabilizer=1e-12),
        EpsilonGammaBox(-3.0, 3.0, epsilon=0.0, stabilizer=1e-12),
    ],
    ids=["lrp0", "EpsilonPlusFlat", "EpsilonGammaBox"],
)
def test_conservation_with_zero_biases(rule_mapper):
    torch.manual_seed(0)
    model = ResidualCNN().double().eval()
    randomise_batch_norms(model, torch.Generator().manual_seed(3))
    zero_biases(model)
    x = image(batch=3, size=16)
    check = raise_for_unconserved_rel_factory(atol=1e-9, rtol=1e-6)
    td = tdhook_model_relevance(model, rule_mapper, x, relevance_check=check)
    relevance, logits = td["relevance", "image"], td["logits"]
    explained = logits.gather(1, logits.argmax(1, keepdim=True)).squeeze(1)
    torch.testing.assert_close(relevance.flatten(1).sum(1), explained, rtol=1e-6, atol=1e-9)


def test_lrp0_with_merged_batch_norm_is_gradient_times_input():
    model = build("resnet18")
    x = image()
    # LRP-0 everywhere: no stabilizer on the average pooling either.
    relevance = tdhook_model_relevance(model, BaseRuleMapper(stabilizer=0.0), x)["relevance", "image"]
    leaf = x.clone().requires_grad_(True)
    logits = model(leaf)
    (grad,) = torch.autograd.grad(logits.max(1).values.sum(), leaf)
    torch.testing.assert_close(relevance, (x * grad), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("mode", ["nearest", "bilinear", "bicubic"])
def test_an_upsampling_passes_each_input_its_share_of_what_it_interpolates(mode: str):
    """Relevance goes through an up-sampling by LRP-0: each input gets its contribution's share of every output it
    reaches, ``x * J^T (R_out / (J x))``. zennit maps no rule to ``nn.Upsample``, so the relevance itself flows back
    through its gradient, ``J^T R_out``, shared by the interpolation weights and not by contributions: where every
    output copies one input (nearest) the two agree; bilinear and bicubic up-sampling differ (0.1 to 0.6 relative
    on small CNNs under EpsilonPlus), and the test checks that zennit's is that gradient, not an error of ours."""
    torch.manual_seed(0)
    corners = {} if mode == "nearest" else {"align_corners": False}
    model = nn.Sequential(
        nn.Upsample(scale_factor=2, mode=mode, **corners),
        nn.Conv2d(4, 3, 3, padding=1, bias=False),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(3 * 8 * 8, 2, bias=False),
    ).double()
    x = torch.rand(2, 4, 4, 4, dtype=torch.float64) + 0.1
    lrp = LRP(model, EpsilonPlus(epsilon=1e-12), in_keys=["x"], out_keys=["y"], layers={"0": "upsampled"})
    td = lrp(TensorDict(x=x, batch_size=[2]))
    upsampled_relevance = td["relevance", "upsampled"]
    leaf = x.clone().requires_grad_(True)
    upsampled = model[0](leaf)
    (shares,) = torch.autograd.grad(upsampled, leaf, upsampled_relevance / upsampled.detach())
    assert relative_error(td["relevance", "x"], x * shares) <= 1e-10  # LRP-0 through the up-sampling
    (by_weights,) = torch.autograd.grad(model[0](leaf), leaf, upsampled_relevance)
    theirs = zennit_model_relevance(zcomposites.EpsilonPlus(epsilon=1e-12), copy.deepcopy(model), x)
    assert relative_error(theirs, by_weights) <= 1e-10  # zennit: the relevance through the gradient
    assert (relative_error(td["relevance", "x"], theirs) <= 1e-10) == (mode == "nearest")
