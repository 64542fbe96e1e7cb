"""A Linear or convolution layer's forward of its own, however it is written (float64).

A forward set on the instance (``conv.forward = MethodType(...)`` or a lambda) is the layer's own, as the same
forward written in a subclass is: a weight it computes with (a mask) is the one explained, as the plain layer holding
that weight is; a second linear map it adds (a low-rank adapter patched in) is refused by name, as in a subclass. A
convolution's ``_conv_forward`` of its own (a weight standardised, masked, or the input padded circularly there) is
a forward of its own too: it explains as the plain convolution holding the weight it computes with.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tdhook.attribution.rules.modified import AlphaBetaRule
from tests.attribution.rules._helpers import CNN_PRESETS, F64
from tests.attribution.test_lrp_layers import lrp_relevance
from tests.conftest import relative_error

KINDS = ("Conv2d", "Linear")
# The CNN presets, and z⁺ on every layer: the presets explain a Linear layer by the ε-rule, which follows its forward.
PRESETS = {**CNN_PRESETS, "ZPlus": lambda: {nn.Linear: AlphaBetaRule(1.0, 0.0), nn.Conv2d: AlphaBetaRule(1.0, 0.0)}}


def build(kind: str) -> nn.Sequential:
    """A network whose layer ``2`` is a 4-to-4 ``kind`` between ReLUs, in eval mode."""
    torch.manual_seed(0)
    if kind == "Linear":
        layers = [nn.Linear(5, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3)]
    else:
        layers = [nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.ReLU()]
        layers += [nn.Flatten(), nn.Linear(4 * 5 * 5, 3)]
    model = nn.Sequential(*layers).double().eval()
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Conv2d, nn.Linear)):
                module.bias.normal_()
    return model


def inputs(kind: str) -> torch.Tensor:
    shape = (2, 5) if kind == "Linear" else (2, 3, 5, 5)
    return torch.randn(shape, dtype=F64, generator=torch.Generator().manual_seed(1)).clamp(-2.9, 2.9)


def mask_of(layer: nn.Module) -> torch.Tensor:
    return (torch.rand(layer.weight.shape, generator=torch.Generator().manual_seed(5)) > 0.5).to(F64)


def masked_forward(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A hand-written pruning: the layer computes with its weight times a mask."""
    weight = self.weight * self.mask
    if isinstance(self, nn.Linear):
        return nn.functional.linear(x, weight, self.bias)
    return self._conv_forward(x, weight, self.bias)


def masked(kind: str, spelling: str) -> nn.Sequential:
    """:func:`build`'s network whose layer ``2`` computes with its weight times a mask, by ``spelling``."""
    model = build(kind)
    layer = model[2]
    if spelling == "subclass":
        cls = type(f"Masked{kind}", (type(layer),), {"forward": masked_forward})
        made = cls(4, 4) if kind == "Linear" else cls(4, 4, 3, padding=1)
        made.double().load_state_dict(layer.state_dict())
        layer = model[2] = made
    layer.mask = mask_of(layer)
    if spelling == "method":
        layer.forward = types.MethodType(masked_forward, layer)
    elif spelling == "lambda":
        layer.forward = lambda x: masked_forward(layer, x)
    return model


def plain_twin(kind: str) -> nn.Sequential:
    """:func:`build`'s network with the masked weight stored in its plain layer ``2``."""
    model = build(kind)
    with torch.no_grad():
        model[2].weight.mul_(mask_of(model[2]))
    return model


class TestForwardSetOnTheInstance:
    """A forward set on the instance was not seen: the layer was explained with its stored weight (0.45 to 0.87
    relative L2 off), silently, even with ``strict=True``."""

    @pytest.mark.parametrize("preset", sorted(PRESETS))
    @pytest.mark.parametrize("spelling", ["method", "lambda", "subclass"])
    @pytest.mark.parametrize("kind", KINDS)
    def test_a_masked_weight_explains_as_the_plain_layer_holding_it(self, kind: str, spelling: str, preset: str):
        model, plain, x = masked(kind, spelling), plain_twin(kind), inputs(kind)
        torch.testing.assert_close(model(x), plain(x), rtol=1e-12, atol=1e-12)
        relevance_out = torch.randn(2, 3, dtype=F64, generator=torch.Generator().manual_seed(2))
        actual = lrp_relevance(model, x, relevance_out, PRESETS[preset]())
        expected = lrp_relevance(plain, x, relevance_out, PRESETS[preset]())
        assert relative_error(actual, expected) <= 1e-10

    @pytest.mark.parametrize("preset", sorted(PRESETS))
    def test_a_forward_padding_circularly_explains_as_the_plain_layer_padding_alike(self, preset: str):
        # The modified passes' input gradient was the zero-padded convolution's, read from the layer's settings.
        model, plain = build("Conv2d"), build("Conv2d")
        conv = model[2]
        conv.forward = lambda x: F.conv2d(F.pad(x, (1, 1, 1, 1), mode="circular"), conv.weight, conv.bias)
        plain[2].padding_mode, plain[2]._reversed_padding_repeated_twice = "circular", [1, 1, 1, 1]
        x = inputs("Conv2d")
        torch.testing.assert_close(model(x), plain(x), rtol=1e-12, atol=1e-12)
        relevance_out = torch.randn(2, 3, dtype=F64, generator=torch.Generator().manual_seed(2))
        actual = lrp_relevance(model, x, relevance_out, PRESETS[preset]())
        expected = lrp_relevance(plain, x, relevance_out, PRESETS[preset]())
        assert relative_error(actual, expected) <= 1e-10

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonAlpha2Beta1"])
    @pytest.mark.parametrize("spelling", ["method", "lambda", "subclass"])
    def test_a_low_rank_adapter_patched_in_is_refused_as_in_a_subclass(self, spelling: str, preset: str):
        model = build("Conv2d")
        conv = model[2]
        torch.manual_seed(3)
        adapter = nn.Sequential(nn.Conv2d(4, 2, 3, padding=1, bias=False), nn.Conv2d(2, 4, 1, bias=False)).double()

        def adapted(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
            return self._conv_forward(x, self.weight, self.bias) + self.adapter(x) * 0.5

        if spelling == "subclass":
            cls = type("Conv2d", (nn.Conv2d,), {"forward": adapted})
            made = cls(4, 4, 3, padding=1).double()
            made.load_state_dict(conv.state_dict())
            conv = model[2] = made
        conv.adapter = copy.deepcopy(adapter)
        if spelling == "method":
            conv.forward = types.MethodType(adapted, conv)
        elif spelling == "lambda":
            plain_forward = conv.forward
            conv.forward = lambda x: plain_forward(x) + conv.adapter(x) * 0.5
        what = r"module '2' \(Conv2d\): Conv2d: its forward calls 3 linear or convolution functions"
        with pytest.raises(ValueError, match=what):
            lrp_relevance(model, inputs("Conv2d"), torch.randn(2, 3, dtype=F64), CNN_PRESETS[preset]())

    def test_a_low_rank_update_written_as_a_parametrization_is_refused_as_one(self):
        """A parametrization computing the weight with linear layers of its own (``W + B(A W)``) made the layer's
        forward call three linear functions; the refusal said the layer added a second linear map of its input,
        which it does not, and advised merging the update into the weight, which the parametrization does. It now
        names the parametrization and how to remove it; the layer with the parametrization removed (the weight
        kept) explains as the plain layer holding that weight."""

        class LowRankUpdate(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.down, self.up = nn.Linear(4, 2, bias=False), nn.Linear(2, 4, bias=False)

            def forward(self, weight: torch.Tensor) -> torch.Tensor:
                return weight + self.up(self.down(weight))

        model, plain = build("Linear"), build("Linear")
        torch.manual_seed(3)
        nn.utils.parametrize.register_parametrization(model[2], "weight", LowRankUpdate().double())
        with torch.no_grad():
            plain[2].weight.copy_(model[2].weight)
        x, relevance_out = inputs("Linear"), torch.randn(2, 3, dtype=F64, generator=torch.Generator().manual_seed(2))
        what = r"'2' \(ParametrizedLinear\): .* parametrization calls in computing its weight.*remove_param"
        with pytest.raises(ValueError, match=what):
            lrp_relevance(model, x, relevance_out, PRESETS["ZPlus"]())
        nn.utils.parametrize.remove_parametrizations(model[2], "weight", leave_parametrized=True)
        actual = lrp_relevance(model, x, relevance_out, PRESETS["ZPlus"]())
        assert relative_error(actual, lrp_relevance(plain, x, relevance_out, PRESETS["ZPlus"]())) <= 1e-12


CONVOLUTIONS = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def standardised(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` standardised per output channel (a weight-standardised convolution's)."""
    dims = tuple(range(1, weight.dim()))
    mean, var = weight.mean(dims, keepdim=True), weight.var(dims, keepdim=True, unbiased=False)
    return (weight - mean) / (var + 1e-5).sqrt()


def pruned(weight: torch.Tensor) -> torch.Tensor:
    return weight * (torch.rand(weight.shape, generator=torch.Generator().manual_seed(5)) > 0.5).to(weight.dtype)


def circular_conv(self: nn.Module, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A convolution padding its input circularly by 1 on every side, then convolving it unpadded."""
    dims = len(self.kernel_size)
    convolve = (F.conv1d, F.conv2d, F.conv3d)[dims - 1]
    return convolve(F.pad(x, (1, 1) * dims, mode="circular"), weight, bias, self.stride, 0, self.dilation, self.groups)


def conv_network(dims: int, how: str, spelling: str = "subclass") -> nn.Sequential:
    """Two convolutions of ``dims`` dimensions between ReLUs and a head; with ``how`` (``standardise``, ``mask``,
    ``circular``) each has a ``_conv_forward`` of its own, by ``spelling`` (its class's, or set on the instance), and
    with ``how`` of ``plain-...`` each is the plain convolution computing as that one does."""
    base = CONVOLUTIONS[dims]
    change = {"standardise": standardised, "mask": pruned, "circular": lambda w: w}[how.removeprefix("plain-")]

    def conv_forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if how == "circular":
            return circular_conv(self, x, weight, bias)
        return base._conv_forward(self, x, change(weight), bias)

    own = type(f"Own{base.__name__}", (base,), {"_conv_forward": conv_forward})
    make = base if how.startswith("plain-") or spelling == "instance" else own
    torch.manual_seed(0)
    convs = [make(3, 4, 3, padding=1), make(4, 4, 3, padding=1)]
    model = nn.Sequential(convs[0], nn.ReLU(), convs[1], nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4**dims, 3))
    model = model.double().eval()
    with torch.no_grad():
        for conv in convs:
            conv.bias.normal_()
            if how.startswith("plain-"):
                conv.weight.copy_(change(conv.weight))
                if how == "plain-circular":
                    conv.padding_mode = "circular"
                    conv._reversed_padding_repeated_twice = [1, 1] * dims
            elif spelling == "instance":
                conv._conv_forward = types.MethodType(conv_forward, conv)
    return model


class TestConvForwardOfItsOwn:
    """A convolution overriding ``_conv_forward`` alone (torch's forward kept) was explained as one with torch's:
    the rules passed their modified weights to its ``_conv_forward``, which changed them (a weight standardisation:
    30 times off under EpsilonPlus, all zero under EpsilonPlusFlat, silently). A mask or a circular padding there
    happened to be right, and stays so."""

    @pytest.mark.parametrize("preset", sorted(PRESETS))
    @pytest.mark.parametrize("spelling", ["subclass", "instance"])
    @pytest.mark.parametrize("how", ["standardise", "mask", "circular"])
    def test_a_conv2d_explains_as_the_plain_one_computing_alike(self, how: str, spelling: str, preset: str):
        self.assert_explains_as_plain(2, how, spelling, preset)

    @pytest.mark.parametrize("preset", ["EpsilonPlusFlat", "EpsilonGammaBox"])
    @pytest.mark.parametrize("dims", [1, 3])
    def test_a_conv1d_and_conv3d_with_a_standardised_weight(self, dims: int, preset: str):
        self.assert_explains_as_plain(dims, "standardise", "subclass", preset)

    @staticmethod
    def assert_explains_as_plain(dims: int, how: str, spelling: str, preset: str) -> None:
        model, plain = conv_network(dims, how, spelling), conv_network(dims, f"plain-{how}")
        x = torch.randn(2, 3, *[4] * dims, dtype=F64, generator=torch.Generator().manual_seed(1)).clamp(-2.9, 2.9)
        torch.testing.assert_close(model(x), plain(x), rtol=1e-12, atol=1e-12)
        relevance_out = torch.randn(2, 3, dtype=F64, generator=torch.Generator().manual_seed(2))
        actual = lrp_relevance(model, x, relevance_out, PRESETS[preset]())
        expected = lrp_relevance(plain, x, relevance_out, PRESETS[preset]())
        assert relative_error(actual, expected) <= 1e-10
