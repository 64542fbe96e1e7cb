"""The documented import path of the rules, mappers and presets: every name of
:mod:`tdhook.attribution.rules` and :mod:`tdhook.attribution.mappers`, re-exported.

Examples:
    >>> from tdhook.attribution.lrp_helpers.rules import EpsilonPlus, EpsilonRule
    >>> from tdhook.attribution import rules
    >>> EpsilonRule is rules.EpsilonRule
    True
"""

from tdhook.attribution.mappers import *  # noqa: F403
from tdhook.attribution.mappers import __all__ as _mapper_names
from tdhook.attribution.rules import *  # noqa: F403
from tdhook.attribution.rules import __all__ as _rule_names

__all__ = [*_rule_names, *_mapper_names]
