"""The input-layer rules (Flat, w², z^B) against zennit's counterparts in float64, and FirstLayerRule's choice."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn
from zennit import rules as zrules

from tdhook.attribution import LRP
from tdhook.attribution.mappers.presets import EpsilonPlus, EpsilonPlusFlat
from tdhook.attribution.rules._layers import LINEAR_LAYERS
from tdhook.attribution.rules.basic import EpsilonRule
from tdhook.attribution.rules.input_layer import FirstLayerRule, FlatRule, WSquareRule, ZBoxRule
from tests.attribution.rules import _helpers as rule_checks
from tests.attribution.rules._helpers import LAYERS, TOL, make_layer, output_relevance, spy
from tests.attribution.rules._helpers import RULE_PAIRS as ALL_RULE_PAIRS
from tests.conftest import relative_error, tdhook_relevance, zennit_relevance

RULE_PAIRS = {name: ALL_RULE_PAIRS[name] for name in ("flat", "wsquare", "zbox")}


class TestAgainstZennit:
    @pytest.mark.parametrize("kind", LAYERS)
    @pytest.mark.parametrize("rule_name", sorted(RULE_PAIRS))
    def test_rule_matches_zennit(self, rule_name: str, kind: str):
        rule_checks.assert_rule_matches_zennit(rule_name, kind)

    def test_zbox_with_tensor_bounds(self):
        layer, x = make_layer("conv2d")
        low = -torch.rand(1, 3, 1, 1, dtype=torch.float64) - 2
        high = torch.rand(1, 3, 1, 1, dtype=torch.float64) + 2
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(zrules.ZBox(low, high), layer, x, r_out)
        actual = tdhook_relevance(ZBoxRule(low, high), layer, x, r_out)
        assert relative_error(actual, expected) <= TOL

    def test_flat_gives_relevance_to_zero_inputs(self):
        layer, x = make_layer("linear")
        x[:, :2] = 0.0
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(zrules.Flat(), layer, x, r_out)
        actual = tdhook_relevance(FlatRule(), layer, x, r_out)
        assert expected[:, :2].abs().sum() > 0
        assert relative_error(actual, expected) <= TOL

    @pytest.mark.parametrize("create_graph", [False, True], ids=["plain", "create_graph"])
    @pytest.mark.parametrize("kind", ["linear", "conv2d"])
    @pytest.mark.parametrize("rule_name", sorted(RULE_PAIRS))
    def test_subnormal_inputs_get_their_relevance(self, rule_name: str, kind: str, create_graph: bool):
        # The relevance these rules set at x reaches x through the gradient R / x, which overflows where x is
        # subnormal (1e-310): x · inf made it NaN, where zennit's relevance is finite.
        ours, theirs = RULE_PAIRS[rule_name]
        layer, x = make_layer(kind)
        x.view(len(x), -1)[:, ::2] *= 1e-310
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(theirs(), layer, x, r_out)
        actual = tdhook_relevance(ours(), layer, x, r_out, create_graph=create_graph).detach()
        assert relative_error(actual, expected) <= TOL

    @pytest.mark.parametrize("rule_name", ["flat", "zbox"])
    def test_small_inputs_in_float16_get_their_relevance(self, rule_name: str):
        # float16's largest value is 65504: R / x overflowed for |x| below about 1.5e-5 · |R| (x = 1e-7 here).
        ours, _ = RULE_PAIRS[rule_name]
        layer, x = make_layer("linear")
        x[:, 1] = 1e-7
        r_out = output_relevance(layer, x)
        expected = tdhook_relevance(ours(), layer, x, r_out)
        actual = tdhook_relevance(ours(), layer.half(), x.half(), r_out.half())
        assert relative_error(actual.double(), expected) <= 2e-2


class TestFastPaths:
    """The paths that skip autograd or a product, each checked against zennit and shown to be taken."""

    @pytest.mark.parametrize("rule_name", ["flat", "zbox"])
    def test_an_expanded_output_gradient_gives_the_contiguous_result(self, rule_name):
        rule_checks.assert_an_expanded_output_gradient_gives_the_contiguous_result(rule_name)

    def test_zbox_with_bounds_per_sample_matches_zennit(self, monkeypatch):
        # Bounds that differ between samples cannot be computed for one sample: the autograd path runs.
        taken = spy(monkeypatch, ZBoxRule, "_relevance_by_autograd")
        layer, x = make_layer("conv2d")
        low = -torch.rand(2, 3, 1, 1, dtype=torch.float64) - 2
        high = torch.rand(2, 3, 1, 1, dtype=torch.float64) + 2
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(zrules.ZBox(low, high), layer, x, r_out)
        assert relative_error(tdhook_relevance(ZBoxRule(low, high), layer, x, r_out), expected) <= TOL
        assert taken

    @pytest.mark.parametrize("kind", LAYERS)
    @pytest.mark.parametrize("rule_name", ["flat", "wsquare", "zbox"])
    def test_input_layer_rules_skip_autograd_and_match_zennit(self, rule_name, kind, monkeypatch):
        taken = spy(monkeypatch, type(RULE_PAIRS[rule_name][0]()), "_relevance_by_autograd")
        ours, theirs = RULE_PAIRS[rule_name]
        layer, x = make_layer(kind)
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(theirs(), layer, x, r_out)
        assert relative_error(tdhook_relevance(ours(), layer, x, r_out), expected) <= TOL
        assert not taken

    @pytest.mark.parametrize("rule_name", ["flat", "wsquare", "zbox"])
    @pytest.mark.parametrize("kind", ["linear", "conv2d"])
    def test_an_unbatched_input_gives_the_batched_result(self, rule_name, kind):
        rule_checks.assert_an_unbatched_input_gives_the_batched_result(rule_name, kind)

    @pytest.mark.parametrize("rule_name", ["flat", "wsquare", "zbox"])
    def test_repeated_backward_over_one_forward_gives_the_same_gradient(self, rule_name):
        rule_checks.assert_repeated_backward_over_one_forward_gives_the_same_gradient(rule_name)

    @pytest.mark.parametrize("rule_name", ["flat", "zbox"])
    def test_vectorized_jacobian_equals_the_unit_by_unit_one(self, rule_name):
        rule_checks.assert_vectorized_jacobian_equals_the_unit_by_unit_one(rule_name)

    @pytest.mark.parametrize("rule_name", ["flat", "wsquare", "zbox"])
    def test_transposed_convolution_with_output_padding_past_the_stride_matches_zennit(self, rule_name):
        rule_checks.assert_transposed_convolution_with_output_padding_past_the_stride_matches_zennit(rule_name)

    def test_zbox_on_a_linear_subclass_matches_zennit(self):
        class SubclassedLinear(nn.Linear):
            pass

        layer = SubclassedLinear(6, 5).double()
        x = torch.randn(4, 6, dtype=torch.float64)
        r_out = output_relevance(layer, x)
        expected = zennit_relevance(zrules.ZBox(-2.5, 2.5), layer, x, r_out)
        assert relative_error(tdhook_relevance(ZBoxRule(-2.5, 2.5), layer, x, r_out), expected) <= TOL


@pytest.mark.parametrize("rule", ["zbox", "flat"])
def test_calls_of_a_context_under_autocast_or_not_each_equal_a_fresh_call(rule: str):
    """What the rule keeps for one sample, computed by a call under ``torch.autocast`` (in bfloat16), is not reused
    by the context's calls without it, nor the other way round (3.6e-3 off, relative, under z^B)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3))
    first = ZBoxRule(-3.0, 3.0) if rule == "zbox" else FlatRule()
    mapper = {nn.Conv2d: first, nn.Linear: EpsilonRule(1e-6)}
    x = torch.randn(2, 3, 6, 6).clamp(-2.9, 2.9)
    lrp = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"])

    def relevance(autocast: bool) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            return lrp(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]

    fresh = {autocast: relevance(autocast) for autocast in (False, True)}  # each call its own context
    assert not torch.equal(fresh[False], fresh[True])
    with lrp:
        for autocast in (True, False, True, False):
            torch.testing.assert_close(relevance(autocast), fresh[autocast], rtol=0, atol=0)


class TestFirstLayerRule:
    def test_first_layer_is_the_one_the_input_reaches(self):
        class TwoEncoders(nn.Module):
            """Declares the head first; each input has its own encoder."""

            def __init__(self):
                super().__init__()
                self.head = nn.Linear(6, 2)
                self.encode_a, self.encode_b = nn.Linear(3, 3), nn.Linear(2, 3)

            def forward(self, a, b):
                return self.head(torch.cat([self.encode_a(a), self.encode_b(b)], -1).relu())

        model = TwoEncoders().double()
        td = TensorDict(a=torch.randn(4, 3).double(), b=torch.randn(4, 2).double(), batch_size=[4])
        module = TensorDictModule(model, in_keys=["a", "b"], out_keys=["y"])
        ours = LRP(module, rule_mapper=EpsilonPlusFlat(epsilon=0.1))(td.clone())
        # Names are those of the object passed: here the TensorDictModule, which holds the model as "module".
        flat, eps = FlatRule(), EpsilonRule(0.1)
        by_name = {"module.encode_a": flat, "module.encode_b": flat, "module.head": eps}
        expected = LRP(module, rule_mapper=by_name)(td.clone())
        for key in ("a", "b"):
            torch.testing.assert_close(ours["relevance", key], expected["relevance", key], rtol=1e-12, atol=1e-12)
        # Flat gives every input of an encoder the same relevance within a sample.
        for key in ("a", "b"):
            rel = ours["relevance", key]
            torch.testing.assert_close(rel, rel[:, :1].expand_as(rel))


class TestFirstLayerRuleChecksItsEpsilonRules:
    """A first-layer switch of two ε-rules (no modified pass in the pair: a preset whose first-layer rule is an ε of
    its own) never ran the ε-rule's check of a layer's own forward, which the ε-rule runs at its registration: a
    tanh, a clip or a layer norm inside a Linear subclass was explained through its gradient, 0.17 to 1.1 relative
    L2 against it written beside the layer, silently. It is refused by name, as under the ε-rule alone."""

    class EpsilonFirst(EpsilonPlus):
        first_layer_rules = ((LINEAR_LAYERS, lambda preset: EpsilonRule(epsilon=0.25)),)

    INSIDE = {
        "tanh": lambda z: torch.tanh(z),
        "clip": lambda z: nn.functional.hardtanh(z, -0.2, 0.2),
        "layer_norm": lambda z: nn.functional.layer_norm(z, z.shape[1:]),
    }

    @classmethod
    def layer(cls, inside: str) -> nn.Module:
        function = cls.INSIDE[inside]

        class LinearWithin(nn.Linear):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return function(super().forward(x))

        torch.manual_seed(2)
        return LinearWithin(3, 4).double()

    @classmethod
    def relevance(cls, model: nn.Module) -> torch.Tensor:
        torch.manual_seed(4)
        x, relevance_out = torch.randn(2, 3, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
        lrp = LRP(model, cls.EpsilonFirst(), in_keys=["x"], out_keys=["y"], target=lambda y: relevance_out)
        return lrp(TensorDict(x=x, batch_size=[2]))["relevance", "x"]

    # On a later layer the preset's ε is small: a clip there is the function rules' (see check_layer_input).
    @pytest.mark.parametrize(
        ("inside", "first"),
        [("tanh", True), ("clip", True), ("layer_norm", True), ("tanh", False), ("layer_norm", False)],
    )
    def test_an_activation_inside_the_layer_is_refused_by_name(self, inside: str, first: bool):
        torch.manual_seed(3)
        before = [] if first else [nn.Linear(3, 3).double(), nn.ReLU()]
        model = nn.Sequential(*before, self.layer(inside), nn.ReLU(), nn.Linear(4, 3).double())
        with pytest.raises(ValueError, match=r"LinearWithin: its forward runs an activation"):
            self.relevance(model)

    def test_a_layer_linear_in_its_linear_function_is_explained_as_the_plain_layer(self):
        class Doubled(nn.Linear):
            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return 2.0 * super().forward(x)

        torch.manual_seed(2)
        doubled, plain = Doubled(3, 4).double(), nn.Linear(3, 4).double()
        with torch.no_grad():
            plain.weight.copy_(2.0 * doubled.weight)
            plain.bias.copy_(2.0 * doubled.bias)
        torch.manual_seed(3)
        head = nn.Linear(4, 3).double()
        actual = self.relevance(nn.Sequential(doubled, nn.ReLU(), head))
        assert relative_error(actual, self.relevance(nn.Sequential(plain, nn.ReLU(), head))) <= 1e-12


class TestArguments:
    @pytest.mark.parametrize(
        ("low", "high", "match"),
        [
            (1, 0, "ZBoxRule: low must be below high everywhere, got low=1, high=0"),
            (0.0, 0.0, "low must be below high everywhere"),
            (torch.tensor([0.0, 2.0]), torch.tensor([1.0, 1.0]), "low must be below high everywhere"),
            (torch.zeros(3, 1, 1), 1.0 - torch.ones(1, 2, 2) * 2, "low must be below high everywhere"),
            (torch.zeros(3, 1, 1), torch.ones(4, 1, 1), r"low and high must broadcast .*\(3, 1, 1\) and \(4, 1, 1\)"),
            (float("-inf"), 1.0, "ZBoxRule: low must be a finite number"),
            (torch.tensor([0.0, float("nan")]), 1.0, "low and high must be finite"),
            (
                0.0,
                torch.ones(3, dtype=torch.complex128),
                "ZBoxRule: high must hold real numbers, got a torch.complex128",
            ),
        ],
    )
    def test_wrong_bounds_are_refused_at_construction(self, low, high, match: str):
        with pytest.raises(ValueError, match=match):
            ZBoxRule(low=low, high=high)

    @pytest.mark.parametrize(
        ("low", "high"),
        [
            (-3.0, 3.0),  # zennit's EpsilonGammaBox bounds
            (0, 1),
            (torch.tensor([-2.1, -2.0, -1.8]).view(3, 1, 1), torch.tensor([2.2, 2.4, 2.6]).view(3, 1, 1)),
            (torch.zeros(3, 1, 1), 1.0),
        ],
    )
    def test_legitimate_bounds_are_accepted(self, low, high):
        rule = ZBoxRule(low=low, high=high)
        assert rule.low is low and rule.high is high

    @pytest.mark.parametrize("differentiable", [False, True], ids=["plain", "create_graph"])
    @pytest.mark.parametrize("name", ["low", "high"])
    def test_a_bound_that_does_not_fit_the_layers_input_is_named_with_both_shapes(self, name, differentiable):
        """Five channel bounds for a three-channel image: torch's broadcast error named neither the rule, the layer
        nor the bound."""
        net = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 2))
        bounds = {"low": -torch.ones(5, 1, 1), "high": torch.ones(5, 1, 1)}
        bounds = {key: value if key == name else float(value[0]) for key, value in bounds.items()}
        lrp = LRP(net, {"0": ZBoxRule(**bounds)}, in_keys=["x"], out_keys=["y"], create_graph=differentiable)
        match = rf"ZBoxRule on Conv2d: the bound '{name}' of shape \[5, 1, 1\] .* input of shape \[2, 3, 8, 8\]"
        with pytest.raises(ValueError, match=match):
            lrp(TensorDict(x=torch.rand(2, 3, 8, 8), batch_size=[2]))

    def test_number_bounds_are_checked_on_the_cpu_whatever_the_default_device(self):
        """Built under ``torch.device("meta")`` (where models are built empty), the numbers are checked as numbers
        (the check tried to copy a meta tensor to the CPU) and the rule gives the relevance it gives elsewhere."""
        torch.manual_seed(0)
        layer = nn.Linear(4, 3).double()
        x = torch.randn(5, 4, dtype=torch.float64)
        relevance_out = torch.randn(5, 3, dtype=torch.float64)
        with torch.device("meta"):
            rule = ZBoxRule(low=-3.0, high=3.0)
            with pytest.raises(ValueError, match="low must be below high everywhere"):
                ZBoxRule(low=1.0, high=0.0)
        expected = tdhook_relevance(ZBoxRule(low=-3.0, high=3.0), layer, x, relevance_out)
        torch.testing.assert_close(tdhook_relevance(rule, layer, x, relevance_out), expected, rtol=0, atol=0)

    def test_negative_stabilizer_and_non_rules_are_refused(self):
        with pytest.raises(ValueError, match="FlatRule: stabilizer must be a finite number >= 0"):
            FlatRule(stabilizer=-1e-6)
        with pytest.raises(TypeError, match="FirstLayerRule: other must be a Rule, got float"):
            FirstLayerRule(FlatRule(), 0.5)


class TestBoundsAlongTheLastDimension:
    """Bounds broadcast against one sample, aligned on the input's last dimension: for an image whose width equals its
    channel count, per-channel bounds given as a 1-D tensor are silently per column; the rule warns. zennit aligns
    bounds on the batch dimension instead (a 1-D tensor of length C fails there): its oracle takes them with the
    batch dimension, ``[1, 1, 1, W]`` for columns and ``[1, C, 1, 1]`` for channels."""

    @staticmethod
    def image_case(width: int) -> tuple[nn.Conv2d, torch.Tensor, torch.Tensor, torch.Tensor]:
        torch.manual_seed(0)
        layer = nn.Conv2d(3, 4, 3, padding=1).double()
        x = torch.rand(2, 3, 5, width, dtype=torch.float64)
        return layer, x, torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64), torch.tensor([1.0, 2.0, 3.0]).double()

    def test_one_dimensional_bounds_of_the_channel_count_on_as_wide_an_image_warn_and_bound_columns(self):
        layer, x, low, high = self.image_case(width=3)
        r_out = output_relevance(layer, x)
        with pytest.warns(UserWarning, match=r"'low' is a 1-D tensor of length 3.*the shape \[3, 1, 1\]"):
            actual = tdhook_relevance(ZBoxRule(low, high), layer, x, r_out)
        columns = zennit_relevance(zrules.ZBox(low.view(1, 1, 1, 3), high.view(1, 1, 1, 3)), layer, x, r_out)
        assert relative_error(actual, columns) <= TOL  # the broadcasting kept: per column
        channels = zennit_relevance(zrules.ZBox(low.view(1, 3, 1, 1), high.view(1, 3, 1, 1)), layer, x, r_out)
        assert relative_error(actual, channels) > 1e-2  # per channel would have differed

    @pytest.mark.parametrize(
        ("shape", "zennit_shape"), [((3, 1, 1), (1, 3, 1, 1)), ((1, 3), (1, 1, 1, 3))], ids=["channels", "columns"]
    )
    def test_bounds_shaped_for_channels_or_columns_do_not_warn(self, shape, zennit_shape):
        layer, x, low, high = self.image_case(width=3)
        r_out = output_relevance(layer, x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            actual = tdhook_relevance(ZBoxRule(low.view(shape), high.view(shape)), layer, x, r_out)
        expected = zennit_relevance(zrules.ZBox(low.view(zennit_shape), high.view(zennit_shape)), layer, x, r_out)
        assert relative_error(actual, expected) <= TOL

    def test_bounds_of_a_linear_layers_features_do_not_warn(self):
        torch.manual_seed(0)
        layer, x = nn.Linear(3, 2).double(), torch.rand(2, 3, 3, dtype=torch.float64)  # [B, T, features]
        low, high = -torch.arange(1.0, 4.0, dtype=torch.float64), torch.arange(1.0, 4.0, dtype=torch.float64)
        r_out = output_relevance(layer, x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            actual = tdhook_relevance(ZBoxRule(low, high), layer, x, r_out)
        expected = zennit_relevance(zrules.ZBox(low.view(1, 1, 3), high.view(1, 1, 3)), layer, x, r_out)
        assert relative_error(actual, expected) <= TOL


class TestOnAHiddenLayer:
    @pytest.mark.parametrize("rule", [FlatRule(), WSquareRule(), ZBoxRule(-1.0, 1.0)], ids=["flat", "wsquare", "zbox"])
    @pytest.mark.parametrize("activation", [nn.ReLU, nn.Tanh])
    def test_is_refused_as_reading_another_layers_output(self, rule, activation):
        """An input-layer rule mapped by name to a hidden layer gives relevance to that layer's input whatever its
        values, which the layers before it cannot pass on as a gradient: refused by name. The error used to say that
        the layer's input mixed the model inputs with a layer's output, where it reads no model input at all."""
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(5, 8), activation(), nn.Linear(8, 3)).double().eval()
        lrp = LRP(net, {"0": EpsilonRule(1e-6), "2": rule}, in_keys=["x"], out_keys=["y"])
        td = TensorDict(x=torch.randn(4, 5, dtype=torch.float64), batch_size=[4])
        with pytest.raises(ValueError, match=r"(?s)the layer's input is the output of another Linear.*module '2'"):
            lrp(td)
        assert list(td.keys()) == ["x"]
