"""Activations inside a Linear or convolution subclass's own forward, under every kind of layer rule (float64).

The oracle is the same model with the activation written beside a plain layer (a module of its own, or a function
called in a module of its own), explained by the same preset; and, for the ε-rule, its closed form. A layer that
cannot be explained as that must be refused by name.
"""

from __future__ import annotations

import re

import pytest
import timm.layers
import torch
import torch.nn.functional as F
from torch import nn

from tdhook.attribution import CPLRP, AttnLRP, EpsilonAlpha2Beta1, EpsilonGammaBox, EpsilonPlus, UniformEpsilon
from tdhook.attribution.rules._layers import effective_parameters
from tdhook.attribution.rules.modified import AlphaBetaRule
from tests.attribution.test_lrp_layers import lrp_relevance
from tests.conftest import relative_error

F64 = torch.float64

PRESETS = {
    "EpsilonPlus": lambda: EpsilonPlus(),
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-3.0, 3.0),
    "UniformEpsilon": lambda: UniformEpsilon(),
    "AttnLRP": lambda: AttnLRP(),
    "AttnLRP-eps": lambda: AttnLRP(epsilon=1e-6),
    "CPLRP": lambda: CPLRP(),
    "AttnLRP-large": lambda: AttnLRP(epsilon=0.25),
}


CALLS = {
    "gate": lambda z, x: z * torch.sigmoid(x.sum(1, keepdim=True)),
    "layer_norm": lambda z, x: F.layer_norm(z, z.shape[1:]),
    "normalize": lambda z, x: F.normalize(z, dim=1),
}


def layer_calling(kind: str, call: str) -> nn.Module:
    """A Linear or Conv2d subclass whose forward gives its linear function's output ``z`` and its input ``x`` to
    ``CALLS[call]``."""
    base = nn.Linear if kind == "Linear" else nn.Conv2d

    class Layer(base):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return CALLS[call](super().forward(x), x)

    Layer.__name__ = f"{kind}Calling"
    torch.manual_seed(2)
    return (Layer(4, 4) if kind == "Linear" else Layer(4, 4, 3, padding=1)).double()


class CallingBeside(nn.Module):
    """What :func:`layer_calling` computes, with a plain layer."""

    def __init__(self, linear: nn.Linear, call: str) -> None:
        super().__init__()
        self.linear, self.call = linear, call

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return CALLS[self.call](self.linear(x), x)


def calls_beside(call: str, preset: str) -> float:
    """The relative L2 between a Linear layer making ``call`` inside and the same beside it, under ``preset``."""
    layer = layer_calling("Linear", call)
    plain = nn.Linear(4, 4).double()
    plain.load_state_dict(layer.state_dict())
    model, reference = models(layer, [CallingBeside(plain, call)], "Linear")
    x, relevance_out = inputs("Linear")
    actual = lrp_relevance(model, x, relevance_out, PRESETS[preset]())
    return relative_error(actual, lrp_relevance(reference, x, relevance_out, PRESETS[preset]()))


def _leaky(z: torch.Tensor) -> torch.Tensor:
    return F.leaky_relu(z, 0.1)


def _clip(z: torch.Tensor) -> torch.Tensor:
    return F.hardtanh(z, -0.2, 0.2)


def _straight_through(z: torch.Tensor) -> torch.Tensor:
    """Rounded values, with the identity's gradient."""
    return z + (torch.round(z) - z).detach()


class StraightThrough(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return _straight_through(z)


ACTIVATIONS = {
    "gelu": (F.gelu, nn.GELU),
    "tanh": (torch.tanh, nn.Tanh),
    "silu": (F.silu, nn.SiLU),
    "sigmoid": (torch.sigmoid, nn.Sigmoid),
    "clip": (_clip, lambda: nn.Hardtanh(-0.2, 0.2)),
    "leaky": (_leaky, lambda: nn.LeakyReLU(0.1)),
    "relu": (torch.relu, nn.ReLU),
    "max_pool": (lambda z: F.max_pool2d(z, 2), lambda: nn.MaxPool2d(2)),
    "ste": (_straight_through, StraightThrough),
}


def layer_with(kind: str, activation: str, where: str, base: type | None = None, **options) -> nn.Module:
    """A subclass of ``base`` (nn.Linear or nn.Conv2d by ``kind``) whose forward runs ``activation`` before or after
    its linear function."""
    function = ACTIVATIONS[activation][0]
    base = base or (nn.Linear if kind == "Linear" else nn.Conv2d)

    class Layer(base):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(function(x)) if where == "before" else function(super().forward(x))

    Layer.__name__ = f"{base.__name__}{activation.title()}{where.title()}"
    torch.manual_seed(2)
    return (Layer(4, 4, **options) if kind == "Linear" else Layer(4, 4, 3, padding=1, **options)).double()


def plain_twin(layer: nn.Module, kind: str) -> nn.Module:
    """A plain layer that computes what ``layer``'s linear function computes (its effective weight and bias)."""
    plain = (nn.Linear(4, 4) if kind == "Linear" else nn.Conv2d(4, 4, 3, padding=1)).double()
    with torch.no_grad():
        for name, value in effective_parameters(layer).items():
            getattr(plain, name).copy_(value)
    return plain


def models(layer: nn.Module, beside: list[nn.Module], kind: str, flat: int = 64) -> tuple[nn.Sequential, nn.Sequential]:
    """The model with ``layer``, and the reference with the modules ``beside`` in its place."""
    torch.manual_seed(3)
    first = (nn.Linear(3, 4) if kind == "Linear" else nn.Conv2d(3, 4, 3, padding=1)).double()
    head = [nn.Flatten(), nn.Linear(4 if kind == "Linear" else flat, 3).double()]
    return nn.Sequential(first, nn.ReLU(), layer, *head).eval(), nn.Sequential(first, nn.ReLU(), *beside, *head).eval()


def inputs(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(4)
    x = torch.randn(2, 3, dtype=F64) if kind == "Linear" else torch.randn(2, 3, 4, 4, dtype=F64)
    return x, torch.randn(2, 3, dtype=F64)


def explained_beside(kind: str, activation: str, where: str, preset: str, **options) -> tuple[float, str]:
    """The relative L2 between the layer with ``activation`` inside and the same beside it, under ``preset``."""
    layer = layer_with(kind, activation, where, **options)
    plain = nn.Linear(4, 4).double() if kind == "Linear" else nn.Conv2d(4, 4, 3, padding=1).double()
    plain.load_state_dict(layer.state_dict())
    module = ACTIVATIONS[activation][1]()
    flat = 16 if activation == "max_pool" else 64
    model, reference = models(layer, [module, plain] if where == "before" else [plain, module], kind, flat)
    x, relevance_out = inputs(kind)
    torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
    actual = lrp_relevance(model, x, relevance_out, PRESETS[preset]())
    return relative_error(actual, lrp_relevance(reference, x, relevance_out, PRESETS[preset]())), type(layer).__name__


class TestTransformerPresets:
    """AttnLRP and CP-LRP at their default ε map Linear layers to the plain gradient (IgnoreRule), which checks
    nothing, and paused their function rules inside a layer with a forward of its own: an activation or a clip
    there kept its plain gradient in place of the identity rule it gets beside the layer (relative L2, float64:
    GELU 0.29 to 0.42, tanh 0.46 to 0.64, SiLU 0.27 to 0.38, sigmoid 0.73 to 0.97, a clip 1.1 under AttnLRP,
    CP-LRP and AttnLRP(epsilon=1e-6); a sigmoid gate 1.7), silently. The calls inside now get the function rules
    they get beside the layer."""

    @pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP"])
    @pytest.mark.parametrize("where", ["after", "before"])
    @pytest.mark.parametrize("activation", ["gelu", "tanh", "silu", "sigmoid", "clip"])
    def test_an_activation_inside_a_linear_layer_explains_as_one_beside_it(self, activation, where, preset):
        error, _ = explained_beside("Linear", activation, where, preset)
        assert error <= 1e-12

    @pytest.mark.parametrize("activation", ["gelu", "tanh"])
    def test_an_activation_inside_a_convolution_explains_as_one_beside_it(self, activation: str):
        error, _ = explained_beside("Conv2d", activation, "after", "AttnLRP")
        assert error <= 1e-12

    @pytest.mark.parametrize("where", ["after", "before"])
    def test_a_clip_inside_an_epsilon_layer_is_passed_as_a_hardtanh_beside_it(self, where: str):
        error, _ = explained_beside("Linear", "clip", where, "AttnLRP-eps")
        # ε = 1e-6 on the clipped output against ε on the linear output: differences of that order.
        assert error <= 1e-5

    @pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP", "AttnLRP-eps"])
    def test_a_gate_inside_a_linear_layer_is_held_as_one_beside_it(self, preset: str):
        # AttnLRP(epsilon=1e-6): ε on the gated output against ε on the linear output, differences of that order.
        assert calls_beside("gate", preset) <= (1e-4 if preset == "AttnLRP-eps" else 1e-12)

    def test_an_activation_the_epsilon_rule_would_run_through_is_still_refused(self):
        # Under AttnLRP's ε-rule the layer's gradient runs through the forward: a GELU inside stays refused by name.
        with pytest.raises(ValueError, match=r"module '2' \(LinearGeluAfter\): LinearGeluAfter: its forward runs"):
            explained_beside("Linear", "gelu", "after", "AttnLRP-eps")


class TestSlopesUnderALargeEpsilon:
    """A leaky ReLU after the linear function is positively homogeneous, so the ε-rule's ray probes (x and 2x) did not
    see it, but the ε-rule on the layer stabilises its output (a tenth of the linear output where that is negative)
    in place of the linear output: 0.029 relative L2 on a Linear, 0.053 on timm's StdConv2d and 0.058 on
    ScaledStdConv2d under UniformEpsilon (ε = 0.25), against the activation beside the layer, silently. It is refused
    above the ε the function rules tolerate; a ReLU (slopes 0 and 1), a max pooling, and any of them before the
    linear function explain as beside the layer."""

    @pytest.mark.parametrize(
        ("kind", "base"),
        [("Linear", None), ("Conv2d", None), ("Conv2d", timm.layers.StdConv2d)],
        ids=["Linear", "Conv2d", "StdConv2d"],
    )
    def test_a_leaky_relu_after_the_linear_function_is_refused_by_name(self, kind: str, base):
        layer = layer_with(kind, "leaky", "after", base=base)
        model, _ = models(layer, [], kind)
        x, relevance_out = inputs(kind)
        name = type(layer).__name__
        with pytest.raises(ValueError, match=rf"module '2' \({name}\): {name}: its forward runs, after its linear"):
            lrp_relevance(model, x, relevance_out, UniformEpsilon())

    @pytest.mark.parametrize("preset", ["UniformEpsilon", "AttnLRP-large"])
    @pytest.mark.parametrize(
        ("activation", "where", "kind"),
        [
            ("relu", "after", "Linear"),
            ("relu", "before", "Linear"),
            ("leaky", "before", "Linear"),
            ("leaky", "before", "Conv2d"),
            ("max_pool", "after", "Conv2d"),
        ],
    )
    def test_slopes_the_epsilon_rule_explains_as_beside_the_layer(self, activation, where, kind, preset):
        error, _ = explained_beside(kind, activation, where, preset)
        assert error <= 1e-10  # the same quotients, in another order

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "AttnLRP-eps"])
    def test_a_leaky_relu_after_the_linear_function_under_a_small_epsilon_differs_by_its_order(self, preset: str):
        error, _ = explained_beside("Linear", "leaky", "after", preset)
        assert error <= 1e-4

    def test_a_leaky_relu_before_the_linear_function_gives_the_epsilon_rules_closed_form(self):
        # R_x = a(x) ⊙ Wᵀ (R / stabilize(W a(x) + b, ε)), with a the leaky ReLU (x a'(x) = a(x)).
        layer = layer_with("Linear", "leaky", "before")
        model = nn.Sequential(nn.Identity(), nn.Identity(), layer).eval()
        torch.manual_seed(5)
        x = torch.randn(2, 4, dtype=F64)
        relevance_out = torch.randn(2, 4, dtype=F64)
        z = F.linear(_leaky(x), layer.weight, layer.bias)
        stabilised = z + 0.25 * torch.where(z >= 0, 1.0, -1.0)
        expected = _leaky(x) * ((relevance_out / stabilised) @ layer.weight)
        assert relative_error(lrp_relevance(model, x, relevance_out, UniformEpsilon()), expected) <= 1e-12


class TestWeightStandardisedLayers:
    """timm's weight-standardised convolutions normalise their weight with ``F.batch_norm``, which the layer check
    took for a norm of the input the function rules follow, and so checked nothing else in the forward: a tanh
    after the convolution gave 0.67 (EpsilonPlus), 0.81 (EpsilonGammaBox) and 0.62 (UniformEpsilon) relative L2
    on StdConv2d, 0.14 to 0.30 on ScaledStdConv2d, against a tanh beside a plain convolution with the effective
    weight, silently. The norm of the weight no longer counts; timm's own layers are explained as that plain one."""

    BASES = {"StdConv2d": timm.layers.StdConv2d, "ScaledStdConv2d": timm.layers.ScaledStdConv2d}

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox", "UniformEpsilon"])
    @pytest.mark.parametrize("base", sorted(BASES))
    def test_a_tanh_inside_a_weight_standardised_convolution_is_refused_by_name(self, base: str, preset: str):
        layer = layer_with("Conv2d", "tanh", "after", base=self.BASES[base], bias=True, eps=1e-5)
        model, _ = models(layer, [], "Conv2d")
        x, relevance_out = inputs("Conv2d")
        name = type(layer).__name__
        with pytest.raises(ValueError, match=rf"module '2' \({name}\): {name}: its forward runs an activation that"):
            lrp_relevance(model, x, relevance_out, PRESETS[preset]())

    @pytest.mark.parametrize("preset", ["AttnLRP", "CPLRP"])
    @pytest.mark.parametrize("base", sorted(BASES))
    def test_a_tanh_inside_under_the_transformer_presets_explains_as_one_beside(self, base: str, preset: str):
        layer = layer_with("Conv2d", "tanh", "after", base=self.BASES[base], bias=True, eps=1e-5)
        own = self.BASES[base](4, 4, 3, padding=1, bias=True, eps=1e-5).double()
        own.load_state_dict(layer.state_dict())
        model, reference = models(layer, [plain_twin(own, "Conv2d"), nn.Tanh()], "Conv2d")
        x, relevance_out = inputs("Conv2d")
        torch.testing.assert_close(model(x), reference(x))
        actual = lrp_relevance(model, x, relevance_out, PRESETS[preset]())
        assert relative_error(actual, lrp_relevance(reference, x, relevance_out, PRESETS[preset]())) <= 1e-9

    @pytest.mark.parametrize("preset", sorted(PRESETS))
    @pytest.mark.parametrize("base", sorted(BASES))
    def test_timms_own_layers_explain_as_a_plain_convolution(self, base: str, preset: str):
        torch.manual_seed(2)
        layer = self.BASES[base](4, 4, 3, padding=1, bias=True, eps=1e-5).double()
        model, reference = models(layer, [plain_twin(layer, "Conv2d")], "Conv2d")
        x, relevance_out = inputs("Conv2d")
        torch.testing.assert_close(model(x), reference(x))
        actual = lrp_relevance(model, x, relevance_out, PRESETS[preset]())
        assert relative_error(actual, lrp_relevance(reference, x, relevance_out, PRESETS[preset]())) <= 1e-9


class TestFunctionRulesUnderALargeEpsilon:
    """A gate or a norm inside a layer is the function rules' to follow, which is the ε-rule's only where ε is small:
    above :data:`~tdhook.attribution.rules._layers.RULED_EPSILON` it stabilises their output in place of the linear
    function's (under UniformEpsilon's 0.25, relative L2 against the same beside a plain layer: a sigmoid gate 0.07
    on a Linear and 0.21 on a convolution, a layer norm 0.30 and 0.81, F.normalize 0.05 and 0.69, a group norm
    0.80), silently. They are refused by name, as a clip and a softmax are; under a small ε they explain as beside."""

    @pytest.mark.parametrize("kind", ["Linear", "Conv2d"])
    @pytest.mark.parametrize("call", sorted(CALLS))
    def test_a_gate_or_norm_inside_a_layer_under_a_large_epsilon_is_refused_by_name(self, call: str, kind: str):
        model, _ = models(layer_calling(kind, call), [], kind)
        x, relevance_out = inputs(kind)
        with pytest.raises(ValueError, match=rf"module '2' \({kind}Calling\): {kind}Calling: its forward runs an"):
            lrp_relevance(model, x, relevance_out, UniformEpsilon())

    @pytest.mark.parametrize(
        ("call", "preset"),
        [("gate", "EpsilonPlus"), ("normalize", "EpsilonPlus")] + [(call, "AttnLRP-eps") for call in sorted(CALLS)],
    )
    def test_a_gate_or_norm_inside_a_linear_layer_under_a_small_epsilon_explains_as_beside(self, call, preset):
        # ε = 1e-6 on the call's output against ε on the linear output: differences of that order.
        assert calls_beside(call, preset) <= 1e-4


class TestNormsTheCNNPresetsDoNotHold:
    """The CNN presets' function rules hold ``F.normalize`` and ``F.cosine_similarity`` and no other norm: a layer
    norm inside a Linear layer under EpsilonPlus (ε = 1e-6, under which the layer check leaves the norms to the
    function rules) kept its plain gradient. A bias-free layer followed by a layer norm is of degree 0 in its
    input, so that gradient × input sums to about 0 (1e-4 of the output's relevance, where the norm's rule beside
    the layer conserves it; 0.13 to 1.7 relative L2 against it), silently. It is refused by name; the transformer
    presets, whose function rules hold it, explain it as beside (above)."""

    @staticmethod
    def layer_norm_inside() -> tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
        layer = layer_calling("Linear", "layer_norm")
        with torch.no_grad():
            layer.bias.zero_()
        torch.manual_seed(4)
        return nn.Sequential(nn.Identity(), layer).eval(), torch.randn(5, 4, dtype=F64), torch.randn(5, 4, dtype=F64)

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox"])
    def test_a_layer_norm_inside_a_linear_layer_under_a_cnn_preset_is_refused_by_name(self, preset: str):
        model, x, relevance_out = self.layer_norm_inside()
        with pytest.raises(ValueError, match=r"module '1' \(LinearCalling\): LinearCalling: its forward runs an"):
            lrp_relevance(model, x, relevance_out, PRESETS[preset]())

    def test_under_attnlrp_with_an_epsilon_the_layer_norm_inside_conserves_relevance(self):
        model, x, relevance_out = self.layer_norm_inside()
        relevance = lrp_relevance(model, x, relevance_out, PRESETS["AttnLRP-eps"]())
        # The layer norm's rule holds the scale: the relevance of the output, up to the ε-rule's ε.
        torch.testing.assert_close(relevance.sum(1), relevance_out.sum(1), rtol=1e-3, atol=1e-5)


# The rules that rewrite a layer's backward from its weight (z⁺, αβ, γ), with the ε-rule beside them.
MODIFIED = {
    "EpsilonPlus": lambda: EpsilonPlus(),
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-3.0, 3.0),
    "EpsilonAlpha2Beta1": lambda: EpsilonAlpha2Beta1(),
    "ZPlus": lambda: {nn.Linear: AlphaBetaRule(1.0, 0.0), nn.Conv2d: AlphaBetaRule(1.0, 0.0)},
    "UniformEpsilon": lambda: UniformEpsilon(),
}


class TestCallsInsideUnderTheModifiedPasses:
    """The modified passes (z⁺, αβ, γ) run the layer's own forward with their weights: a gate, a product or a norm
    there was left to function rules that do not act inside them, and the passes ran through it. Against the same
    call beside a plain convolution (relative L2, float64): a sigmoid gate 0.15 to 0.46, ``F.normalize`` 0.41 to
    0.82, a layer norm 0.96 to 16 under EpsilonPlus, EpsilonGammaBox, EpsilonAlpha2Beta1 and z⁺, silently. They are
    refused by name, and the call named; a fused linear layer (QAT's ConvBn2d in eval, weight standardisation,
    weight and spectral norm: see test_layers.py) is not."""

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox", "EpsilonAlpha2Beta1", "ZPlus"])
    @pytest.mark.parametrize(
        ("call", "named"), [("gate", "torch.mul"), ("layer_norm", "F.layer_norm"), ("normalize", "F.normalize")]
    )
    def test_a_gate_or_norm_inside_a_convolution_is_refused_by_name(self, call: str, named: str, preset: str):
        model, _ = models(layer_calling("Conv2d", call), [], "Conv2d")
        x, relevance_out = inputs("Conv2d")
        what = rf"module '2' \(Conv2dCalling\): Conv2dCalling: its forward runs an .* \(it calls {re.escape(named)},"
        with pytest.raises(ValueError, match=what):
            lrp_relevance(model, x, relevance_out, MODIFIED[preset]())

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox"])
    def test_a_gate_of_the_input_before_a_convolution_is_refused_by_name(self, preset: str):
        class GatedInput(nn.Conv2d):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return super().forward(x * torch.sigmoid(x.sum(1, keepdim=True)))

        torch.manual_seed(2)
        model, _ = models(GatedInput(4, 4, 3, padding=1).double(), [], "Conv2d")
        x, relevance_out = inputs("Conv2d")
        with pytest.raises(
            ValueError, match=r"module '2' \(GatedInput\): GatedInput: its forward runs an .* torch.mul"
        ):
            lrp_relevance(model, x, relevance_out, MODIFIED[preset]())


class TestStraightThroughEstimators:
    """A straight-through estimator after the linear function (``z + (round(z) - z).detach()``) has the identity's
    gradient, which the layer checks took for a linear map, and other values, which the layer rules took for the
    linear function's output (its ``z`` in ``R / z``, the modified passes' ``z⁺``). Against the estimator as a module
    beside a plain layer (relative L2, float64): 0.34 (Linear) and 1.0 (Conv2d) under UniformEpsilon, 1.0 under z⁺,
    1.0 to 1.9 under EpsilonPlus and EpsilonGammaBox, silently. It is refused by name; one of the input, before the
    linear function, is the layer's and explains as beside it."""

    @pytest.mark.parametrize("preset", ["UniformEpsilon", "EpsilonPlus", "EpsilonGammaBox", "ZPlus"])
    @pytest.mark.parametrize("kind", ["Linear", "Conv2d"])
    def test_an_estimator_after_the_linear_function_is_refused_by_name(self, kind: str, preset: str):
        layer = layer_with(kind, "ste", "after")
        model, _ = models(layer, [], kind)
        x, relevance_out = inputs(kind)
        name = type(layer).__name__
        with pytest.raises(ValueError, match=rf"module '2' \({name}\): {name}: its forward gives, after its linear"):
            lrp_relevance(model, x, relevance_out, MODIFIED[preset]())

    @pytest.mark.filterwarnings("ignore:LRP.*adds a detached difference back:UserWarning")  # the one beside
    @pytest.mark.parametrize("preset", ["UniformEpsilon", "EpsilonPlus", "EpsilonGammaBox", "ZPlus"])
    @pytest.mark.parametrize("kind", ["Linear", "Conv2d"])
    def test_an_estimator_before_the_linear_function_explains_as_one_beside(self, kind: str, preset: str):
        layer = layer_with(kind, "ste", "before")
        plain = nn.Linear(4, 4).double() if kind == "Linear" else nn.Conv2d(4, 4, 3, padding=1).double()
        plain.load_state_dict(layer.state_dict())
        model, reference = models(layer, [StraightThrough(), plain], kind)
        x, relevance_out = inputs(kind)
        x = 3 * x  # inputs the estimator rounds to several values
        torch.testing.assert_close(model(x), reference(x), rtol=0, atol=0)
        actual = lrp_relevance(model, x, relevance_out, MODIFIED[preset]())
        assert relative_error(actual, lrp_relevance(reference, x, relevance_out, MODIFIED[preset]())) <= 1e-12

    @pytest.mark.parametrize("preset", ["UniformEpsilon", "EpsilonPlus"])
    def test_a_large_shift_after_the_linear_function_in_float32_is_no_estimator(self, preset: str):
        # Its values are on a line, rounded at the shift's size: 300 + Wx at inputs of 1e-3 is off by 1e-5 of Wx.
        class Shifted(nn.Linear):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return super().forward(x) + 300.0

        torch.manual_seed(2)
        layer = Shifted(4, 4)
        plain = nn.Linear(4, 4)
        with torch.no_grad():
            plain.weight.copy_(layer.weight)
            plain.bias.copy_(layer.bias + 300.0)
        model, reference = (m.float() for m in models(layer, [plain], "Linear"))
        x, relevance_out = (t.float() for t in inputs("Linear"))
        actual = lrp_relevance(model, x, relevance_out, MODIFIED[preset]())
        assert relative_error(actual, lrp_relevance(reference, x, relevance_out, MODIFIED[preset]())) <= 1e-5


class LowRankAdapted(nn.Linear):
    """A Linear layer with a low-rank branch in its forward (three linear functions): affine in its input."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.down, self.up = nn.Parameter(torch.randn(2, 4)), nn.Parameter(torch.randn(4, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.5 * F.linear(F.linear(x, self.down), self.up)

    def merged(self) -> torch.Tensor:
        return self.weight + 0.5 * self.up @ self.down


class ZeroBiased(nn.Linear):
    """A Linear layer whose forward passes its linear function a bias of zeros."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, torch.zeros(self.out_features, dtype=x.dtype))

    def merged(self) -> torch.Tensor:
        return self.weight


class TiedTwice(nn.Linear):
    """A Linear layer that runs its weight and then its transpose (an autoencoder's tied weights): ``WᵀW x + b``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.weight), self.weight.t(), self.bias)

    def merged(self) -> torch.Tensor:
        return self.weight.t() @ self.weight


class TestAffineLayerSubclassesAreNotRefused:
    """Linear subclasses whose forward is affine in its input, though not one call of ``F.linear`` with the layer's
    own parameters, pass the checks of a gate, a norm or an estimator inside a layer under the presets' rules for
    Linear layers, and explain as the plain Linear layer with the weight they compute with (1e-16 relative L2,
    float64). A modified pass (z⁺) gives its weight to the first linear function alone: a second linear function of
    the input (a low-rank branch, tied weights) would stay unmodified, and is refused by name."""

    @pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonGammaBox", "EpsilonAlpha2Beta1", "UniformEpsilon"])
    @pytest.mark.parametrize("layer_class", [LowRankAdapted, ZeroBiased, TiedTwice])
    def test_explains_as_the_plain_layer_with_its_weight(self, layer_class: type, preset: str):
        explains_as_the_plain_layer(layer_class, preset)

    def test_a_zero_bias_passes_the_modified_passes_checks(self):
        explains_as_the_plain_layer(ZeroBiased, "ZPlus")

    @pytest.mark.parametrize("layer_class", [LowRankAdapted, TiedTwice])
    def test_a_second_linear_function_of_the_input_is_refused_by_name_under_z_plus(self, layer_class: type):
        with pytest.raises(ValueError, match=rf"module '2' \({layer_class.__name__}\): {layer_class.__name__}: its"):
            explains_as_the_plain_layer(layer_class, "ZPlus")


def explains_as_the_plain_layer(layer_class: type, preset: str) -> None:
    """Assert that the layer of ``layer_class`` explains under ``preset`` as a plain Linear layer with its weight."""
    torch.manual_seed(2)
    layer = layer_class(4, 4) if layer_class is not LowRankAdapted else layer_class()
    layer = layer.double()
    plain = nn.Linear(4, 4).double()
    with torch.no_grad():
        plain.weight.copy_(layer.merged())
        plain.bias.copy_(layer.bias if layer_class is not ZeroBiased else torch.zeros(4))
    model, reference = models(layer, [plain], "Linear")
    x, relevance_out = inputs("Linear")
    torch.testing.assert_close(model(x), reference(x))
    actual = lrp_relevance(model, x, relevance_out, MODIFIED[preset]())
    assert relative_error(actual, lrp_relevance(reference, x, relevance_out, MODIFIED[preset]())) <= 1e-12
