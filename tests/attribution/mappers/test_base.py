"""Rule mappers: the dict form, BaseRuleMapper's order (the user's mapper first) and its options."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP
from tdhook.attribution.mappers.base import BaseRuleMapper, rule_mapper_from_dict
from tdhook.attribution.mappers.presets import (
    EpsilonAlpha2Beta1,
    EpsilonAlpha2Beta1Flat,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
)
from tdhook.attribution.mappers.transformer import CPLRP, AttnLRP
from tdhook.attribution.rules._numerics import stabilize
from tdhook.attribution.rules.basic import EpsilonRule, PassRule, StopRule
from tdhook.attribution.rules.input_layer import FlatRule
from tdhook.attribution.rules.recurrent import RecurrentRule
from tests.conftest import relative_error


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 3, dtype=torch.float64)
        self.b = nn.Linear(4, 3, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.a(x)
        out += self.b(x)
        return out


class TestMappers:
    def test_dict_mapper_matches_names_before_types_in_order(self):
        stop, eps = StopRule(), EpsilonRule(0.5)
        mapper = rule_mapper_from_dict({"features.*": stop, nn.Linear: eps})
        assert mapper("features.3", nn.Linear(1, 1)) is stop
        assert mapper("classifier.0", nn.Linear(1, 1)) is eps
        assert mapper("classifier.1", nn.ReLU()) is None
        base = BaseRuleMapper(rule_mapper={nn.Linear: eps})
        assert base("fc", nn.Linear(1, 1)) is eps and isinstance(base("act", nn.Tanh()), PassRule)

    def test_dict_mapper_rejects_non_rules(self):
        with pytest.raises(TypeError, match="'head' must map to a Rule"):
            rule_mapper_from_dict({"head": "epsilon"})

    def test_lrp_accepts_a_dict_and_it_changes_the_result(self):
        from tensordict import TensorDict

        from tdhook.attribution import LRP

        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
        td = TensorDict(x=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
        module = TensorDictModule(net, in_keys=["x"], out_keys=["y"])
        flat = LRP(module, rule_mapper={"module.0": FlatRule()})(td.clone())["relevance", "x"]
        plain = LRP(module)(td.clone())["relevance", "x"]
        assert relative_error(flat, plain) > 1e-3
        # Flat spreads each unit's relevance evenly over the 4 inputs: all four columns are equal.
        torch.testing.assert_close(flat, flat[:, :1].expand_as(flat))

    @pytest.mark.parametrize("form", ["dict", "preset with a dict"])
    def test_a_wrapper_with_a_dict_mapper_pickles_and_explains_as_before(self, form: str):
        """A dict made the mapper a closure, which pickle refuses: ``torch.save`` of such a wrapper, or a
        collector sending it to worker processes, raised ``Can't pickle local object
        'rule_mapper_from_dict.<locals>.mapper'``."""
        import pickle

        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
        td = TensorDict(x=torch.randn(3, 4, dtype=torch.float64), batch_size=[3])
        rules = {"0": FlatRule(), nn.Linear: EpsilonRule(0.5)}
        mapper = rules if form == "dict" else EpsilonPlusFlat(rule_mapper=rules)
        lrp = LRP(net, mapper, in_keys=["x"], out_keys=["y"])
        expected = lrp(td.clone())["relevance", "x"]
        copied = pickle.loads(pickle.dumps(lrp))
        torch.testing.assert_close(copied(td.clone())["relevance", "x"], expected, rtol=0, atol=0)
        # The copy keeps the entries' order and name patterns: a rule for a name the model lacks is still named.
        with pytest.warns(UserWarning, match="'head' matches no module of the model"):
            LRP(
                net,
                pickle.loads(pickle.dumps(rule_mapper_from_dict({"head": StopRule()}))),
                in_keys=["x"],
                out_keys=["y"],
            )

    def test_first_layer_rule_stays_on_the_first_layer_when_the_user_maps_it(self):
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 1)).double()
        epsilon = EpsilonRule()
        rules = EpsilonPlusFlat(rule_mapper={"0": epsilon}).rules(model)
        assert rules["0"] is epsilon
        # Layers 2 and 3 are not reached first by the input: they keep ε, never Flat.
        td = TensorDict(x=torch.randn(5, 3, dtype=torch.float64), batch_size=[5])
        keys = {"in_keys": ["x"], "out_keys": ["y"]}
        ours = LRP(model, EpsilonPlusFlat(rule_mapper={"0": epsilon}), **keys)(td.clone())["relevance", "x"]
        all_epsilon = LRP(model, {nn.Linear: EpsilonRule()}, **keys)(td.clone())["relevance", "x"]
        torch.testing.assert_close(ours, all_epsilon, rtol=1e-12, atol=1e-12)


def test_lrp_applies_the_rule_only_when_the_mapper_asks():
    model = Residual()
    for linear in (model.a, model.b):
        nn.init.zeros_(linear.bias)
    x = torch.randn(6, 4, dtype=torch.float64)

    def total_relevance(stabilize_additions: bool) -> torch.Tensor:
        mapper = BaseRuleMapper(stabilizer=0.5, stabilize_additions=stabilize_additions)
        lrp = LRP(model, rule_mapper=mapper, in_keys=["x"], out_keys=["y"])
        td = lrp(TensorDict(x=x.clone(), batch_size=[6]))
        return td["relevance", "x"].sum(-1), td["y"].gather(1, td["y"].argmax(1, keepdim=True)).squeeze(1)

    exact, logit = total_relevance(False)
    torch.testing.assert_close(exact, logit)  # zero biases: conservation through the exact split
    absorbed, logit = total_relevance(True)
    torch.testing.assert_close(absorbed, logit * logit / stabilize(logit, 0.5))


ALL_MAPPERS = {
    "BaseRuleMapper": BaseRuleMapper,
    "EpsilonPlus": EpsilonPlus,
    "EpsilonPlusFlat": EpsilonPlusFlat,
    "EpsilonAlpha2Beta1": EpsilonAlpha2Beta1,
    "EpsilonAlpha2Beta1Flat": EpsilonAlpha2Beta1Flat,
    "EpsilonGammaBox": lambda **options: EpsilonGammaBox(-3.0, 3.0, **options),
    "AttnLRP": AttnLRP,
    "CPLRP": CPLRP,
}
RECURRENT = {
    "LSTM": lambda: nn.LSTM(3, 4),
    "GRU": lambda: nn.GRU(3, 4),
    "LSTMCell": lambda: nn.LSTMCell(3, 4),
    "GRUCell": lambda: nn.GRUCell(3, 4),
}


@pytest.mark.parametrize("module", RECURRENT)
@pytest.mark.parametrize("preset", ALL_MAPPERS)
def test_every_preset_maps_lstm_and_gru_to_the_recurrent_rule_with_its_stabilizer(module, preset):
    mapper = ALL_MAPPERS[preset](stabilizer=1e-4)
    rule = mapper.rules(nn.Sequential(RECURRENT[module]()))["0"]
    assert isinstance(rule, RecurrentRule)
    assert rule.epsilon == 1e-4


def test_the_users_mapper_overrides_the_recurrent_default():
    rule = BaseRuleMapper(rule_mapper={nn.LSTM: StopRule()})("lstm", nn.LSTM(3, 4))
    assert isinstance(rule, StopRule)


class MetaFormerBlock(nn.Module):
    """A linear layer, timm's ``StarReLU`` (``s * relu(x) ** 2 + b``) and a head: PoolFormerV2's MLP."""

    def __init__(self) -> None:
        from timm.models.metaformer import StarReLU

        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(6, 8, bias=False), StarReLU(scale_value=0.8), nn.Linear(8, 3)
        with torch.no_grad():
            self.act.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


STAR_RELU_PRESETS = {
    "EpsilonPlus": EpsilonPlus,
    "EpsilonGammaBox": lambda: EpsilonGammaBox(-3.0, 3.0),
    "CPLRP": CPLRP,
    "AttnLRP": AttnLRP,
}


@pytest.mark.parametrize("preset", sorted(STAR_RELU_PRESETS))
def test_timm_star_relu_passes_relevance_as_an_activation(preset: str):
    # Its square doubled the relevance under the plain gradient (PoolFormerV2 summed to 2.1-2.5 times the logit).
    model = MetaFormerBlock().double()
    with torch.no_grad():
        model.fc2.bias.zero_()
    assert isinstance(STAR_RELU_PRESETS[preset]()("act", model.act), PassRule)
    x = torch.randn(4, 6, dtype=torch.float64).clamp(-2.9, 2.9)
    lrp = LRP(model, rule_mapper=STAR_RELU_PRESETS[preset](), in_keys=["x"], out_keys=["y"], target=lambda y: y)
    td = lrp(TensorDict(x=x, batch_size=[4]))
    assert relative_error(td["relevance", "x"].sum(1), td["y"].sum(1)) <= 1e-4  # the stabilisers' ε: 1e-6 each


@pytest.mark.parametrize("norm", ["EvoNorm2dS0", "EvoNorm2dB0", "EvoNorm2dS1"])
@pytest.mark.parametrize("preset", sorted(STAR_RELU_PRESETS))
def test_timm_evo_norms_pass_relevance_as_an_unmerged_norm(preset: str, norm: str):
    # x * sigmoid(v * x) / group_std(x): under the plain gradient a scale-invariant map passes no relevance (the
    # sums were 1e-7 to 1e-12 times the logit on resnetv2_50d_evos, with a warning naming each EvoNorm).
    import timm.layers.evo_norm

    torch.manual_seed(0)
    evo = getattr(timm.layers.evo_norm, norm)(8, **({"group_size": 4} if "S" in norm else {}))
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False), evo, nn.Conv2d(8, 4, 3, bias=False), nn.Flatten(), nn.LazyLinear(3)
    )
    model = model.double().eval()
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    model(x)
    with torch.no_grad():
        model[4].bias.zero_()
        if getattr(evo, "v", None) is not None:
            evo.v.uniform_(0.5, 1.5)
    assert isinstance(STAR_RELU_PRESETS[preset]()("1", evo), PassRule)
    lrp = LRP(model, rule_mapper=STAR_RELU_PRESETS[preset](), in_keys=["x"], out_keys=["y"], target=lambda y: y)
    td = lrp(TensorDict(x=x, batch_size=[2]))
    assert relative_error(td["relevance", "x"].flatten(1).sum(1), td["y"].sum(1)) <= 1e-4
