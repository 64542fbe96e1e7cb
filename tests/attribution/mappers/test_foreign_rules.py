"""A zennit or captum rule given where tdhook expects one of its own is pointed to tdhook's rule of the same kind, in
a dict as from a callable mapper."""

from __future__ import annotations

import pytest
import torch
from captum.attr._utils import lrp_rules as captum_rules
from tensordict import TensorDict
from torch import nn
from zennit import rules as zennit_rules

from tdhook.attribution import LRP, EpsilonRule
from tdhook.attribution.mappers.foreign_rules import not_a_rule

FOREIGN = [
    (zennit_rules.Epsilon(), r"a zennit\.rules\.Epsilon, not a tdhook Rule; use tdhook\.attribution\.EpsilonRule in"),
    (zennit_rules.ZPlus(), r"a zennit\.rules\.ZPlus, .* use tdhook\.attribution\.AlphaBetaRule\(1\.0, 0\.0\) in"),
    (captum_rules.EpsilonRule(), r"a captum\..*\.EpsilonRule, not a tdhook Rule; use tdhook\.attribution\.EpsilonRule"),
    (captum_rules.GammaRule(), r"a captum\..*\.GammaRule, .* use tdhook\.attribution\.GammaRule in its place"),
    (
        captum_rules.Alpha1_Beta0_Rule(),
        r"a captum\..*\.Alpha1_Beta0_Rule, .* use tdhook\.attribution\.AlphaBetaRule\(1\.0, 0\.0\)",
    ),
    (captum_rules.IdentityRule(), r"a captum\..*\.IdentityRule, .* use tdhook\.attribution\.PassRule in its place"),
    (EpsilonRule, r"the class EpsilonRule, not a tdhook Rule; pass an instance, EpsilonRule\(\)"),
    (0.25, r"a builtins\.float, not a tdhook Rule; map it to one of tdhook\.attribution's rules"),
]
IDS = ["zennit-epsilon", "zennit-zplus", "captum-epsilon", "captum-gamma", "captum-alpha1beta0", "captum-identity",
       "rule-class", "number"]  # fmt: skip


def explain(rule_mapper) -> None:
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    LRP(net, rule_mapper, in_keys=["x"], out_keys=["y"])(TensorDict(x=torch.randn(3, 4), batch_size=[3]))


@pytest.mark.parametrize(("given", "match"), FOREIGN, ids=IDS)
def test_a_dict_entry_is_refused_naming_the_entry_and_tdhooks_rule(given, match: str):
    """In a dict (the form a zennit user writes first, ``{nn.Linear: Epsilon()}``) only a rule class got the hint; a
    zennit or captum rule was named by its class name alone."""
    with pytest.raises(
        TypeError, match=r"rule mapping entry <class '.*Linear'> must map to a Rule; it maps to " + match
    ):
        explain({nn.Linear: given})


@pytest.mark.parametrize(("given", "match"), FOREIGN, ids=IDS)
def test_a_callable_mappers_rule_is_refused_naming_the_module_and_tdhooks_rule(given, match: str):
    with pytest.raises(TypeError, match=r"LRP: rule_mapper gave module '0' \(Linear\) " + match):
        explain(lambda name, module: given if name == "0" else None)


def test_a_rule_of_a_kind_tdhook_lacks_is_sent_to_tdhooks_rules():
    class Unknown(zennit_rules.Epsilon):
        pass

    Unknown.__module__ = "zennit.rules"
    assert not_a_rule(Unknown()).endswith(
        "map it to one of tdhook.attribution's rules (EpsilonRule, AlphaBetaRule, ...) or to None"
    )
