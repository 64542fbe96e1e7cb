"""The earlier import paths: every name ``tdhook.attribution.lrp_helpers`` exported is still there, and is the
object of the module it moved to. The rules, mappers and presets are also importable from ``tdhook.attribution``."""

from __future__ import annotations

import importlib

import pytest

import tdhook.attribution

OLD_RULES = "tdhook.attribution.lrp_helpers.rules"
RULES = "tdhook.attribution.rules"
MAPPERS = "tdhook.attribution.mappers"

# The ``__all__`` of lrp_helpers.rules before the rules and mappers moved (and layer_call_of, which it also
# defined), each with the module it moved to.
RULES_NAMES = {
    "stabilize": f"{RULES}._numerics",
    "ParamModifier": f"{RULES}.base",
    "RemovableRuleHandle": f"{RULES}.base",
    "Registration": f"{RULES}.base",
    "Rule": f"{RULES}.base",
    "LayerCall": f"{RULES}.base",
    "MergedLayer": f"{RULES}.base",
    "layer_call_of": f"{RULES}.base",
    "EpsilonRule": f"{RULES}.basic",
    "UniformEpsilonRule": f"{RULES}.basic",
    "PassRule": f"{RULES}.basic",
    "IgnoreRule": f"{RULES}.basic",
    "StopRule": f"{RULES}.basic",
    "UniformRule": f"{RULES}.basic",
    "AlphaBetaRule": f"{RULES}.modified",
    "GammaRule": f"{RULES}.modified",
    "FlatRule": f"{RULES}.input_layer",
    "WSquareRule": f"{RULES}.input_layer",
    "ZBoxRule": f"{RULES}.input_layer",
    "FirstLayerRule": f"{RULES}.input_layer",
    "MergeBatchNormRule": f"{RULES}.batch_norm",
    "RuleMapper": f"{MAPPERS}.base",
    "rule_mapper_from_dict": f"{MAPPERS}.base",
    "BaseRuleMapper": f"{MAPPERS}.base",
    "EpsilonPlus": f"{MAPPERS}.presets",
    "EpsilonPlusFlat": f"{MAPPERS}.presets",
    "EpsilonAlpha2Beta1": f"{MAPPERS}.presets",
    "EpsilonAlpha2Beta1Flat": f"{MAPPERS}.presets",
    "EpsilonGammaBox": f"{MAPPERS}.presets",
    "raise_for_unconserved_rel_factory": f"{RULES}.checks",
    "SoftmaxEpsilonRule": f"{RULES}.transformer",
    "LayerNormRule": f"{RULES}.transformer",
    "PseudoIdentityRule": f"{RULES}.transformer",
    "AHQKVRule": f"{RULES}.transformer",
    "AttnLRP": f"{MAPPERS}.transformer",
    "CPLRP": f"{MAPPERS}.transformer",
}

# The other lrp_helpers modules: (old module, name, module it moved to).
OTHER_NAMES = [
    *[
        ("transformer_rules", name, f"{RULES}.transformer")
        for name in ("SoftmaxEpsilonRule", "LayerNormRule", "PseudoIdentityRule", "AHQKVRule", "uniform_product")
    ],
    ("transformer_rules", "scale_gradient", f"{RULES}._autograd"),
    ("transformer_rules", "AttnLRP", f"{MAPPERS}.transformer"),
    ("transformer_rules", "CPLRP", f"{MAPPERS}.transformer"),
    ("functional_rules", "FunctionalRules", f"{RULES}.functional"),
    ("additions", "StabilizedAdditions", f"{RULES}.additions"),
    *[
        ("redirect", name, f"{RULES}._autograd")
        for name in ("redirect", "relevance_proxy", "backward_keeps_graph", "is_batched_gradient")
    ],
    *[
        ("input_gradients", name, f"{RULES}._input_gradients")
        for name in (
            "has_direct_input_gradient",
            "direct_input_gradient",
            "direct_input_gradients",
            "phase_stacked_input_gradient",
            "shifted_input_gradient",
        )
    ],
    ("targets", "Target", "tdhook.attribution.targets"),
    ("targets", "initial_gradient", "tdhook.attribution.targets"),
]


def moved(name: str, module: str) -> object:
    return getattr(importlib.import_module(module), name)


class TestOldRulesPath:
    @pytest.mark.parametrize("name", list(RULES_NAMES))
    def test_name_is_exported_and_is_the_moved_object(self, name: str):
        old = importlib.import_module(OLD_RULES)
        assert name in old.__all__  # ``from tdhook.attribution.lrp_helpers.rules import *`` keeps it
        assert getattr(old, name) is moved(name, RULES_NAMES[name])


class TestPublicFace:
    @pytest.mark.parametrize("name", list(RULES_NAMES))
    def test_name_is_exported_and_is_the_moved_object(self, name: str):
        assert name in tdhook.attribution.__all__
        assert getattr(tdhook.attribution, name) is moved(name, RULES_NAMES[name])


class TestOtherOldModules:
    @pytest.mark.parametrize(
        ("old_module", "name", "new_module"), OTHER_NAMES, ids=[f"{old}.{name}" for old, name, _ in OTHER_NAMES]
    )
    def test_name_is_exported_and_is_the_moved_object(self, old_module: str, name: str, new_module: str):
        old = importlib.import_module(f"tdhook.attribution.lrp_helpers.{old_module}")
        assert name in old.__all__
        assert getattr(old, name) is moved(name, new_module)
