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
from tdhook.attribution.rules.base import Rule

__all__ = ["as_rule_mapper"]


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
