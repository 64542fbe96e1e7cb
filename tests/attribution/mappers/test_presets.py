"""The CNN presets as tables: which rule each layer gets, and what they refuse."""

from __future__ import annotations

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
    ZBoxRule,
)

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
