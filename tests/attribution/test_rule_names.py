"""A rule mapped by name: a name or pattern that matches no module of the model is warned about."""

from __future__ import annotations

import warnings

import pytest
import torch
from tensordict import TensorDict
from tensordict.nn import TensorDictModule
from torch import nn

from tdhook.attribution import LRP, EpsilonPlus
from tdhook.attribution.rules import EpsilonRule, TaylorDecompositionRule


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
