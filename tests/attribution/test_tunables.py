"""Tunables in pnpxai's form on rules, presets, the LRP wrapper and the attribution methods."""

from __future__ import annotations

import inspect

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

import tdhook.attribution as attribution
from tdhook.attribution import (
    LRP,
    AlphaBetaRule,
    AttnLRP,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonRule,
    GammaRule,
    IntegratedGradients,
    Saliency,
    SmoothGrad,
    TaylorDecompositionRule,
    UniformEpsilon,
)
from tdhook.attribution.tunables import Tunable

F64 = torch.float64


def public_tunables() -> list[type]:
    return [
        obj
        for name in attribution.__all__
        if inspect.isclass(obj := getattr(attribution, name)) and issubclass(obj, Tunable)
    ]


class Residual(nn.Module):
    """A residual sum of two activations: ``stabilize_additions`` changes its relevance."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.head = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.a(x)) + torch.relu(self.b(x)))


def cnn_policy() -> TensorDictModule:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(64, 3)
    ).to(F64)
    return TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])


def observations() -> TensorDict:
    obs = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1), dtype=F64).clamp(-3, 3)
    return TensorDict(observation=obs, batch_size=[2])


class TestForm:
    def test_every_rule_preset_and_method_says_what_it_tunes(self):
        classes = public_tunables()
        names = {c.__name__ for c in classes}
        assert {"LRP", "EpsilonRule", "GammaRule", "EpsilonGammaBox", "UniformEpsilon", "IntegratedGradients"} <= names
        assert {"Saliency", "SmoothGrad", "Occlusion", "TaylorDecompositionRule", "AttnLRP"} <= names
        for cls in classes:
            for name, (kind, space) in cls.tunables.items():
                assert isinstance(kind, type), (cls, name)
                if "choices" in space:
                    assert set(space) == {"choices"} and space["choices"], (cls, name)
                else:
                    assert set(space) == {"low", "high", "log"} and space["low"] < space["high"], (cls, name)
                    assert not (space["log"] and space["low"] <= 0), (cls, name)
                assert name in inspect.signature(cls.__init__).parameters, (cls, name)

    @pytest.mark.parametrize("owner", [EpsilonRule(), GammaRule(), EpsilonPlus(), EpsilonGammaBox(-1.0, 1.0)])
    def test_epsilon_and_gamma_span_pnpxais_range(self, owner):
        for name, (kind, space) in owner.get_tunables().items():
            assert (kind, space) == (float, {"low": 1e-6, "high": 1.0, "log": True}), name

    def test_get_tunables_is_a_fresh_dict(self):
        preset = EpsilonPlus()
        preset.get_tunables()["epsilon"][1]["low"] = 5.0
        assert preset.get_tunables()["epsilon"][1]["low"] == 1e-6


class TestSetKwargs:
    def test_on_the_wrapper_it_sets_the_mappers_parameters(self):
        policy, td = cnn_policy(), observations()
        tuned = LRP(policy, rule_mapper=EpsilonGammaBox(low=-3, high=3)).set_kwargs(gamma=0.5)
        built = LRP(policy, rule_mapper=EpsilonGammaBox(low=-3, high=3, gamma=0.5))
        default = LRP(policy, rule_mapper=EpsilonGammaBox(low=-3, high=3))
        relevance = tuned(td.clone())["relevance", "observation"]
        assert torch.equal(relevance, built(td.clone())["relevance", "observation"])
        assert not torch.allclose(relevance, default(td.clone())["relevance", "observation"])
        assert tuned.get_tunables() == EpsilonGammaBox(-3, 3).get_tunables()
        assert tuned.tunable_values() == {"epsilon": 1e-6, "gamma": 0.5}

    def test_a_preset_rebuilds_its_layer_rules(self):
        preset = UniformEpsilon()
        assert preset.set_kwargs(epsilon=0.01) is preset
        rule = preset("fc", nn.Linear(2, 2))
        assert type(rule) is EpsilonRule and rule.epsilon == 0.01
        assert preset.stabilizer == 1e-6

    @pytest.mark.parametrize(
        "make, name, value",
        [
            (UniformEpsilon, "stabilizer", 0.3),
            (lambda: EpsilonGammaBox(-3.0, 3.0), "low", -1.0),
            (lambda: EpsilonGammaBox(-3.0, 3.0), "high", 1.0),
            (AttnLRP, "softmax_epsilon", 0.1),
        ],
    )
    def test_a_mappers_argument_its_rules_took_set_as_an_attribute_is_refused(self, make, name, value):
        """The stabilizer of FlatRule and the bounds of ZBoxRule were taken when the mapper was built: set as an
        attribute they changed no relevance, with no word."""
        mapper = make()
        with pytest.raises(AttributeError, match=rf"{type(mapper).__name__}: {name} .*the constructor"):
            setattr(mapper, name, value)
        assert getattr(mapper, name, None) != value
        rebuilt = type(mapper)(**{**mapper.__dict__["_tunable_init_arguments"], name: value})
        assert getattr(rebuilt, name, value) == value

    @pytest.mark.parametrize(
        "make, name, value",
        [
            (UniformEpsilon, "epsilon", 1e-3),
            (lambda: EpsilonGammaBox(-3.0, 3.0), "gamma", 0.5),
            (AttnLRP, "epsilon", 0.1),
        ],
    )
    def test_a_mappers_tunable_set_as_an_attribute_is_refused_naming_set_kwargs(self, make, name, value):
        """Its rules took the value when the mapper was built: the attribute set afterwards changed no relevance
        (the layer rules kept 0.25 under UniformEpsilon), and tune would start from the old value."""
        mapper = make()
        before = mapper.tunable_values()
        with pytest.raises(AttributeError, match=rf"{type(mapper).__name__}: {name} .*set_kwargs\({name}=\.\.\.\)"):
            setattr(mapper, name, value)
        assert mapper.tunable_values() == before
        assert mapper.set_kwargs(**{name: value}).tunable_values()[name] == value
        assert mapper.copy().tunable_values()[name] == value

    def test_an_argument_set_as_an_attribute_is_kept_when_set_kwargs_builds_the_object_anew(self):
        """set_kwargs builds the object anew from the arguments it was built with: an option set as an attribute
        since (n_steps = 16) went back to its old value (8), with no word, when another was tuned."""
        method = IntegratedGradients(cnn_policy(), n_steps=8)
        method.n_steps = 16
        method.set_kwargs(method="riemann_left")
        assert (method.n_steps, method.method) == (16, "riemann_left")
        assert method.copy().set_kwargs(method="riemann_right").n_steps == 16

    def test_a_presets_option_set_as_an_attribute_is_kept_when_set_kwargs_builds_it_anew(self):
        """An option a preset takes through its **options (stabilize_additions, strict) but was not built with was
        not in the record of its arguments: set as an attribute, it changed the relevance of a residual sum until
        set_kwargs (or tune) built the preset anew without it, with no word."""
        torch.manual_seed(0)
        model = Residual().double().eval()
        td = TensorDict(x=torch.randn(4, 3, dtype=F64), batch_size=[4])

        def relevance(mapper):
            return LRP(model, mapper, in_keys=["x"], out_keys=["y"])(td.clone())["relevance", "x"]

        built = EpsilonPlus(epsilon=0.5, stabilizer=0.5, stabilize_additions=True, strict=True)
        without = EpsilonPlus(epsilon=0.5, stabilizer=0.5)
        assert not torch.allclose(relevance(built), relevance(without))  # the option matters here
        mapper = EpsilonPlus(stabilizer=0.5)
        mapper.stabilize_additions, mapper.strict = True, True
        mapper.set_kwargs(epsilon=0.5)
        assert (mapper.stabilize_additions, mapper.strict) == (True, True)
        assert torch.equal(relevance(mapper), relevance(built))
        assert mapper.copy().set_kwargs(epsilon=0.25).stabilize_additions

    def test_a_dict_set_as_a_mappers_rule_mapper_is_taken_as_the_constructor_takes_it(self):
        """The constructor turns a dict into a rule mapper; set as an attribute, the dict itself was called, and
        every call failed with "'dict' object is not callable"."""
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2)).double()
        td = TensorDict(x=torch.randn(4, 3, dtype=F64), batch_size=[4])
        rules = {nn.Linear: EpsilonRule(0.25)}
        mapper = EpsilonPlus()
        mapper.rule_mapper = rules
        expected = LRP(model, EpsilonPlus(rule_mapper=rules), in_keys=["x"], out_keys=["y"])(td.clone())
        got = LRP(model, mapper, in_keys=["x"], out_keys=["y"])(td.clone())
        assert torch.equal(got["relevance", "x"], expected["relevance", "x"])
        assert mapper.__dict__["_tunable_init_arguments"]["rule_mapper"] is rules  # recorded as given
        with pytest.raises(TypeError, match=r"EpsilonPlus: rule_mapper must be a callable .* got int"):
            mapper.rule_mapper = 3

    def test_a_method_is_built_anew(self):
        policy, td = cnn_policy(), observations()
        tuned = IntegratedGradients(policy, n_steps=8).set_kwargs(n_steps=20, method="riemann_left")
        built = IntegratedGradients(policy, n_steps=20, method="riemann_left")
        assert torch.equal(
            tuned(td.clone())["attribution", "observation"], built(td.clone())["attribution", "observation"]
        )
        smooth = SmoothGrad(policy, stdev=0.5, seed=0).set_kwargs(stdev=0.1)
        expected = SmoothGrad(policy, stdev=0.1, seed=0)(td.clone())["attribution", "observation"]
        assert torch.equal(smooth(td.clone())["attribution", "observation"], expected)

    def test_rules(self):
        assert AlphaBetaRule().set_kwargs(alpha=3.0).beta == 2.0
        rule = TaylorDecompositionRule(ref=0.5).set_kwargs(epsilon=0.1, bias=True)
        assert (rule.ref, rule.epsilon, rule.bias) == (0.5, 0.1, True)

    @pytest.mark.parametrize(
        ("owner", "values", "named"),
        [
            (lambda: EpsilonRule(), {"gamma": 0.5}, "gamma"),
            (lambda: EpsilonRule(), {"epsilon": 2.0}, "epsilon"),
            (lambda: EpsilonGammaBox(-1.0, 1.0), {"gamma": 0.0}, "gamma"),
            (lambda: EpsilonGammaBox(-1.0, 1.0), {"low": -2.0}, "low"),
            (lambda: AttnLRP(), {"epsilon": float("nan")}, "epsilon"),
            (lambda: IntegratedGradients(cnn_policy()), {"n_steps": 2.5}, "n_steps"),
            (lambda: IntegratedGradients(cnn_policy()), {"method": "simpson"}, "method"),
            (lambda: Saliency(cnn_policy()), {"abs": 1}, "abs"),
            (lambda: LRP(cnn_policy(), rule_mapper=EpsilonPlus()), {"gamma": 0.1}, "gamma"),
            (lambda: LRP(cnn_policy(), rule_mapper={nn.Linear: EpsilonRule()}), {"epsilon": 0.1}, "epsilon"),
        ],
    )
    def test_unknown_names_and_values_out_of_range_are_named(self, owner, values, named):
        target = owner()
        before = target.tunable_values()
        with pytest.raises(ValueError, match=named):
            target.set_kwargs(**values)
        assert target.tunable_values() == before

    def test_values_the_constructor_refuses_leave_the_object_as_it_was(self):
        """``set_kwargs(bias=False)`` on a Taylor rule with ``distribute_bias`` is refused by its constructor; the
        recorded arguments said ``bias=False`` afterwards while the rule computed with ``bias=True``, and every
        later ``set_kwargs`` failed on the bias."""
        rule = TaylorDecompositionRule(ref=0.5, bias=True, distribute_bias=lambda xs, rs: rs)
        with pytest.raises(ValueError, match="distribute_bias is only used with bias=True"):
            rule.set_kwargs(bias=False)
        assert rule.tunable_values() == {"epsilon": 1e-6, "bias": True} and rule.bias is True
        assert rule.set_kwargs(epsilon=0.01).tunable_values() == {"epsilon": 0.01, "bias": True}
        assert rule.copy().tunable_values() == {"epsilon": 0.01, "bias": True}

    def test_not_inside_the_context(self):
        lrp, rule = LRP(cnn_policy(), rule_mapper=EpsilonPlus()), EpsilonRule()
        with lrp, pytest.raises(RuntimeError, match="context"):
            lrp.set_kwargs(epsilon=0.1)
        layer = nn.Linear(2, 2)
        with rule.register(layer), pytest.raises(RuntimeError, match="context"):
            rule.set_kwargs(epsilon=0.1)


class TestCopy:
    def test_copies_are_independent(self):
        preset = EpsilonGammaBox(-1.0, 1.0)
        copied = preset.copy().set_kwargs(gamma=0.5)
        assert (preset.gamma, copied.gamma) == (0.25, 0.5)
        assert preset("c", nn.Conv2d(1, 1, 1)).gamma == 0.25

    def test_a_wrapper_copy_explains_the_same_model_with_its_own_mapper(self):
        lrp = LRP(cnn_policy(), rule_mapper=EpsilonGammaBox(-3.0, 3.0))
        copied = lrp.copy().set_kwargs(gamma=0.5)
        assert copied.module is lrp.module
        assert (lrp.rule_mapper.gamma, copied.rule_mapper.gamma) == (0.25, 0.5)
        method = SmoothGrad(lrp.module)
        assert method.copy().module is method.module

    @pytest.mark.parametrize(
        ("make", "values", "key"),
        [
            (
                lambda m: IntegratedGradients(m, in_keys=["x"], out_keys=["y"], n_steps=8),
                {"n_steps": 16},
                "attribution",
            ),
            (lambda m: SmoothGrad(m, in_keys=["x"], out_keys=["y"], seed=0), {"stdev": 0.5}, "attribution"),
            (lambda m: LRP(m, UniformEpsilon(), in_keys=["x"], out_keys=["y"]), {"epsilon": 0.5}, "relevance"),
        ],
        ids=["integrated-gradients", "smooth-grad", "lrp"],
    )
    def test_a_copy_of_a_wrapper_around_a_plain_module_explains_the_model_as_it_trains_on(self, make, values, key):
        """A method given a plain nn.Module keeps it among the arguments it is built anew from: ``copy()`` copied it
        there, so after ``set_kwargs`` (as ``tune`` builds each trial and its result) the copy explained a frozen
        copy of the weights: 1.09 off (relative L2) once the model had trained on, with no word."""
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
        copied = make(net).copy().set_kwargs(**values)
        assert all(a is b for a, b in zip(copied.parameters(), net.parameters(), strict=True))
        with torch.no_grad():
            net[0].weight.mul_(-3.0)  # a training step
        td = TensorDict(x=torch.randn(5, 3, dtype=torch.float64), batch_size=[5])
        expected = make(net).set_kwargs(**values)(td.clone())[key, "x"]
        torch.testing.assert_close(copied(td.clone())[key, "x"], expected, rtol=1e-12, atol=1e-12)

    def test_a_wrapper_in_its_context_refuses_to_be_copied(self):
        lrp = LRP(cnn_policy(), rule_mapper=EpsilonPlus())
        with lrp, pytest.raises(RuntimeError, match="leave the wrapper's context"):
            lrp.copy()
        assert lrp.copy() is not lrp
