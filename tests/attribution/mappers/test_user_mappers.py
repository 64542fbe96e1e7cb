"""Mappers a user writes around rules of their own: a ``BaseRuleMapper`` subclass, a dict or a callable given to a
preset (``None`` keeps the preset's rule), each checked against the preset that has the same rules built in, and
the errors for a class where an instance belongs."""

from __future__ import annotations

import pytest
import torch
from tensordict import TensorDict
from torch import nn

from tdhook.attribution import LRP, EpsilonPlus
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.rules import EpsilonRule, redirect, stabilize
from tests.attribution.rules.test_authored_zennit_rules import UserEpsilon, UserZPlus, small_cnn


class ZPlusOnConvolutions(BaseRuleMapper):
    """EpsilonPlus written with rules of one's own: z⁺ on convolutions, ε on Linear layers."""

    def layer_rule(self, name, module):
        if isinstance(module, nn.Conv2d):
            return UserZPlus()
        if isinstance(module, nn.Linear):
            return UserEpsilon()
        return None


class UserEpsilonOf(UserEpsilon):
    """The user's ε-rule with an ε of its own."""

    def __init__(self, epsilon: float) -> None:
        super().__init__()
        self.epsilon = epsilon

    def rewrite(self, module, registration, inputs, output):
        z = output.detach()
        return redirect(output, [output], lambda g: [g * z / stabilize(z, self.epsilon)])


def _relevance(net: nn.Module, x: torch.Tensor, mapper) -> torch.Tensor:
    lrp = LRP(net, rule_mapper=mapper, in_keys=["x"], out_keys=["y"], target=1)
    return lrp(TensorDict(x=x, batch_size=[x.shape[0]]))["relevance", "x"]


MAPPERS = {
    "subclass": ZPlusOnConvolutions,
    "preset with a type entry": lambda: EpsilonPlus(rule_mapper={nn.Conv2d: UserZPlus()}),
    "preset with a callable keeping its rules with None": lambda: EpsilonPlus(
        rule_mapper=lambda name, module: UserZPlus() if name in ("0", "2") else None
    ),
}


@pytest.mark.parametrize("case", sorted(MAPPERS))
def test_a_mapper_of_user_rules_equals_the_preset_built_in(case):
    net = small_cnn()
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    expected = _relevance(net, x, EpsilonPlus())
    relevance = _relevance(net, x, MAPPERS[case]())
    assert expected.abs().sum() > 0
    torch.testing.assert_close(relevance, expected, rtol=1e-9, atol=1e-12)


def test_a_name_pattern_overrides_the_preset_for_the_layers_it_names():
    """``{"[02]": rule}``: the convolutions named get the user's z⁺, the Linear layer keeps the preset's ε; with
    ε = 0.25 on the Linear layer by name, the result follows it (and differs from the preset's ε = 1e-6)."""
    net = small_cnn()
    x = torch.randn(3, 2, 6, 6, dtype=torch.float64)
    expected = _relevance(net, x, EpsilonPlus())
    torch.testing.assert_close(_relevance(net, x, EpsilonPlus(rule_mapper={"[02]": UserZPlus()})), expected)
    larger = _relevance(net, x, EpsilonPlus(rule_mapper={"6": EpsilonRule(0.25)}))
    ours = _relevance(net, x, EpsilonPlus(rule_mapper={"6": UserEpsilonOf(0.25)}))
    torch.testing.assert_close(ours, larger, rtol=1e-9, atol=1e-12)
    assert (larger - expected).abs().max() > 1e-6


def test_a_dict_mapping_a_rule_class_says_to_pass_an_instance():
    net = small_cnn()
    x = torch.randn(1, 2, 6, 6, dtype=torch.float64)
    with pytest.raises(
        TypeError, match=r"maps to the class UserEpsilon, not a tdhook Rule; pass an instance, UserEpsilon\(\)"
    ):
        _relevance(net, x, {nn.Linear: UserEpsilon})
    with pytest.raises(TypeError, match=r"the class UserEpsilon, not a tdhook Rule; pass an instance"):
        _relevance(net, x, lambda name, module: UserEpsilon if isinstance(module, nn.Linear) else None)
