"""The CNN presets as tables: which rule each layer gets, and what they refuse."""

from __future__ import annotations

import copy

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import (
    CPLRP,
    LRP,
    AlphaBetaRule,
    AttnLRP,
    EpsilonAlpha2Beta1,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    EpsilonRule,
    FirstLayerRule,
    FlatRule,
    GammaRule,
    Preset,
    UniformEpsilon,
    ZBoxRule,
)
from tests.conftest import relative_error

PRESETS = {
    "EpsilonPlus": EpsilonPlus,
    "EpsilonPlusFlat": EpsilonPlusFlat,
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-3.0, 3.0),
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
}


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(x).mean(1))


class TestTables:
    @pytest.mark.parametrize(
        ("preset", "conv_rule", "first_rule"),
        [
            (EpsilonPlus(), AlphaBetaRule, None),
            (EpsilonPlusFlat(), AlphaBetaRule, FlatRule),
            (EpsilonAlpha2Beta1(), AlphaBetaRule, None),
            (EpsilonGammaBox(-1.0, 1.0), GammaRule, ZBoxRule),
        ],
        ids=lambda p: type(p).__name__,
    )
    def test_layers_get_the_rules_of_the_table(self, preset, conv_rule, first_rule):
        model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.LazyLinear(2))
        rules = {n: r.other if isinstance(r, FirstLayerRule) else r for n, r in preset.rules(model).items()}
        assert type(rules["4"]) is EpsilonRule and rules["4"].epsilon == preset.epsilon
        assert type(rules["2"]) is conv_rule
        first = preset.rules(model)["0"]
        if first_rule is None:
            assert not isinstance(first, FirstLayerRule)
        else:
            assert type(first.first) is first_rule

    def test_options_are_keyword_only_and_shared(self):
        preset = EpsilonGammaBox(-1.0, 1.0, 0.1, 0.5, stabilizer=1e-3, strict=True)
        assert (preset.epsilon, preset.gamma, preset.stabilizer, preset.strict) == (0.1, 0.5, 1e-3, True)
        with pytest.raises(TypeError):
            EpsilonGammaBox(-1.0, 1.0, 0.1, 0.5, 1e-3)

    def test_a_preset_of_ones_own_is_a_table(self):
        class EpsilonEverywhere(Preset):
            layer_rules = ((nn.Conv2d, lambda preset: EpsilonRule(preset.epsilon)),)

        assert EpsilonEverywhere(epsilon=0.5)("c", nn.Conv2d(1, 1, 1)).epsilon == 0.5


class TestAttentionIsRefused:
    @pytest.mark.parametrize("name", sorted(PRESETS))
    def test_a_cnn_preset_names_the_attention_it_has_no_rule_for(self, name):
        lrp = LRP(Encoder().double(), PRESETS[name](), in_keys=["x"], out_keys=["y"])
        with pytest.raises(ValueError, match=r"'layer\.self_attn' \(MultiheadAttention\).*CPLRP"):
            lrp(TensorDict(x=torch.randn(2, 5, 8, dtype=torch.float64), batch_size=[2]))

    def test_mapping_the_attention_or_a_transformer_preset_explains_it(self):
        td = TensorDict(x=torch.randn(2, 5, 8, dtype=torch.float64), batch_size=[2])
        for mapper in (CPLRP(), EpsilonPlus(rule_mapper={nn.MultiheadAttention: EpsilonRule()})):
            lrp = LRP(Encoder().double().eval(), mapper, in_keys=["x"], out_keys=["y"])
            assert torch.isfinite(lrp(td.clone())["relevance", "x"]).all()


class TestArguments:
    @pytest.mark.parametrize(
        ("make", "match"),
        [
            (lambda: EpsilonGammaBox(low=3, high=-3), "EpsilonGammaBox: low must be below high everywhere"),
            (lambda: EpsilonGammaBox(-3.0, 3.0, gamma=-0.25), "EpsilonGammaBox: gamma must be a finite number >= 0"),
            (lambda: EpsilonGammaBox(-3.0, 3.0, epsilon=-1.0), "EpsilonGammaBox: epsilon must be a finite number"),
            (lambda: EpsilonPlus(epsilon=-1e-6), "EpsilonPlus: epsilon must be a finite number >= 0"),
            (lambda: EpsilonPlusFlat(stabilizer=-1e-6), "EpsilonPlusFlat: stabilizer must be a finite number >= 0"),
            (lambda: EpsilonAlpha2Beta1(epsilon=float("nan")), "EpsilonAlpha2Beta1: epsilon must be a finite"),
            (lambda: AttnLRP(epsilon=-1e-6), "AttnLRP: epsilon must be a finite number >= 0"),
            (lambda: AttnLRP(softmax_epsilon=-0.1), "AttnLRP: softmax_epsilon must be a finite number >= 0"),
            (lambda: CPLRP(stabilizer=-1.0), "CPLRP: stabilizer must be a finite number >= 0"),
        ],
    )
    def test_wrong_numbers_are_refused_at_construction(self, make, match: str):
        with pytest.raises(ValueError, match=match):
            make()

    def test_a_rule_mapper_that_is_neither_callable_nor_a_dict_is_refused(self):
        with pytest.raises(TypeError, match="EpsilonPlus: rule_mapper must be a callable .* got list"):
            EpsilonPlus(rule_mapper=[EpsilonRule()])

    def test_the_zennit_settings_are_accepted(self):
        """zennit's composites' defaults and the settings of its tutorials."""
        box = EpsilonGammaBox(low=-3.0, high=3.0, epsilon=1e-6, gamma=0.25)
        assert (box.low, box.high, box.gamma) == (-3.0, 3.0, 0.25)
        mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
        low, high = ((0 - mean) / std).view(3, 1, 1), ((1 - mean) / std).view(3, 1, 1)
        assert EpsilonGammaBox(low=low, high=high).low is low
        for preset in (EpsilonPlus, EpsilonPlusFlat, EpsilonAlpha2Beta1):
            assert preset(epsilon=0.0, stabilizer=0.0).epsilon == 0.0  # LRP-0
        assert AttnLRP(epsilon=None).epsilon is None and CPLRP(epsilon=0.0).epsilon == 0.0


def zennit_by_name(model: nn.Module, x: torch.Tensor, names_to_rules: list) -> torch.Tensor:
    """zennit's relevance of the argmax logit with rules given by module name, its base layer map elsewhere."""
    from zennit.composites import LayerMapComposite, MixedComposite, NameMapComposite, layer_map_base

    from tests.conftest import zennit_model_relevance

    composite = MixedComposite([NameMapComposite(names_to_rules), LayerMapComposite(layer_map_base())])
    return zennit_model_relevance(composite, model, x)


def relevance_of(model, mapper, x: torch.Tensor) -> torch.Tensor:
    lrp = LRP(model, mapper, in_keys=["x"], out_keys=["y"])
    return lrp(TensorDict(x=x.clone(), batch_size=[x.shape[0]]))["relevance", "x"]


class DeclaredLate(nn.Module):
    """The head is registered first and the stem last: the stem is the layer the input reaches."""

    def __init__(self) -> None:
        super().__init__()
        self.head, self.mid, self.stem = nn.Linear(16, 3), nn.Conv2d(4, 4, 3), nn.Conv2d(3, 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.stem(x).relu()).relu().flatten(1))


class TwoEncoders(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(4, 5), nn.Linear(4, 5), nn.Linear(10, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.cat([self.a(x).relu(), self.b(x).relu()], -1))


class Reused(nn.Module):
    """One Linear layer called on the input, then on its own output: the first call only is the first layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.head = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.a(self.a(x).relu()).relu())


class Unrolled(nn.Module):
    """``Reused`` with the second call given a copy of the layer: a model zennit can map by name."""

    def __init__(self, reused: Reused) -> None:
        super().__init__()
        self.a1, self.a2, self.head = reused.a, copy.deepcopy(reused.a), reused.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.a2(self.a1(x).relu()).relu())


class TestFirstLayerAgainstZennit:
    """The Flat and z^B rules go on the layers the input reaches, by the data flow: zennit's composites give them to
    the first layer in registration order, so the oracle is zennit's NameMapComposite naming the same layers."""

    def test_a_stem_registered_last_gets_flat(self):
        from zennit import rules as zrules

        model, x = DeclaredLate().double().eval(), torch.randn(2, 3, 6, 6, dtype=torch.float64)
        expected = zennit_by_name(
            model, x, [(("stem",), zrules.Flat()), (("mid",), zrules.ZPlus()), (("head",), zrules.Epsilon())]
        )
        assert relative_error(relevance_of(model, EpsilonPlusFlat(), x), expected) <= 1e-6

    def test_every_encoder_of_the_input_gets_flat(self):
        from zennit import rules as zrules

        model, x = TwoEncoders().double().eval(), torch.randn(3, 4, dtype=torch.float64)
        expected = zennit_by_name(model, x, [(("a", "b"), zrules.Flat()), (("head",), zrules.Epsilon())])
        assert relative_error(relevance_of(model, EpsilonPlusFlat(), x), expected) <= 1e-6

    def test_a_first_layer_called_again_later_gets_its_other_rule_there(self):
        from zennit import rules as zrules

        model, x = Reused().double().eval(), torch.randn(3, 4, dtype=torch.float64)
        expected = zennit_by_name(
            Unrolled(model).eval(), x, [(("a1",), zrules.Flat()), (("a2", "head"), zrules.Epsilon())]
        )
        assert relative_error(relevance_of(model, EpsilonPlusFlat(), x), expected) <= 1e-6

    def test_a_sequential_in_a_pipeline_behind_glue_keeps_its_first_layer(self):
        from tensordict.nn import TensorDictModule, TensorDictSequential
        from zennit import composites as zcomposites

        from tests.conftest import zennit_model_relevance

        net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Flatten())
        net = nn.Sequential(*net, nn.Linear(16, 3)).double().eval()
        x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
        pipeline = TensorDictSequential(
            TensorDictModule(lambda x: x * 1.0, in_keys=["x"], out_keys=["scaled"]),
            TensorDictModule(net, in_keys=["scaled"], out_keys=["y"]),
        )
        actual = LRP(pipeline, EpsilonPlusFlat())(TensorDict(x=x.clone(), batch_size=[2]))["relevance", "x"]
        assert relative_error(actual, zennit_model_relevance(zcomposites.EpsilonPlusFlat(), net, x)) <= 1e-6

    def test_a_layer_mixing_the_input_with_a_layer_output_is_refused_by_name(self):
        class InputSkip(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.c1, self.c2, self.fc = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(7, 4, 3), nn.Linear(64, 3)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.fc(self.c2(torch.cat([self.c1(x).relu(), x], 1)).relu().flatten(1))

        x = torch.randn(2, 3, 6, 6, dtype=torch.float64).clamp(-2.9, 2.9)
        for mapper in (EpsilonPlusFlat(), EpsilonGammaBox(-3.0, 3.0)):
            with pytest.raises(ValueError, match=r"(?s)mixes the model inputs with .* rule_mapper.*module 'c2'"):
                relevance_of(InputSkip().double().eval(), mapper, x)


class TestTheUsersMapperComesFirst:
    """A user's rule, keyed by type or by name, wins over the preset's rules, its first-layer rule included (zennit's
    composites keep their first-layer rule over a ``layer_map`` entry; tdhook's ``rule_mapper`` is consulted first
    everywhere, as documented); the preset's own parameters change its rules and keep its first layer."""

    def test_a_type_entry_replaces_the_box_on_the_first_convolution(self):
        from zennit import rules as zrules

        model, x = DeclaredLate().double().eval(), torch.randn(2, 3, 6, 6, dtype=torch.float64).clamp(-2.9, 2.9)
        mapper = EpsilonGammaBox(-3.0, 3.0, rule_mapper={nn.Conv2d: GammaRule(gamma=0.5)})
        gammas = zennit_by_name(model, x, [(("stem", "mid"), zrules.Gamma(0.5)), (("head",), zrules.Epsilon())])
        assert relative_error(relevance_of(model, mapper, x), gammas) <= 1e-6

    def test_the_presets_own_gamma_keeps_the_box_on_the_first_convolution(self):
        from zennit import rules as zrules

        model, x = DeclaredLate().double().eval(), torch.randn(2, 3, 6, 6, dtype=torch.float64).clamp(-2.9, 2.9)
        boxed = [(("stem",), zrules.ZBox(-3.0, 3.0)), (("mid",), zrules.Gamma(0.5)), (("head",), zrules.Epsilon())]
        expected = zennit_by_name(model, x, boxed)
        assert relative_error(relevance_of(model, EpsilonGammaBox(-3.0, 3.0, gamma=0.5), x), expected) <= 1e-6
        # What tells the two maps apart on this model: the first layer's rule.
        gammas = zennit_by_name(model, x, [(("stem", "mid"), zrules.Gamma(0.5)), (("head",), zrules.Epsilon())])
        assert relative_error(gammas, expected) > 1e-2


class TestBoxBoundsAgainstZennit:
    """Bounds broadcast to one sample as torch broadcasts (per channel ``(3, 1, 1)``, per pixel, per position of
    the last dimension); zennit needs them expanded with a batch dimension, as given to it here."""

    @pytest.mark.parametrize("bounds_shape", [(3, 1, 1), (3, 8, 8), (8,), ()], ids=str)
    @pytest.mark.parametrize("first", ["conv2d", "convtranspose2d"])
    def test_matches_zennit_with_the_bounds_expanded(self, bounds_shape, first: str):
        from zennit import composites as zcomposites

        from tests.conftest import zennit_model_relevance

        stem = nn.Conv2d(3, 4, 3, padding=1) if first == "conv2d" else nn.ConvTranspose2d(3, 4, 3, stride=2)
        x = torch.randn(2, 3, 8, 8, dtype=torch.float64)
        body = nn.Sequential(stem, nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Flatten()).double()
        model = nn.Sequential(*body, nn.Linear(body(x).shape[1], 3)).double().eval()
        low = -torch.rand(bounds_shape, dtype=torch.float64) - 1.0
        high = torch.rand(bounds_shape, dtype=torch.float64) + 1.0
        x = torch.maximum(torch.minimum(x, high), low)
        theirs = zcomposites.EpsilonGammaBox(low.expand_as(x), high.expand_as(x))
        expected = zennit_model_relevance(theirs, model, x)
        assert relative_error(relevance_of(model, EpsilonGammaBox(low, high), x), expected) <= 1e-6


class _CaptumNet(nn.Module):
    """A CNN captum's LRP takes: no ``nn.Flatten`` (it has no rule for it) and no two activations in a row (captum
    passes relevance through the second one wrongly: 61 % off zennit and tdhook on a ReLU then a Tanh)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(4, 5, 3, padding=1), nn.ReLU(),
            nn.AvgPool2d(2), nn.Conv2d(5, 3, 1), nn.Tanh(), nn.AdaptiveAvgPool2d(1),
        )  # fmt: skip
        self.classifier = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


class TestAgainstCaptum:
    """captum's LRP and its rules (float64), in what they cover: Conv2d and Linear layers, inputs ``x ≥ 0`` and
    outputs followed by a ReLU for its z⁺ and γ (which modify every weight, not those of the signed parts)."""

    def test_captums_default_is_uniform_epsilon(self):
        from captum.attr import LRP as CaptumLRP

        torch.manual_seed(0)
        model, x = _CaptumNet().double().eval(), torch.randn(3, 2, 8, 8, dtype=torch.float64)
        with torch.no_grad():
            target = model(x).argmax(-1)
        expected = CaptumLRP(model).attribute(x.clone(), target=target)  # ε = 1e-9 on every layer
        mapper = UniformEpsilon(epsilon=1e-9, stabilizer=1e-9)
        actual = LRP(model, mapper, in_keys=["x"], out_keys=["y"], target=target)(
            TensorDict(x=x.clone(), batch_size=[3])
        )["relevance", "x"]
        assert relative_error(actual, expected) <= 1e-6
        # EpsilonPlus is not captum's default: z⁺ on the convolutions.
        plus = LRP(model, EpsilonPlus(epsilon=1e-9, stabilizer=1e-9), in_keys=["x"], out_keys=["y"], target=target)
        assert relative_error(plus(TensorDict(x=x.clone(), batch_size=[3]))["relevance", "x"], expected) > 0.1

    @pytest.mark.parametrize("rule", ["zplus", "gamma"])
    def test_captums_rules_without_bias_on_the_convolutions_after_the_first(self, rule: str):
        from captum.attr import LRP as CaptumLRP
        from captum.attr._utils.lrp_rules import Alpha1_Beta0_Rule
        from captum.attr._utils.lrp_rules import GammaRule as CaptumGamma

        torch.manual_seed(0)
        model, x = _CaptumNet().double().eval(), torch.randn(3, 2, 8, 8, dtype=torch.float64)
        model.features[6] = nn.Conv2d(5, 3, 1).double()  # after a ReLU and a pool: inputs >= 0
        model.features[7] = nn.ReLU()
        theirs = {"zplus": lambda: Alpha1_Beta0_Rule(set_bias_to_zero=True), "gamma": lambda: CaptumGamma(0.5, True)}
        ours = {
            "zplus": AlphaBetaRule(1.0, 0.0, stabilizer=1e-9, zero_params=["bias"]),
            "gamma": GammaRule(0.5, stabilizer=1e-9, zero_params=["bias"]),
        }
        first = model.features[0]
        with torch.no_grad():
            target = model(x).argmax(-1)
        for module in model.modules():
            if isinstance(module, nn.Conv2d) and module is not first:
                module.rule = theirs[rule]()
        try:
            expected = CaptumLRP(model).attribute(x.clone(), target=target)
        finally:
            for module in model.modules():
                if hasattr(module, "rule"):
                    del module.rule
        mapper = UniformEpsilon(
            epsilon=1e-9,
            stabilizer=1e-9,
            rule_mapper=lambda name, m: ours[rule] if isinstance(m, nn.Conv2d) and m is not first else None,
        )
        actual = LRP(model, mapper, in_keys=["x"], out_keys=["y"], target=target)(
            TensorDict(x=x.clone(), batch_size=[3])
        )["relevance", "x"]
        assert relative_error(actual, expected) <= 1e-6
