"""effective_parameters: the weight and bias a Linear or convolution layer really computes with (float64).

A layer whose forward rewrites its weight (timm's weight-standardised convolutions) or whose weight is parametrized
(weight_norm, spectral_norm, orthogonal) must be explained as the same network written with plain layers holding the
effective weights; finding them must leave the layer's state as it was.
"""

from __future__ import annotations

import copy
import importlib

import pytest
import timm.layers
import torch
import torch.nn.functional as F
from tensordict import TensorDict
from torch import nn
from torch.nn.utils import parametrizations, prune

from tdhook.attribution import LRP, AttnLRP, UniformEpsilon
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.rules._layers import effective_parameters, forward_with
from tests.attribution.rules._helpers import CNN_PRESETS, F64, LAYERS, make_layer
from tests.attribution.test_lrp_layers import lrp_relevance, randomise_batch_norm
from tests.conftest import relative_error

# ----------------------------------------------------------------------------- the layers and their weights by hand


def std_conv(in_channels: int, out_channels: int, kernel: int, **options) -> nn.Module:
    return timm.layers.StdConv2d(in_channels, out_channels, kernel, bias=True, eps=1e-5, **options)


def scaled_std_conv(in_channels: int, out_channels: int, kernel: int, **options) -> nn.Module:
    layer = timm.layers.ScaledStdConv2d(in_channels, out_channels, kernel, bias=True, gamma=1.7, eps=1e-5, **options)
    with torch.no_grad():
        layer.gain.copy_(torch.randn_like(layer.gain))
    return layer


def weight_norm(layer: nn.Module) -> nn.Module:
    layer = parametrizations.weight_norm(layer)
    with torch.no_grad():  # the magnitudes away from the direction's norms they start at
        layer.parametrizations.weight.original0.mul_(torch.rand_like(layer.parametrizations.weight.original0) + 0.5)
    return layer


PARAMETRIZATIONS = {
    "weight_norm": weight_norm,
    "spectral_norm": parametrizations.spectral_norm,
    "orthogonal": parametrizations.orthogonal,
}


def parametrized(parametrization):
    def make(in_channels: int, out_channels: int, kernel: int, **options) -> nn.Module:
        return parametrization(nn.Conv2d(in_channels, out_channels, kernel, **options).double())

    return make


KINDS = {
    "StdConv2d": std_conv,
    "ScaledStdConv2d": scaled_std_conv,
    **{name: parametrized(parametrization) for name, parametrization in PARAMETRIZATIONS.items()},
}
PARAMETRIZED = sorted(PARAMETRIZATIONS)


def standardised(weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``(w − mean) / sqrt(var + eps)`` over each output channel's weights."""
    flat = weight.flatten(1)
    mean, var = flat.mean(1, keepdim=True), flat.var(1, unbiased=False, keepdim=True)
    return ((flat - mean) / (var + eps).sqrt()).view_as(weight)


def weight_by_hand(layer: nn.Module) -> torch.Tensor:
    """The weight ``layer`` computes with, from its stored tensors."""
    with torch.no_grad():
        if isinstance(layer, timm.layers.ScaledStdConv2d):
            return standardised(layer.weight, layer.eps) * layer.gain * layer.scale
        if isinstance(layer, timm.layers.StdConv2d):
            return standardised(layer.weight, layer.eps)
        if not hasattr(layer, "parametrizations"):
            return layer.weight.clone()  # a plain layer
        parametrization = layer.parametrizations.weight
        if hasattr(parametrization, "original0"):  # weight_norm: g · v / ‖v‖ per output channel
            g, v = parametrization.original0, parametrization.original1
            return g * v / v.flatten(1).norm(dim=1).view(-1, *[1] * (v.dim() - 1))
        original = parametrization.original
        if hasattr(parametrization[0], "_u"):  # spectral_norm, in eval mode: σ = u · W v, no power iteration
            u, v = parametrization[0]._u, parametrization[0]._v
            return original / torch.vdot(u, original.flatten(1) @ v)
        return layer.weight.clone()  # orthogonal: the parametrization's own matrix (checked to be orthogonal)


def stored_weight(layer: nn.Module) -> torch.Tensor:
    """The weight as stored: the parameter the forward rewrites, or the parametrization's (direction) original."""
    if not hasattr(layer, "parametrizations"):
        return layer.weight.detach()
    parametrization = layer.parametrizations.weight
    return getattr(parametrization, "original1", getattr(parametrization, "original", None)).detach()


def plain_copy(layer: nn.Module) -> nn.Module:
    """A plain ``nn.Conv2d`` or ``nn.Linear`` holding ``layer``'s effective weight, computed by hand."""
    if isinstance(layer, nn.Linear):
        plain = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    else:
        plain = nn.Conv2d(
            layer.in_channels,
            layer.out_channels,
            layer.kernel_size,
            stride=layer.stride,
            padding=layer.padding,
            dilation=layer.dilation,
            groups=layer.groups,
            bias=layer.bias is not None,
        )
    plain = plain.double()
    with torch.no_grad():
        plain.weight.copy_(weight_by_hand(layer))
        if layer.bias is not None:
            plain.bias.copy_(layer.bias)
    return plain


def build(kind: str, batch_norm: bool = False) -> nn.Sequential:
    """Two convolutions of ``kind`` (a BatchNorm after each with ``batch_norm``), ReLUs and a head."""
    make = KINDS[kind]

    def block(in_channels: int, out_channels: int, **options) -> list[nn.Module]:
        layers = [make(in_channels, out_channels, 3, **options)]
        if batch_norm:
            layers.append(randomise_batch_norm(nn.BatchNorm2d(out_channels)))
        return [*layers, nn.ReLU()]

    layers = [*block(3, 4, padding=1), *block(4, 5, padding=1, stride=2)]
    head = [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(5, 3)]
    if kind in PARAMETRIZED:
        head[-1] = PARAMETRIZATIONS[kind](nn.Linear(5, 3).double())
    model = nn.Sequential(*layers, *head).double()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                module.bias.normal_()
    return model.eval()


def with_plain_layers(model: nn.Sequential) -> nn.Sequential:
    return nn.Sequential(*[plain_copy(m) if isinstance(m, (nn.Conv2d, nn.Linear)) else m for m in model])


def snapshot(module: nn.Module) -> dict:
    """Every parameter and buffer (values, bits and version counters) and every training flag."""
    tensors = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    return {
        "values": {name: t.detach().clone() for name, t in tensors.items()},
        "versions": {name: t._version for name, t in tensors.items()},
        "training": [m.training for m in module.modules()],
        "requires_grad": {name: t.requires_grad for name, t in tensors.items()},
    }


def assert_bit_identical(module: nn.Module, before: dict) -> None:
    after = snapshot(module)
    assert after["values"].keys() == before["values"].keys()
    for name, value in before["values"].items():
        now = after["values"][name]
        assert now.dtype == value.dtype and torch.equal(now.view(torch.int64), value.view(torch.int64)), name
    assert after["versions"] == before["versions"]
    assert after["training"] == before["training"]
    assert after["requires_grad"] == before["requires_grad"]


# ----------------------------------------------------------------------------- tests


class TestPlainLayers:
    @pytest.mark.parametrize("bias", [True, False])
    @pytest.mark.parametrize("kind", LAYERS)
    def test_own_parameters(self, kind: str, bias: bool):
        layer, _ = make_layer(kind)
        if not bias:
            layer.bias = None
        params = effective_parameters(layer)
        expected = dict(layer.named_parameters(recurse=False))
        assert params.keys() == expected.keys()
        for name, value in expected.items():
            assert torch.equal(params[name], value) and not params[name].requires_grad


class TestRewrittenWeights:
    @pytest.mark.parametrize("kind", sorted(KINDS))
    def test_weight_and_bias_are_the_ones_computed_with(self, kind: str):
        layer = KINDS[kind](3, 4, 3, padding=1).double().eval()
        params = effective_parameters(layer)
        assert sorted(params) == ["bias", "weight"]
        assert relative_error(params["weight"], weight_by_hand(layer)) <= 1e-12
        assert torch.equal(params["bias"], layer.bias.detach())
        assert not params["weight"].requires_grad
        # The rewritten weight is not the stored one: the test tells them apart.
        assert relative_error(params["weight"], stored_weight(layer)) > 1e-3

    def test_orthogonal_weight_is_orthogonal(self):
        layer = parametrizations.orthogonal(nn.Linear(4, 6).double())
        weight = effective_parameters(layer)["weight"]
        torch.testing.assert_close(weight.T @ weight, torch.eye(4, dtype=F64))

    @pytest.mark.parametrize("kind", PARAMETRIZED)
    def test_parametrized_linear(self, kind: str):
        layer = PARAMETRIZATIONS[kind](nn.Linear(5, 3).double()).eval()
        assert relative_error(effective_parameters(layer)["weight"], weight_by_hand(layer)) <= 1e-12

    @pytest.mark.parametrize("mode", ["reflect", "circular"])
    @pytest.mark.parametrize("kind", PARAMETRIZED)
    def test_a_padding_that_copies_the_input_wider_than_the_kernel(self, kind: str, mode: str):
        # The probe input was the kernel's extent: a reflect or circular padding wider than that cannot pad it, and
        # the layer was refused at registration ("Padding size should be less than the corresponding input ...").
        layer = PARAMETRIZATIONS[kind](nn.Conv1d(2, 3, 1, stride=2, padding=2, padding_mode=mode).double()).eval()
        assert relative_error(effective_parameters(layer)["weight"], weight_by_hand(layer)) <= 1e-12

    def test_layer_calling_no_linear_function_raises(self):
        class Skipping(nn.Linear):
            def forward(self, x):
                return x

        with pytest.raises(ValueError, match="Skipping: its forward called no linear or convolution function"):
            effective_parameters(Skipping(3, 3))


class TestRelevance:
    """Under every CNN preset, the network explains as the one written with plain layers."""

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("batch_norm", [False, True], ids=["alone", "batch-norm"])
    @pytest.mark.parametrize("kind", sorted(KINDS))
    def test_equals_plain_layers_holding_the_effective_weights(self, kind: str, batch_norm: bool, preset: str):
        model = build(kind, batch_norm)
        plain = with_plain_layers(model)
        x = torch.randn(2, 3, 7, 7, dtype=F64).clamp(-2.9, 2.9)
        torch.testing.assert_close(plain(x), model(x), rtol=1e-12, atol=1e-12)
        relevance_out = torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, CNN_PRESETS[preset]())
        expected = lrp_relevance(plain, x, relevance_out, CNN_PRESETS[preset]())
        assert relative_error(actual, expected) <= 1e-12

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("attribute, value", [("scale", 0.123), ("eps", 0.5)])
    def test_a_number_the_weight_reads_set_in_an_open_context_is_followed(self, attribute, value, preset: str):
        # The modified and merged weights were kept from the context's first call: 34 % to 67 % off (scale), 77 % to
        # 4.9 times the relevance (eps).
        model = build("ScaledStdConv2d", batch_norm=True)
        x = torch.randn(2, 3, 7, 7, dtype=F64).clamp(-2.9, 2.9)
        relevance_out = torch.randn(2, 3, dtype=F64)
        lrp = LRP(model, CNN_PRESETS[preset](), in_keys=["x"], out_keys=["y"], target=lambda y: relevance_out)
        with lrp:
            lrp(TensorDict(x=x.clone(), batch_size=[2]))
            for layer in (model[0], model[3]):
                setattr(layer, attribute, value)
            actual = lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]
        expected = lrp_relevance(with_plain_layers(model), x, relevance_out, CNN_PRESETS[preset]())
        assert relative_error(actual, expected) <= 1e-12

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm"])
    def test_a_parametrized_transposed_convolution_equals_the_plain_one_and_keeps_its_parameters(
        self, kind: str, preset: str
    ):
        # Its modified passes must run the transposed convolution itself: torch.func.functional_call would set the
        # rule's weights through the parametrization, writing them into its original (the parameter).
        upsample = PARAMETRIZATIONS[kind](nn.ConvTranspose2d(4, 4, 3, stride=2).double())
        model = (
            nn.Sequential(
                nn.Conv2d(3, 4, 3, padding=1),
                nn.ReLU(),
                upsample,
                randomise_batch_norm(nn.BatchNorm2d(4)),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(4 * 9 * 9, 3),
            )
            .double()
            .eval()
        )
        plain = nn.ConvTranspose2d(4, 4, 3, stride=2).double()
        with torch.no_grad():
            plain.weight.copy_(upsample.weight)
            plain.bias.copy_(upsample.bias)
        reference = nn.Sequential(*model[:2], plain, *model[3:])
        x = torch.randn(2, 3, 4, 4, dtype=F64)
        before = snapshot(model)
        relevance_out = torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, CNN_PRESETS[preset]())
        assert_bit_identical(model, before)
        assert relative_error(actual, lrp_relevance(reference, x, relevance_out, CNN_PRESETS[preset]())) <= 1e-12

    def test_a_modified_pass_refuses_a_parametrized_module_it_would_write_into(self):
        bilinear = parametrizations.weight_norm(nn.Bilinear(2, 2, 1).double())
        original = bilinear.parametrizations.weight.original1.detach().clone()
        with pytest.raises(ValueError, match="ParametrizedBilinear: a rule's modified pass cannot run"):
            forward_with(bilinear, {"weight": torch.ones(1, 2, 2, dtype=F64)}, torch.ones(1, 2, dtype=F64), [])
        assert torch.equal(bilinear.parametrizations.weight.original1, original)

    @pytest.mark.parametrize("kind", PARAMETRIZED)
    def test_parametrizations_get_no_rule(self, kind: str):
        # A weight's parametrization computes a weight, not activations: a strict mapper does not ask for its rule.
        rules = BaseRuleMapper(strict=True).rules(build(kind))
        assert not any("parametrizations" in name for name in rules)


class TestStateUntouched:
    @pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
    @pytest.mark.parametrize("kind", [*sorted(KINDS), "plain"])
    def test_state_is_bit_identical(self, kind: str, training: bool):
        if kind == "plain":
            layer, _ = make_layer("conv2d")
        else:
            layer = KINDS[kind](3, 4, 3, padding=1).double()
        layer.train(training)
        if kind == "spectral_norm":
            layer(torch.randn(1, 3, 5, 5, dtype=F64))  # u and v after some power iterations
            # In training mode the power iteration would move u and v again: the test can tell.
            moved = copy.deepcopy(layer).train()
            moved(torch.randn(1, 3, 5, 5, dtype=F64))
            assert not torch.equal(moved.parametrizations.weight[0]._u, layer.parametrizations.weight[0]._u)
        before = snapshot(layer)
        effective_parameters(layer)
        assert_bit_identical(layer, before)


class TestTrainingMode:
    """spectral_norm in training mode (a GAN's discriminator, an RL critic being trained): one power iteration per
    call of the layer, the wrapper's included, and no more; reading the weight outside the call used to run it
    again (twice per call under LRP-0, four times under EpsilonPlus)."""

    @pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
    @pytest.mark.parametrize("preset", ["LRP-0", *sorted(CNN_PRESETS)])
    @pytest.mark.parametrize("kind", ["parametrization", "hook"])
    def test_one_call_iterates_once_and_explains_with_the_weight_it_used(self, kind: str, preset: str):
        norm = parametrizations.spectral_norm if kind == "parametrization" else nn.utils.spectral_norm
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.ReLU(),
            norm(nn.Conv2d(4, 5, 3)),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(45, 3),
        ).double()
        x = torch.randn(2, 3, 5, 5, dtype=F64)
        with torch.no_grad():  # the hook's weight is then a leaf: the model can be copied
            model(x)  # u and v after a power iteration
            called = copy.deepcopy(model)
            called(x)  # one more: what one explained call must leave
        mapper = BaseRuleMapper(stabilizer=1e-12) if preset == "LRP-0" else CNN_PRESETS[preset]()
        relevance_out = torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, mapper)
        u = "parametrizations.weight.0._u" if kind == "parametrization" else "weight_u"
        assert torch.equal(model[2].get_buffer(u), called[2].get_buffer(u))
        plain = nn.Conv2d(4, 5, 3).double()
        with torch.no_grad():
            plain.weight.copy_(effective_parameters(model[2])["weight"])
            plain.bias.copy_(model[2].bias)
        reference = nn.Sequential(model[0], model[1], plain, *model[3:])
        mapper = BaseRuleMapper(stabilizer=1e-12) if preset == "LRP-0" else CNN_PRESETS[preset]()
        assert relative_error(actual, lrp_relevance(reference, x, relevance_out, mapper)) <= 1e-12


class TestHookBasedParametrizations:
    """torch.nn.utils.weight_norm and spectral_norm (hook-based, before parametrizations): the hook's weight."""

    @pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
    @pytest.mark.parametrize("legacy", ["weight_norm", "spectral_norm"])
    def test_equals_plain_layers_holding_the_effective_weights(self, legacy: str):
        layer = getattr(nn.utils, legacy)(nn.Conv2d(3, 4, 3, padding=1).double())
        model = nn.Sequential(layer, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).double()
        model = model.eval()
        x = torch.randn(2, 3, 5, 5, dtype=F64)
        with torch.no_grad():
            model(x)
            plain = nn.Conv2d(3, 4, 3, padding=1).double()
            plain.weight.copy_(layer.weight)
            plain.bias.copy_(layer.bias)
        reference = copy.deepcopy(model)
        reference[0] = plain
        relevance_out = torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, CNN_PRESETS["EpsilonAlpha2Beta1"]())
        expected = lrp_relevance(reference, x, relevance_out, CNN_PRESETS["EpsilonAlpha2Beta1"]())
        assert relative_error(actual, expected) <= 1e-12

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("pruned", ["weight", "bias", "weight+bias"])
    def test_pruned_layers_equal_plain_layers_holding_the_masked_tensors(self, pruned: str, preset: str):
        # torch.nn.utils.prune keeps weight_orig (a parameter) and sets ``weight`` = original × mask before each
        # call; a pruned bias was once read from bias_orig, unmasked, by the modified rules (z⁺ off by 9.5e-2).
        model = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 5, 3), nn.ReLU(), nn.Flatten(), nn.Linear(45, 3)
        ).double()
        with torch.no_grad():
            for index in (0, 2, 5):
                model[index].bias.normal_()
        reference = copy.deepcopy(model)
        for index in (0, 2, 5):
            for name in pruned.split("+"):
                prune.random_unstructured(model[index], name, amount=0.5)
                with torch.no_grad():
                    getattr(reference[index], name).copy_(getattr(model[index], name))
        x = torch.randn(2, 3, 5, 5, dtype=F64)
        relevance_out = torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, CNN_PRESETS[preset]())
        expected = lrp_relevance(reference, x, relevance_out, CNN_PRESETS[preset]())
        assert relative_error(actual, expected) <= 1e-12
        # The unmasked tensors give other relevance: the test can tell.
        unmasked = copy.deepcopy(reference)
        for index in (0, 2, 5):
            for name in pruned.split("+"):
                with torch.no_grad():
                    getattr(unmasked[index], name).copy_(getattr(model[index], name + "_orig"))
        assert relative_error(lrp_relevance(unmasked, x, relevance_out, CNN_PRESETS[preset]()), expected) > 1e-3

    @pytest.mark.filterwarnings("ignore:`torch.nn.utils.weight_norm` is deprecated:FutureWarning")
    @pytest.mark.parametrize("legacy", ["weight_norm", "spectral_norm", "prune"])
    def test_the_weight_a_hook_computed_keeps_its_graph(self, legacy: str):
        # Finding the effective weight runs the hook without gradients; the weight the layer's last call set, with
        # its graph to the parameters, is put back, so that a loss on ``layer.weight`` still trains them.
        conv = nn.Conv2d(3, 4, 3).double()
        layer = prune.l1_unstructured(conv, "weight", 0.3) if legacy == "prune" else getattr(nn.utils, legacy)(conv)
        model = nn.Sequential(layer, nn.ReLU(), nn.Flatten(), nn.Linear(36, 3)).double()
        x = torch.randn(2, 3, 5, 5, dtype=F64)
        model(x)
        weight = layer.weight
        assert weight.grad_fn is not None
        lrp_relevance(model, x, torch.randn(2, 3, dtype=F64), CNN_PRESETS["EpsilonPlus"]())
        assert layer.weight.grad_fn is not None
        effective_parameters(layer)
        assert layer.weight is not weight and layer.weight.grad_fn is not None  # the LRP call's own forward set it


class TestForwardsThatPad:
    """timm's ``Conv2dSame`` pads in its own forward; the modified forward passes must pad as it does."""

    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("kernel", [3, 5])
    def test_same_padding_equals_the_plain_convolution_padded_alike(self, preset: str, kernel: int):
        torch.manual_seed(0)
        same = timm.layers.Conv2dSame(3, 4, kernel)  # stride 1: (kernel - 1) / 2 on every side
        plain = nn.Conv2d(3, 4, kernel, padding=(kernel - 1) // 2)
        plain.load_state_dict(same.state_dict())
        models = [nn.Sequential(c, nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten()).double() for c in (same, plain)]
        models[1][2].load_state_dict(models[0][2].state_dict())
        x = torch.rand(2, 3, 6, 6, dtype=F64) * 2 - 1
        relevance_out = torch.randn(2, 4 * (6 - 2) ** 2, dtype=F64)
        actual, expected = (lrp_relevance(m, x, relevance_out, CNN_PRESETS[preset]()) for m in models)
        assert relative_error(actual, expected) <= 1e-12


class TestQuantizationAwareLayers:
    """torch.ao's quantization-aware layers (``prepare_qat``), fake quantisation off: a convolution whose forward
    is linear in its convolution's output explains as the plain one; one that runs an activation or adds a
    BatchNorm's shift after it is refused by name (the modified passes would run through the activation, or keep
    the shift unmodified: α2β1 once gave twice the relevance on ``ConvBnReLU2d``, silently)."""

    @staticmethod
    def qat_layer(kind: str, shift: bool = True) -> nn.Module:
        from torch.ao import quantization
        from torch.ao.nn import intrinsic, qat
        from torch.ao.nn.intrinsic import qat as intrinsic_qat

        torch.manual_seed(0)
        conv, norm = nn.Conv2d(4, 5, 3, padding=1, bias=False), randomise_batch_norm(nn.BatchNorm2d(5)).float()
        with torch.no_grad():
            norm.weight.mul_(torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0]))  # negative scales: signs swap in the merge
            if not shift:
                norm.bias.zero_()
                norm.running_mean.zero_()
        fused = {
            "Conv2d": lambda: conv,
            "ConvBn2d": lambda: intrinsic.ConvBn2d(conv, norm),
            "ConvReLU2d": lambda: intrinsic.ConvReLU2d(conv, nn.ReLU()),
            "ConvBnReLU2d": lambda: intrinsic.ConvBnReLU2d(conv, norm, nn.ReLU()),
        }[kind]()
        for module in fused.modules():
            module.qconfig = quantization.get_default_qat_qconfig("x86")
        layer = (qat.Conv2d if kind == "Conv2d" else getattr(intrinsic_qat, kind)).from_float(fused)
        with torch.no_grad():  # the observers see one batch: the fake quantiser's scales are then defined
            layer.eval()(torch.randn(2, 4, 5, 5))
        layer = layer.double()
        layer.apply(quantization.disable_observer)
        layer.apply(quantization.disable_fake_quant)  # fake quantisation runs in float32 only
        return layer.eval()

    @staticmethod
    def model(layer: nn.Module) -> nn.Sequential:
        torch.manual_seed(1)
        head = [nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(5, 3)]
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), layer, *head).double().eval()

    @pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonAlpha2Beta1", "EpsilonGammaBox"])
    @pytest.mark.parametrize(
        ("kind", "what"),
        [("ConvReLU2d", "is not affine"), ("ConvBnReLU2d", "is not affine"), ("ConvBn2d", "adds a shift")],
    )
    def test_layer_not_linear_after_its_convolution_is_refused_by_name(self, kind: str, what: str, preset: str):
        model = self.model(self.qat_layer(kind))
        x = torch.randn(2, 3, 5, 5, dtype=F64)
        before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        # Named with its path, also under EpsilonGammaBox, whose first-layer switch chooses its rule in the call.
        with pytest.raises(ValueError, match=rf"module '2' \({kind}\): {kind}: its forward {what}"):
            lrp_relevance(model, x, torch.randn(2, 3, dtype=F64), CNN_PRESETS[preset]())
        after = model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())

    @pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize("kind", ["Conv2d", "ConvBn2d"])
    def test_layer_linear_after_its_convolution_explains_as_the_plain_one(self, kind: str, preset: str):
        layer = self.qat_layer(kind, shift=False)
        plain = nn.Conv2d(4, 5, 3, padding=1, bias=False).double()
        with torch.no_grad():  # the BatchNorm's scale γ / sqrt(var + eps) folded into the weight
            scale = layer.bn.weight / (layer.bn.running_var + layer.bn.eps).sqrt() if kind == "ConvBn2d" else 1.0
            plain.weight.copy_(layer.weight * torch.as_tensor(scale).reshape(-1, 1, 1, 1))
        model, reference = self.model(layer), self.model(plain)
        x = torch.randn(2, 3, 5, 5, dtype=F64)
        torch.testing.assert_close(model(x), reference(x))
        relevance_out = torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, CNN_PRESETS[preset]())
        expected = lrp_relevance(reference, x, relevance_out, CNN_PRESETS[preset]())
        # The BatchNorm inside ConvBn2d keeps its own (stabilised) rule: differences of the order of the stabilizer.
        assert relative_error(actual, expected) <= (1e-4 if kind == "ConvBn2d" else 1e-9)

    @pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
    def test_activation_inside_the_first_layer_is_refused_by_name(self):
        model = nn.Sequential(self.qat_layer("ConvReLU2d"), nn.Flatten()).double()
        with pytest.raises(ValueError, match=r"module '0' \(ConvReLU2d\): ConvReLU2d: its forward is not affine"):
            x, relevance_out = torch.randn(2, 4, 3, 3, dtype=F64), torch.randn(2, 45, dtype=F64)
            lrp_relevance(model, x, relevance_out, CNN_PRESETS["EpsilonGammaBox"]())


# ----------------------------------------------------------------------------- activations inside a layer's forward


def _tanh(z: torch.Tensor) -> torch.Tensor:
    return torch.tanh(z)


def _cube(z: torch.Tensor) -> torch.Tensor:
    return z**3


def _clip(z: torch.Tensor) -> torch.Tensor:
    return F.hardtanh(z, -0.2, 0.2)


def _softmax(z: torch.Tensor) -> torch.Tensor:
    return F.softmax(z, -1)


def _relu(z: torch.Tensor) -> torch.Tensor:
    return torch.relu(z)


def layer_with(kind: str, activation, where: str) -> nn.Module:
    """A Linear or Conv2d subclass whose own forward runs ``activation`` before or after its linear function."""
    base = nn.Linear if kind == "Linear" else nn.Conv2d

    class Layer(base):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(activation(x)) if where == "before" else activation(super().forward(x))

    Layer.__name__ = f"{kind}{activation.__name__.strip('_').title()}{where.title()}"
    return Layer(4, 4) if kind == "Linear" else Layer(4, 4, 3, padding=1)


def model_around(layer: nn.Module, kind: str) -> nn.Sequential:
    torch.manual_seed(2)
    first = nn.Linear(3, 4) if kind == "Linear" else nn.Conv2d(3, 4, 3, padding=1)
    head = [nn.ReLU(), nn.Flatten(), nn.Linear(4 if kind == "Linear" else 64, 3)]
    return nn.Sequential(first, nn.ReLU(), layer, *head).double().eval()


def input_of(kind: str) -> torch.Tensor:
    return torch.randn(2, 3, dtype=F64) if kind == "Linear" else torch.randn(2, 3, 4, 4, dtype=F64)


ACTIVATIONS_REFUSED = [(_tanh, "after"), (_tanh, "before"), (_cube, "after")]


PROBING_PRESETS = {
    **CNN_PRESETS,
    "UniformEpsilon": lambda: UniformEpsilon(),
    "AttnLRP": lambda: AttnLRP(epsilon=1e-6),
}


class TestActivationsInsideLayers:
    """A Linear or convolution subclass whose own forward runs an activation before or after its linear function:
    the layer's rule (ε, or a modified pass) would send the relevance through that activation's gradient, which no
    rule's relevance is. tanh, a cube or a clip inside gave silently other relevance than the same activation as a
    module beside the layer (in float64, relative L2: z⁺ 0.15 with tanh after, 2.0 with a cube after, 0.98 with a
    clip after; ε 0.098 with tanh after, 0.29 with tanh before); they are refused by name. A ReLU inside, and a gate
    computed from the input and a clip in an ε-layer (held and passed by the CNN presets' function rules), are
    explained as the plain layers are."""

    # A clip after the linear function: refused by the modified passes (convolutions under the CNN presets), which
    # run through it; the ε-rule's layers (Linear under the CNN presets) have it passed by the function rules.
    @pytest.mark.parametrize("preset", sorted(CNN_PRESETS))
    @pytest.mark.parametrize(
        ("activation", "where", "kind"),
        [
            *[(activation, where, kind) for activation, where in ACTIVATIONS_REFUSED for kind in ("Linear", "Conv2d")],
            (_clip, "after", "Conv2d"),
        ],
    )
    def test_an_activation_not_piecewise_linear_through_0_is_refused_by_name(self, activation, where, kind, preset):
        torch.manual_seed(1)
        layer = layer_with(kind, activation, where).double()
        model, x = model_around(layer, kind), input_of(kind)
        before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        name = type(layer).__name__
        with pytest.raises(ValueError, match=rf"module '2' \({name}\): {name}: its forward runs an activation that"):
            lrp_relevance(model, x, torch.randn(2, 3, dtype=F64), CNN_PRESETS[preset]())
        after = model.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], v) for k, v in before.items())

    # A ReLU after the linear function: under the ε-rule only (the modified passes and the first-layer rules refuse
    # it, see TestQuantizationAwareLayers); a ReLU before it: under every rule.
    @pytest.mark.parametrize(
        ("where", "kind", "preset"),
        [("before", kind, preset) for kind in ("Linear", "Conv2d") for preset in sorted(CNN_PRESETS)]
        + [("after", "Linear", preset) for preset in ("EpsilonAlpha2Beta1", "EpsilonGammaBox", "EpsilonPlus")],
    )
    def test_a_relu_inside_explains_as_the_plain_layer_beside_a_relu(self, where: str, kind: str, preset: str):
        torch.manual_seed(1)
        layer = layer_with(kind, _relu, where).double()
        plain = (nn.Linear(4, 4) if kind == "Linear" else nn.Conv2d(4, 4, 3, padding=1)).double()
        plain.load_state_dict(layer.state_dict())
        beside = [nn.ReLU(), plain] if where == "before" else [plain, nn.ReLU()]
        model = model_around(layer, kind)
        reference = nn.Sequential(model[0], model[1], *beside, *model[3:])
        x, relevance_out = input_of(kind), torch.randn(2, 3, dtype=F64)
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
        actual = lrp_relevance(model, x, relevance_out, CNN_PRESETS[preset]())
        assert relative_error(actual, lrp_relevance(reference, x, relevance_out, CNN_PRESETS[preset]())) <= 1e-12

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox"])
    def test_a_gate_inside_a_linear_layer_is_held_as_one_outside(self, preset: str):
        class Gated(nn.Linear):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return super().forward(x) * torch.sigmoid(x.sum(-1, keepdim=True))

        class GatedBeside(nn.Module):
            def __init__(self, linear: nn.Linear) -> None:
                super().__init__()
                self.linear = linear

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.linear(x) * torch.sigmoid(x.sum(-1, keepdim=True))

        torch.manual_seed(1)
        layer = Gated(4, 4).double()
        plain = nn.Linear(4, 4).double()
        plain.load_state_dict(layer.state_dict())
        model = model_around(layer, "Linear")
        reference = nn.Sequential(model[0], model[1], GatedBeside(plain), *model[3:])
        x, relevance_out = input_of("Linear"), torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, CNN_PRESETS[preset]())
        # ε = 1e-6 on the layer's gated output against ε on the linear output alone: differences of that order.
        assert relative_error(actual, lrp_relevance(reference, x, relevance_out, CNN_PRESETS[preset]())) <= 1e-5

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox"])
    def test_a_clip_inside_a_linear_layer_is_passed_as_a_hardtanh_beside_it(self, preset: str):
        torch.manual_seed(1)
        layer = layer_with("Linear", _clip, "after").double()
        plain = nn.Linear(4, 4).double()
        plain.load_state_dict(layer.state_dict())
        model = model_around(layer, "Linear")
        reference = nn.Sequential(model[0], model[1], plain, nn.Hardtanh(-0.2, 0.2), *model[3:])
        x, relevance_out = input_of("Linear"), torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, CNN_PRESETS[preset]())
        # ε = 1e-6 on the clipped output against ε on the linear output: differences of that order.
        assert relative_error(actual, lrp_relevance(reference, x, relevance_out, CNN_PRESETS[preset]())) <= 1e-5

    # A softmax after the linear function (a classifier or policy head written as one layer): the presets' softmax
    # rules explain it as an nn.Softmax beside the layer; it was refused as an activation the ε-rule runs through.
    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox", "AttnLRP"])
    @pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
    def test_a_softmax_inside_a_linear_layer_is_explained_as_one_beside_it(self, preset: str, log: bool):
        class Head(nn.Linear):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                z = super().forward(x)
                return F.log_softmax(z, -1) if log else F.softmax(z, -1)

        torch.manual_seed(1)
        layer = Head(4, 4).double()
        plain = nn.Linear(4, 4).double()
        plain.load_state_dict(layer.state_dict())
        model = model_around(layer, "Linear")
        softmax = nn.LogSoftmax(-1) if log else nn.Softmax(-1)
        reference = nn.Sequential(model[0], model[1], plain, softmax, *model[3:])
        x, relevance_out = input_of("Linear"), torch.randn(2, 3, dtype=F64)
        actual = lrp_relevance(model, x, relevance_out, PROBING_PRESETS[preset]())
        # ε = 1e-6 on the softmax's output against ε on the linear output: differences of that order.
        assert relative_error(actual, lrp_relevance(reference, x, relevance_out, PROBING_PRESETS[preset]())) <= 1e-5

    # Under a large ε the rule stabilises the function's output, not the linear output: a clip inside gave 0.35
    # relative L2 against a Hardtanh beside the layer under UniformEpsilon (ε = 0.25), silently; a softmax 0.40.
    @pytest.mark.parametrize("activation", [_clip, _softmax], ids=["clip", "softmax"])
    def test_a_clip_or_softmax_inside_a_layer_under_a_large_epsilon_is_refused(self, activation):
        torch.manual_seed(1)
        layer = layer_with("Linear", activation, "after").double()
        model, x = model_around(layer, "Linear"), input_of("Linear")
        name = type(layer).__name__
        with pytest.raises(ValueError, match=rf"module '2' \({name}\): {name}: its forward runs an activation that"):
            lrp_relevance(model, x, torch.randn(2, 3, dtype=F64), UniformEpsilon())


# ----------------------------------------------------------------------------- what the probes of a layer leave


class NoisyWhenAsked(nn.Linear):
    """Adds noise of a scale held in a buffer (0 here): linear in its input, but its forward draws random numbers."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features)
        self.register_buffer("noise", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + self.noise * torch.randn(out.shape, dtype=out.dtype, device=out.device)


class TestProbesLeaveTheLayer:
    """The checks of a layer's own forward run it on probe inputs; what that forward sets on the layer, and the
    random numbers it draws, must be as before. timm's ``Conv2dSameExport`` builds its padding at its first call,
    for that input's size: built for the probe's (3 × 3, padding 1 on every side) in place of the input's (6 × 6,
    0 before and 1 after), it gave other outputs from then on (3.4e-2 relative L2) and other relevance (0.89 under
    the CNN presets' z⁺, 1.42 under UniformEpsilon's ε-rule)."""

    @pytest.mark.parametrize("preset", [*sorted(CNN_PRESETS), "UniformEpsilon"])
    def test_a_padding_built_at_the_first_call_is_built_for_the_input(self, preset: str):
        torch.manual_seed(3)
        export = importlib.import_module("timm.layers.conv2d_same").Conv2dSameExport(4, 4, 3, stride=2)
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), export, nn.ReLU(), nn.Flatten())
        model = nn.Sequential(*model, nn.Linear(4 * 3 * 3, 3)).double().eval()
        reference = copy.deepcopy(model)
        x, relevance_out = torch.randn(2, 3, 6, 6, dtype=F64), torch.randn(2, 3, dtype=F64)
        reference(x)  # its padding built for the input
        actual = lrp_relevance(model, x, relevance_out, PROBING_PRESETS[preset]())
        assert relative_error(actual, lrp_relevance(reference, x, relevance_out, PROBING_PRESETS[preset]())) <= 1e-12
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)

    @pytest.mark.parametrize("preset", sorted(PROBING_PRESETS))
    def test_the_random_number_generator_is_left_as_it_was(self, preset: str):
        torch.manual_seed(1)
        model = model_around(NoisyWhenAsked(4, 4).double(), "Linear")
        lrp = LRP(model, rule_mapper=PROBING_PRESETS[preset](), in_keys=["x"], out_keys=["y"], target=lambda y: y)
        before = torch.get_rng_state()
        with lrp:
            assert torch.equal(torch.get_rng_state(), before)
            x = torch.randn(2, 3, dtype=F64)
            relevance = lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]
        assert torch.isfinite(relevance).all() and relevance.abs().sum() > 0

    @pytest.mark.parametrize("preset", sorted(PROBING_PRESETS))
    @pytest.mark.parametrize("kind", ["Linear", "Conv2d"])
    def test_the_observers_of_a_fake_quantized_weight_see_only_the_calls(self, kind: str, preset: str):
        # A quantization-aware layer's weight observer moves towards each weight it sees, its scale with it: the
        # probes must not move it, or the call explained computes with another quantized weight than a plain call.
        qconfig = torch.ao.quantization.get_default_qat_qconfig("fbgemm")
        torch.manual_seed(1)
        if kind == "Linear":
            layer = torch.ao.nn.qat.Linear(4, 4, qconfig=qconfig)
        else:
            layer = torch.ao.nn.qat.Conv2d(4, 4, 3, padding=1, qconfig=qconfig)
        model, x = model_around(layer, kind).float(), input_of(kind).float()
        model(x)
        with torch.no_grad():
            layer.weight.mul_(1.5)  # an optimiser step since the last call
        reference = copy.deepcopy(model)
        lrp = LRP(model, rule_mapper=PROBING_PRESETS[preset](), in_keys=["x"], out_keys=["y"], target=lambda y: y)
        explained = lrp(TensorDict(x=x, batch_size=[2]))
        torch.testing.assert_close(explained["y"], reference(x), rtol=0, atol=0)
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=0, msg=name)
