"""Rule mappers: which rule each module of a model gets, and the presets of zennit, LXT and pnpxai.

:mod:`~tdhook.attribution.mappers.base` holds the protocol and :class:`BaseRuleMapper`'s defaults,
:mod:`~tdhook.attribution.mappers.presets` the CNN presets as tables, and
:mod:`~tdhook.attribution.mappers.transformer` AttnLRP and CP-LRP.
"""

from tdhook.attribution.mappers.base import BaseRuleMapper, PresetOptions, RuleMapper, rule_mapper_from_dict
from tdhook.attribution.mappers.presets import (
    EpsilonAlpha2Beta1,
    EpsilonAlpha2Beta1Flat,
    EpsilonGammaBox,
    EpsilonPlus,
    EpsilonPlusFlat,
    Preset,
    UniformEpsilon,
)
from tdhook.attribution.mappers.transformer import CPLRP, AttnLRP

__all__ = [
    "RuleMapper",
    "rule_mapper_from_dict",
    "PresetOptions",
    "BaseRuleMapper",
    "Preset",
    "EpsilonPlus",
    "EpsilonPlusFlat",
    "EpsilonAlpha2Beta1",
    "EpsilonAlpha2Beta1Flat",
    "EpsilonGammaBox",
    "UniformEpsilon",
    "AttnLRP",
    "CPLRP",
]
