"""The rules with a modified forward pass (αβ, z⁺, γ) against zennit's counterparts, in float64."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn
from zennit import rules as zrules

from tdhook.attribution import LRP
from tdhook.attribution.rules.modified import AlphaBetaRule, GammaRule
from tests.attribution.rules import _helpers as rule_checks
from tests.attribution.rules._helpers import LAYERS, TOL, make_layer, output_relevance, spy
from tests.attribution.rules._helpers import RULE_PAIRS as ALL_RULE_PAIRS
from tests.conftest import relative_error, tdhook_relevance, zennit_relevance

RULE_PAIRS = {name: ALL_RULE_PAIRS[name] for name in ("zplus", "alpha2beta1", "alpha1beta0", "gamma", "gamma-nobias")}


class TestAgainstZennit:
    @pytest.mark.parametrize("kind", LAYERS)
    @pytest.mark.parametrize("rule_name", sorted(RULE_PAIRS))
    def test_rule_matches_zennit(self, rule_name: str, kind: str):
        rule_checks.assert_rule_matches_zennit(rule_name, kind)

    @pytest.mark.parametrize("kind", LAYERS)
    @pytest.mark.parametrize("rule_name", ["gamma", "gamma-nobias", "zplus", "alpha2beta1"])
    def test_rule_matches_zennit_on_nonnegative_inputs(self, rule_name: str, kind: str):
        """Inputs after a ReLU: the rules skip the x⁻ pass, and γ computes its transposed products directly."""
        ours, theirs = RULE_PAIRS[rule_name]
        layer, x = make_layer(kind)
        x = x.clamp(min=0)
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(theirs(), layer, x, r_out)
        assert relative_error(tdhook_relevance(ours(), layer, x, r_out), expected) <= TOL

    @pytest.mark.parametrize(
        "layer,shape",
        [
            (nn.Linear(5, 3), (2, 4, 5)),  # a sequence: the bias broadcasts over the last dimension
            (nn.Conv2d(3, 4, 3, padding="same"), (2, 3, 5, 5)),
            (nn.Conv2d(3, 4, 3, padding=1, padding_mode="reflect"), (2, 3, 5, 5)),
        ],
        ids=["linear-sequence", "conv-same", "conv-reflect"],
    )
    def test_gamma_on_nonnegative_inputs_of_other_layouts(self, layer: nn.Module, shape: tuple):
        layer = layer.double()
        with torch.no_grad():
            layer.bias.normal_()
        x = torch.randn(shape, dtype=torch.float64).clamp(min=0)
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(zrules.Gamma(0.25), layer, x, r_out)
        assert relative_error(tdhook_relevance(GammaRule(0.25), layer, x, r_out), expected) <= TOL


class TestFastPaths:
    """The paths that skip autograd or a product, each checked against zennit and shown to be taken."""

    @pytest.mark.parametrize("kind", LAYERS)
    @pytest.mark.parametrize("rule_name", ["zplus", "alpha2beta1"])
    def test_alpha_beta_on_signed_inputs_takes_the_direct_path_and_matches_zennit(self, rule_name, kind, monkeypatch):
        taken = spy(monkeypatch, AlphaBetaRule, "_signed_input_gradient")
        ours, theirs = RULE_PAIRS[rule_name]
        layer, x = make_layer(kind)
        r_out = output_relevance(layer, x)
        assert (
            relative_error(tdhook_relevance(ours(), layer, x, r_out), zennit_relevance(theirs(), layer, x, r_out))
            <= TOL
        )
        assert taken

    @pytest.mark.parametrize(("alpha", "beta"), [(1.0, 0.0), (2.0, 1.0), (1.5, 0.5)])
    def test_alpha_beta_gradient_at_zero_inputs_is_that_of_both_clamps(self, alpha, beta):
        """Where ``x = 0`` neither ``x⁺`` nor ``x⁻`` passes gradient (torch's clamp passes none at its bound): the
        direct path sends on 0 there, as autograd through the two clamps does, not ``w⁺ᵀ s`` or ``w⁻ᵀ s``."""
        torch.manual_seed(0)
        conv = nn.Conv2d(3, 4, 3, padding=1).double()
        x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
        x[:, :, 1:3, 1:4] = 0.0
        seed = torch.randn(2, 4, 5, 5, dtype=torch.float64)
        leaf = x.clone().requires_grad_(True)
        with AlphaBetaRule(alpha=alpha, beta=beta).register(conv):
            (ours,) = torch.autograd.grad(conv(leaf), leaf, seed)
        weight, bias = conv.weight.detach(), conv.bias.detach()
        leaf = x.clone().requires_grad_(True)
        up, down = leaf.clamp(min=0), leaf.clamp(max=0)

        def signed(w_up, b_up, w_down):
            return nn.functional.conv2d(up, w_up, b_up, padding=1) + nn.functional.conv2d(down, w_down, None, padding=1)

        z_plus = signed(weight.clamp(min=0), bias.clamp(min=0), weight.clamp(max=0))
        z_minus = signed(weight.clamp(max=0), bias.clamp(max=0), weight.clamp(min=0))
        z = nn.functional.conv2d(x, weight, bias, padding=1)
        shares = (alpha * seed * z / (z_plus.detach() + 1e-6), -beta * seed * z / (z_minus.detach() - 1e-6))
        (expected,) = torch.autograd.grad((z_plus, z_minus), leaf, shares)
        assert (expected[x == 0] == 0).all() and (expected[x != 0] != 0).all()
        torch.testing.assert_close(ours, expected, rtol=1e-10, atol=1e-12)

    @pytest.mark.parametrize("kind", LAYERS)
    @pytest.mark.parametrize("rule_name", ["gamma", "gamma-nobias"])
    def test_gamma_without_relevance_on_negative_outputs_matches_zennit(self, rule_name, kind, monkeypatch):
        # After a ReLU no relevance reaches a negative output: one transposed product suffices.
        taken = spy(monkeypatch, GammaRule, "_positive_outputs_gradient")
        ours, theirs = RULE_PAIRS[rule_name]
        layer, x = make_layer(kind)
        x = x.clamp(min=0)
        with torch.no_grad():
            r_out = output_relevance(layer, x) * (layer(x) > 0)
        expected = zennit_relevance(theirs(), layer, x, r_out)
        assert relative_error(tdhook_relevance(ours(), layer, x, r_out), expected) <= TOL
        assert taken

    @pytest.mark.parametrize("rule_name", ["gamma", "gamma-nobias"])
    def test_gamma_with_relevance_on_negative_outputs_takes_both_products(self, rule_name, monkeypatch):
        one_product = spy(monkeypatch, GammaRule, "_positive_outputs_gradient")
        two_products = spy(monkeypatch, GammaRule, "_nonnegative_input_gradient")
        ours, theirs = RULE_PAIRS[rule_name]
        layer, x = make_layer("conv2d")
        x = x.clamp(min=0)
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(theirs(), layer, x, r_out)
        assert relative_error(tdhook_relevance(ours(), layer, x, r_out), expected) <= TOL
        assert not one_product
        # A zeroed bias can make D = γW⁺x − b negative: the signs of z^↑ and z^↓ are then unknown (autograd path).
        assert bool(two_products) == (rule_name == "gamma")

    @pytest.mark.parametrize("kind", ["linear", "conv2d"])
    def test_gamma_without_bias_on_a_layer_whose_biases_are_all_negative_matches_zennit(self, kind):
        # With every bias ≤ 0 the shift D = γW⁺x − b is ≥ 0, but with zeroed biases z^↓ is not (1 + γ)z − D: the
        # two-product path does not hold. A one-output head after a ReLU or a sigmoid was 100 % off.
        ours, theirs = RULE_PAIRS["gamma-nobias"]
        layer, x = make_layer(kind)
        with torch.no_grad():
            layer.bias.copy_(-layer.bias.abs())
        x = x.clamp(min=0)
        r_out = output_relevance(layer, x)  # relevance on negative outputs too
        expected = zennit_relevance(theirs(), layer, x, r_out)
        assert relative_error(tdhook_relevance(ours(), layer, x, r_out), expected) <= TOL

    @pytest.mark.parametrize("rule_name", ["zplus", "gamma"])
    def test_an_expanded_output_gradient_gives_the_contiguous_result(self, rule_name):
        rule_checks.assert_an_expanded_output_gradient_gives_the_contiguous_result(rule_name)

    @pytest.mark.parametrize("rule_name", ["zplus", "gamma"])
    @pytest.mark.parametrize("kind", ["linear", "conv2d"])
    def test_an_unbatched_input_gives_the_batched_result(self, rule_name, kind):
        rule_checks.assert_an_unbatched_input_gives_the_batched_result(rule_name, kind)

    @pytest.mark.parametrize("rule_name", ["zplus", "gamma", "gamma-positive-outputs"])
    def test_repeated_backward_over_one_forward_gives_the_same_gradient(self, rule_name):
        rule_checks.assert_repeated_backward_over_one_forward_gives_the_same_gradient(rule_name)

    @pytest.mark.parametrize("rule_name", ["zplus", "alpha2beta1", "gamma-after-relu"])
    def test_vectorized_jacobian_equals_the_unit_by_unit_one(self, rule_name):
        rule_checks.assert_vectorized_jacobian_equals_the_unit_by_unit_one(rule_name)

    @pytest.mark.parametrize("rule_name", ["zplus", "gamma"])
    def test_transposed_convolution_with_output_padding_past_the_stride_matches_zennit(self, rule_name):
        rule_checks.assert_transposed_convolution_with_output_padding_past_the_stride_matches_zennit(rule_name)


# Layer options users set that change which inputs an output reads: groups, dilation, strides past the kernel,
# 'same' padding, padding modes that copy the input, transposed convolutions with output padding, Linear on sequences.
CONFIGURATIONS = {
    "conv1d-groups-same-even-kernel": (lambda: nn.Conv1d(4, 6, 4, groups=2, padding="same"), (2, 4, 9)),
    "conv2d-depthwise-no-bias": (lambda: nn.Conv2d(4, 8, 3, groups=4, padding=1, bias=False), (2, 4, 6, 6)),
    "conv2d-dilation-stride-past-kernel": (lambda: nn.Conv2d(3, 4, 2, stride=3, dilation=2), (2, 3, 9, 9)),
    "conv2d-reflect": (lambda: nn.Conv2d(3, 4, 3, padding=(1, 2), padding_mode="reflect"), (2, 3, 6, 6)),
    "conv2d-replicate-stride": (
        lambda: nn.Conv2d(3, 4, 3, stride=2, padding=2, padding_mode="replicate"),
        (2, 3, 7, 7),
    ),
    "conv1d-circular": (lambda: nn.Conv1d(3, 4, 3, padding=1, padding_mode="circular"), (2, 3, 7)),
    "conv3d-groups-dilation": (lambda: nn.Conv3d(4, 4, 2, groups=2, dilation=2, stride=2), (2, 4, 5, 5, 5)),
    "convtranspose1d-output-padding": (lambda: nn.ConvTranspose1d(3, 4, 3, stride=2, output_padding=1), (2, 3, 5)),
    "convtranspose2d-groups-dilation": (
        lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, dilation=2, padding=1, output_padding=1),
        (2, 4, 4, 4),
    ),
    "linear-on-a-sequence": (lambda: nn.Linear(6, 5), (2, 3, 4, 6)),
}


class TestLayerConfigurations:
    @pytest.mark.parametrize("kind", sorted(CONFIGURATIONS))
    @pytest.mark.parametrize("rule_name", sorted(ALL_RULE_PAIRS))
    def test_rule_matches_zennit(self, rule_name: str, kind: str):
        make, shape = CONFIGURATIONS[kind]
        layer = make().double()
        if layer.bias is not None:
            with torch.no_grad():
                layer.bias.normal_()
        x = torch.randn(shape, dtype=torch.float64).clamp(-2.4, 2.4)  # inside the ZBox bounds
        r_out = output_relevance(layer, x)
        ours, theirs = ALL_RULE_PAIRS[rule_name]
        expected = zennit_relevance(theirs(), layer, x, r_out)
        assert relative_error(tdhook_relevance(ours(), layer, x, r_out), expected) <= TOL


class _UpsampledTo(nn.Module):
    """A transposed convolution called with ``output_size`` (a U-Net's decoder matching its skip connection), by
    keyword or as the second argument."""

    def __init__(self, layer: nn.Module, *sizes: tuple[int, ...], positional: bool = False) -> None:
        super().__init__()
        self.layer, self.sizes, self.positional = layer, sizes, positional

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.positional:
            return torch.cat([self.layer(x, size).flatten(1) for size in self.sizes], dim=1)
        return torch.cat([self.layer(x, output_size=size).flatten(1) for size in self.sizes], dim=1)


class TestTransposedConvolutionCalledWithAnOutputSize:
    """``layer(x, output_size=...)`` chooses the output padding per call: the modified passes must use it. Given as
    the second argument (``layer(x, size)``), it was refused as a second input ("expects one tensor input")."""

    @pytest.mark.parametrize("positional", [False, True], ids=["keyword", "positional"])
    @pytest.mark.parametrize("rule_name", sorted(ALL_RULE_PAIRS))
    def test_matches_zennit_on_the_layer_with_that_output_padding(self, rule_name: str, positional: bool):
        ours, theirs = ALL_RULE_PAIRS[rule_name]
        layer = nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1).double()
        with torch.no_grad():
            layer.bias.normal_()
        x = torch.randn(2, 3, 4, 4, dtype=torch.float64).clamp(-2.4, 2.4)  # inside the ZBox bounds
        # Output sizes 7×7 (the default), 8×8 and 7×8: output paddings (0, 0), (1, 1) and (0, 1).
        model = _UpsampledTo(layer, (7, 7), (8, 8), (7, 8), positional=positional)
        r_out = output_relevance(model, x)
        rule_mapper = {nn.ConvTranspose2d: ours()}
        lrp = LRP(model, rule_mapper=rule_mapper, in_keys=["x"], out_keys=["y"], target=lambda y: r_out)
        actual = lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]
        expected, start = torch.zeros_like(x), 0
        for padding in ((0, 0), (1, 1), (0, 1)):
            padded = nn.ConvTranspose2d(3, 4, 3, stride=2, padding=1, output_padding=padding).double()
            padded.load_state_dict(layer.state_dict())
            n = 4 * (7 + padding[0]) * (7 + padding[1])
            part = r_out[:, start : start + n].reshape(2, 4, 7 + padding[0], 7 + padding[1])
            expected += zennit_relevance(theirs(), padded, x, part)
            start += n
        assert relative_error(actual, expected) <= TOL


class TestRegistration:
    def test_alpha_beta_refuses_unbalanced_parameters(self):
        with pytest.raises(ValueError, match="alpha - beta == 1"):
            AlphaBetaRule(alpha=1.0, beta=1.0)

    def test_weight_rule_on_module_without_weight_names_it(self):
        with pytest.raises(ValueError, match="ReLU has none"):
            AlphaBetaRule(1.0, 0.0).register(nn.ReLU())


class TestArguments:
    @pytest.mark.parametrize(
        ("make", "match"),
        [
            (lambda: GammaRule(gamma=-0.5), "GammaRule: gamma must be a finite number >= 0, got -0.5"),
            (lambda: GammaRule(gamma=float("nan")), "GammaRule: gamma must be a finite number"),
            (lambda: GammaRule(stabilizer=-1e-6), "GammaRule: stabilizer must be a finite number >= 0"),
            (lambda: AlphaBetaRule(3.0, 1.0), r"alpha - beta == 1 .*alpha=3.0, beta=1.0"),
            (lambda: AlphaBetaRule(0.0, -1.0), r"alpha - beta == 1 and both non-negative"),
            (lambda: AlphaBetaRule(float("inf"), float("inf")), "AlphaBetaRule: alpha must be a finite number"),
            (lambda: AlphaBetaRule(1.0, 0.0, stabilizer=-1.0), "AlphaBetaRule: stabilizer must be"),
            (lambda: AlphaBetaRule(1.0, 0.0, zero_params="bias"), "AlphaBetaRule: zero_params must be a sequence"),
        ],
    )
    def test_wrong_numbers_are_refused_at_construction(self, make, match: str):
        with pytest.raises(ValueError, match=match):
            make()

    @pytest.mark.parametrize(("alpha", "beta"), [(1.0, 0.0), (2.0, 1.0), (1, 0), (1.7, 0.7), (3.1, 2.1)])
    def test_legitimate_alpha_beta_are_accepted(self, alpha, beta):
        rule = AlphaBetaRule(alpha, beta)  # 1.7 - 0.7 is 0.9999999999999999 in floating point
        assert (rule.alpha, rule.beta) == (alpha, beta)

    @pytest.mark.parametrize("gamma", [0.0, 0.25, 100.0])
    def test_legitimate_gamma_is_accepted(self, gamma: float):
        assert GammaRule(gamma=gamma, stabilizer=0.0, zero_params=("bias",)).gamma == gamma


@pytest.mark.parametrize("signed", [False, True], ids=["rectified", "signed"])
@pytest.mark.parametrize(
    "make", [lambda s: AlphaBetaRule(1.0, 0.0, s), lambda s: AlphaBetaRule(2.0, 1.0, s), lambda s: GammaRule(0.25, s)]
)
def test_a_zero_stabilizer_gives_the_limit_of_small_ones(make, signed: bool):
    """stabilizer=0 is accepted (the presets pass it on: ``EpsilonPlus(epsilon=0.0, stabilizer=0.0)``), but an
    output whose modified contributions are all 0 (zero or rectified inputs: most layers) divided 0 by 0, and the
    relevance was NaN with no error (116 of 144 entries here under z⁺). Those outputs pass nothing on: the limit of
    small stabilizers, which is finite."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 3, 3, padding=1, bias=False).double()
    x = torch.randn(2, 2, 6, 6, dtype=torch.float64)
    x = x if signed else x.relu()
    x[:, :, :3] = 0  # the outputs over these rows have no contribution at all
    with torch.no_grad():
        relevance_out = output_relevance(conv, x) * (conv(x) != 0)  # none on outputs that are exactly 0 (γ: refused)
    limit = tdhook_relevance(make(1e-30), conv, x, relevance_out)
    assert relative_error(tdhook_relevance(make(0.0), conv, x, relevance_out), limit) <= 1e-10


@pytest.mark.parametrize("create_graph", [False, True])
@pytest.mark.parametrize("preset", ["EpsilonPlus", "EpsilonAlpha2Beta1", "EpsilonGammaBox"])
def test_a_preset_without_stabilizer_gives_finite_relevance(preset: str, create_graph: bool):
    from tests.attribution.rules._helpers import CNN_PRESETS

    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Flatten(), nn.Linear(4 * 6 * 6, 3)).double().eval()
    with torch.no_grad():
        model[3].running_mean.normal_()
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64).clamp(-2.9, 2.9)
    x[:, :, :3] = 0

    def relevance(stabilizer: float) -> torch.Tensor:
        mapper = CNN_PRESETS[preset](epsilon=0.0, stabilizer=stabilizer)
        lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"], create_graph=create_graph)
        return lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"].detach()

    assert relative_error(relevance(0.0), relevance(1e-30)) <= 1e-10


class TestZeroParamsGivenOnce:
    """``zero_params`` given as an iterator (a generator expression, ``iter([...])``) zeroes what it names, as the
    same names in a tuple do: at construction and in a copy built anew by ``set_kwargs``. An argument that is no
    sequence of names is refused by name."""

    @pytest.mark.parametrize("kind", ["linear", "conv2d"])
    @pytest.mark.parametrize(
        ("ours", "theirs", "tuned"),
        [
            (
                lambda names: GammaRule(0.25, zero_params=names),
                lambda: zrules.Gamma(0.25, zero_params="bias"),
                {"gamma": 0.25},
            ),
            (
                lambda names: AlphaBetaRule(2.0, 1.0, zero_params=names),
                lambda: zrules.AlphaBeta(2.0, 1.0, zero_params="bias"),
                {"alpha": 2.0},
            ),
        ],
        ids=["gamma", "alpha2beta1"],
    )
    def test_an_iterator_of_names_zeroes_them(self, kind: str, ours, theirs, tuned: dict):
        layer, x = make_layer(kind)
        with torch.no_grad():
            layer.bias.normal_()
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(theirs(), layer, x, r_out)
        built = ours(name for name in ["bias"])
        assert relative_error(tdhook_relevance(built, layer, x, r_out), expected) <= TOL
        rebuilt = ours(iter(["bias"])).set_kwargs(**tuned)
        assert relative_error(tdhook_relevance(rebuilt, layer, x, r_out), expected) <= TOL

    @pytest.mark.parametrize("value", [3, None, 1.5])
    def test_a_value_that_is_no_sequence_of_names_is_named(self, value):
        with pytest.raises(ValueError, match="GammaRule: zero_params must be a sequence of parameter names, got "):
            GammaRule(zero_params=value)
