"""What to say of a rule a mapper gave that is not a tdhook rule: a class, or a zennit or captum rule object.

zennit's and captum's rules are hooks of their own libraries; tdhook cannot run them, but each has a tdhook rule of
the same kind, which the refusal names.

Examples:
    >>> from zennit.rules import Epsilon
    >>> print(not_a_rule(Epsilon()))
    a zennit.rules.Epsilon, not a tdhook Rule; use tdhook.attribution.EpsilonRule in its place
"""

from __future__ import annotations

from typing import Any

from tdhook.attribution.rules import __all__ as _RULE_NAMES
from tdhook.attribution.rules.base import Rule

__all__ = ["not_a_rule"]

ANY_RULE = "map it to one of tdhook.attribution's rules (EpsilonRule, AlphaBetaRule, ...) or to None"
# zennit's and captum's rules whose tdhook counterpart is not named by adding "Rule" (zennit) or by the same name.
_COUNTERPARTS = {
    "zennit": {"ZPlus": "AlphaBetaRule(1.0, 0.0)", "Norm": "EpsilonRule"},
    "captum": {"Alpha1_Beta0_Rule": "AlphaBetaRule(1.0, 0.0)", "IdentityRule": "PassRule"},
}


def not_a_rule(rule: Any) -> str:
    """What ``rule`` is and what to give instead, for a refusal that has named where it was given.

    Examples:
        >>> from tdhook.attribution.rules import EpsilonRule
        >>> print(not_a_rule(EpsilonRule))
        the class EpsilonRule, not a tdhook Rule; pass an instance, EpsilonRule()
        >>> print(not_a_rule(0.25))
        a builtins.float, not a tdhook Rule; map it to one of tdhook.attribution's rules
        (EpsilonRule, AlphaBetaRule, ...) or to None
    """
    if isinstance(rule, type):
        hint = f"pass an instance, {rule.__name__}()" if issubclass(rule, Rule) else ANY_RULE
        return f"the class {rule.__name__}, not a tdhook Rule; {hint}"
    kind = type(rule)
    library = kind.__module__.split(".")[0]
    hint = ANY_RULE
    if library in _COUNTERPARTS:
        default = f"{kind.__name__}Rule" if library == "zennit" else kind.__name__
        ours = _COUNTERPARTS[library].get(kind.__name__, default)
        if ours.split("(")[0] in _RULE_NAMES:
            hint = f"use tdhook.attribution.{ours} in its place"
    return f"a {kind.__module__}.{kind.__name__}, not a tdhook Rule; {hint}"
