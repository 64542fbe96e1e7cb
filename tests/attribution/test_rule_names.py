"""A rule mapped by name: a name or pattern that matches no module of the model is warned about."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, EpsilonPlus
from tdhook.attribution.rules import EpsilonRule, GammaRule, IgnoreRule, TaylorDecompositionRule
from tests.attribution.mappers.test_presets import zennit_by_name
from tests.conftest import relative_error


def policy() -> TensorDictModule:
    net = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    return TensorDictModule(net, in_keys=["observation"], out_keys=["action_value"])


@pytest.mark.parametrize(
    "mapper",
    [
        {"0": TaylorDecompositionRule(ref=0.1)},  # the network is "module" inside the TensorDictModule
        {nn.Tanh: EpsilonRule(), "head": EpsilonRule()},
        EpsilonPlus(rule_mapper={"module.9": EpsilonRule()}),
    ],
)
def test_a_name_that_matches_no_module_is_named_in_a_warning(mapper):
    # such a rule was left out silently, and the module kept the preset's or the default rule
    with pytest.warns(UserWarning, match=r"rule_mapper: .* matches no module .*'module\.0'"):
        LRP(policy(), mapper)


@pytest.mark.parametrize("mapper", [{"Linear": EpsilonRule()}, EpsilonPlus(rule_mapper={"Tanh": EpsilonRule()})])
def test_a_class_name_as_a_key_is_pointed_to_the_type(mapper):
    # zennit's composites and LXT map by type: a class name given as a string matches no module name
    with pytest.warns(UserWarning, match=r"matches no module .* is the name of a class .* key the type itself"):
        LRP(policy(), mapper)


@pytest.mark.parametrize("key", ["module.0", "module.[02]", "*.2"])
def test_names_and_patterns_that_match_are_taken(key):
    warnings.simplefilter("error")  # no warning
    td = TensorDict(observation=torch.randn(2, 3), batch_size=[2])
    relevance = LRP(policy(), {key: EpsilonRule(epsilon=0.5)})(td)["relevance", "observation"]
    assert relevance.shape == (2, 3)


class TestShadowedEntries:
    """A dict entry every module of which an earlier entry takes is never used: warned of, naming both."""

    @staticmethod
    def _net() -> nn.Sequential:
        return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)).double()

    def test_a_name_after_a_type_that_takes_its_module_is_warned_of(self):
        # The first matching entry wins: {nn.Linear: ε, "2": γ} puts ε on layer 2, and γ is never used.
        from zennit.rules import Epsilon, Gamma

        net, x = self._net(), torch.randn(5, 4, dtype=torch.float64)
        mapper = {nn.Linear: EpsilonRule(1e-6), "2": GammaRule(0.25)}
        with pytest.warns(UserWarning, match=r"the entry '2' is never used: every module it matches \('2'\) matches "):
            lrp = LRP(net, mapper, in_keys=["x"], out_keys=["y"])
        shadowed = lrp(TensorDict(x=x, batch_size=[5]))["relevance", "x"]
        reordered = LRP(net, {"2": GammaRule(0.25), nn.Linear: EpsilonRule(1e-6)}, in_keys=["x"], out_keys=["y"])
        expected = zennit_by_name(net, x, [(["0"], Epsilon(epsilon=1e-6)), (["2"], Gamma(gamma=0.25))])
        assert relative_error(reordered(TensorDict(x=x, batch_size=[5]))["relevance", "x"], expected) < 1e-9
        assert relative_error(shadowed, expected) > 1e-3  # what the warning is about: γ is not on layer 2

    @pytest.mark.parametrize(
        "mapper",
        [
            {"2": GammaRule(0.25), nn.Linear: EpsilonRule()},  # the name first
            {nn.Linear: EpsilonRule(), nn.ReLU: IgnoreRule()},  # disjoint types
            {"0": EpsilonRule(), nn.Linear: GammaRule(0.25)},  # the type still takes layer 2
        ],
    )
    def test_entries_that_each_take_a_module_are_not_warned_of(self, mapper):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            LRP(self._net(), mapper, in_keys=["x"], out_keys=["y"])

    def test_a_subclass_entry_after_its_base_class_is_warned_of(self):
        class OwnLinear(nn.Linear):
            pass

        net = nn.Sequential(OwnLinear(4, 3))
        with pytest.warns(UserWarning, match=r"the entry OwnLinear is never used.*earlier entry \(Linear, Conv2d\)"):
            LRP(net, {(nn.Linear, nn.Conv2d): EpsilonRule(), OwnLinear: GammaRule(0.25)}, in_keys=["x"], out_keys=["y"])


def test_the_empty_name_keys_the_model_itself_and_is_not_warned_of():
    # The mapper is asked for the model's own rule under "": a rule keyed by it is used (the ε-rule of the whole
    # model, here one Linear: that of the layer), so the warning that it matched no module was wrong.
    net, x = nn.Sequential(nn.Linear(3, 2)).double(), torch.randn(4, 3, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lrp = LRP(net, {"": EpsilonRule(0.5)}, in_keys=["x"], out_keys=["y"])
    whole = lrp(TensorDict(x=x, batch_size=[4]))["relevance", "x"]
    layer = LRP(net, {"0": EpsilonRule(0.5)}, in_keys=["x"], out_keys=["y"])(TensorDict(x=x, batch_size=[4]))
    assert relative_error(whole, layer["relevance", "x"]) < 1e-12
