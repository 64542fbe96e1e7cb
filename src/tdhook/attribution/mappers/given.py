"""The rule mapper a wrapper was given, checked: a preset, a dict, a callable, or ``None`` for the defaults.

Examples:
    >>> from tdhook.attribution.mappers.presets import EpsilonPlus
    >>> type(as_rule_mapper(None)).__name__
    'BaseRuleMapper'
    >>> as_rule_mapper(EpsilonPlus)
    Traceback (most recent call last):
    ...
    TypeError: LRP: rule_mapper is the class EpsilonPlus; pass an instance, EpsilonPlus()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tdhook.attribution.mappers import presets, transformer
from tdhook.attribution.mappers.base import BaseRuleMapper, RuleMapper
from tdhook.attribution.mappers.foreign_rules import not_a_rule
from tdhook.attribution.rules.base import Rule

__all__ = ["as_rule_mapper", "checked_rules"]


def as_rule_mapper(rule_mapper: Any) -> RuleMapper:
    """``rule_mapper`` as the wrapper uses it: ``None`` and a dict completed with :class:`BaseRuleMapper`'s defaults.

    Args:
        rule_mapper: what was passed as ``rule_mapper``.

    Returns:
        A mapper: a callable ``(name, module) -> Rule | None``, or an object with ``rules(model)``.

    Raises:
        TypeError: ``rule_mapper`` is a class (a preset not instantiated), a single rule, or neither a callable, a
            dict nor an object with ``rules(model)`` (a zennit composite is pointed to tdhook's preset of the same
            name).
    """
    if rule_mapper is None or isinstance(rule_mapper, Mapping):
        return BaseRuleMapper(rule_mapper=rule_mapper)
    if isinstance(rule_mapper, type):
        name = rule_mapper.__name__
        raise TypeError(f"LRP: rule_mapper is the class {name}; pass an instance, {name}()")
    if callable(rule_mapper) or hasattr(rule_mapper, "rules"):
        return rule_mapper
    kind = type(rule_mapper)
    if isinstance(rule_mapper, Rule):
        raise TypeError(
            f"LRP: rule_mapper is a single rule ({kind.__name__}); map it to the modules it is for, for example "
            "{nn.Linear: rule}, or pass a preset"
        )
    if kind.__module__.split(".")[0] == "zennit":
        ours = [n for n in (*presets.__all__, *transformer.__all__) if n == kind.__name__ and n != "Preset"]
        instead = f"tdhook.attribution.{ours[0]}()" if ours else "one of tdhook.attribution's presets"
        raise TypeError(
            f"LRP: rule_mapper is a zennit composite ({kind.__module__}.{kind.__name__}); use {instead} in its "
            "place: a preset maps rules by module type and needs no canonizers (BatchNorm is merged by its rule)"
        )
    raise TypeError(
        "LRP: rule_mapper must be a preset (EpsilonPlus(), ...), a dict keyed by module type or name pattern, or a "
        f"callable (name, module) -> Rule | None; got {kind.__name__}"
    )


def checked_rules(rules: Mapping[str, Any], modules: Mapping[str, Any]) -> dict[str, Rule]:
    """The rules a mapper chose, each checked to be a tdhook :class:`~tdhook.attribution.rules.base.Rule`.

    Args:
        rules: the rule of each module that has one, by module name.
        modules: the model's modules by name.

    Returns:
        ``rules`` as a dict.

    Raises:
        TypeError: a rule is not a tdhook ``Rule`` (a zennit rule, a hook, a class): the error names the module and
            what was given, and points a zennit rule to tdhook's of the same name.

    Examples:
        >>> from torch import nn
        >>> from tdhook.attribution.rules import EpsilonRule
        >>> layer = nn.Linear(2, 2)
        >>> checked_rules({"fc": EpsilonRule()}, {"fc": layer})
        {'fc': EpsilonRule(epsilon=1e-06)}
        >>> try:
        ...     checked_rules({"fc": EpsilonRule}, {"fc": layer})
        ... except TypeError as error:
        ...     print(str(error).split("; ")[1])
        pass an instance, EpsilonRule()
    """
    for name, rule in rules.items():
        if isinstance(rule, Rule):
            continue
        module = f"module {name!r} ({type(modules[name]).__name__})" if name in modules else f"module {name!r}"
        raise TypeError(f"LRP: rule_mapper gave {module} {not_a_rule(rule)}")
    return dict(rules)
