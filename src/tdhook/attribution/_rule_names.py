"""The names and patterns a rule mapper keys rules by, checked against the model's modules.

A rule keyed by a name that matches no module would be left out silently,
and the module it was meant for keep another rule: a name relative to the
wrong object (``"0"`` for a network wrapped in a ``TensorDictModule``, whose
modules are ``"module.0"``, ...), or a typo. The wrapper warns, naming the
key; a warning rather than an error, as one mapper may serve several models.

Examples:
    >>> from torch import nn
    >>> from tdhook.attribution.mappers import rule_mapper_from_dict
    >>> from tdhook.attribution.rules import EpsilonRule
    >>> net = nn.Sequential(nn.Linear(2, 2))
    >>> unmatched_names(rule_mapper_from_dict({"0": EpsilonRule(), "head": EpsilonRule()}), dict(net.named_modules()))
    ['head']
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any

from torch import nn

from tdhook.attribution.rules._caller import warn_at_caller

__all__ = ["unmatched_names", "warn_for_unmatched_names"]

_SHOWN = 12  # module names an error lists


def _name_patterns(mapper: Any) -> list[str]:
    """The string keys of ``mapper`` and of the user's mappers it consults (``rule_mapper``), in order."""
    patterns: list[str] = []
    seen: set[int] = set()
    while mapper is not None and id(mapper) not in seen:
        seen.add(id(mapper))
        patterns += list(getattr(mapper, "name_patterns", ()))
        mapper = getattr(mapper, "rule_mapper", None)
    return patterns


def unmatched_names(mapper: Any, modules: Mapping[str, nn.Module]) -> list[str]:
    """The names and patterns ``mapper`` keys rules by that match none of ``modules``' names.

    Args:
        mapper: the rule mapper (a dict made into one by ``rule_mapper_from_dict``, or a preset consulting one).
        modules: the model's modules by the names the mapper sees.

    Returns:
        The keys that match no module, in the mapper's order.
    """
    names = [name for name in modules if name]
    return [key for key in _name_patterns(mapper) if not any(fnmatchcase(name, key) for name in names)]


def warn_for_unmatched_names(mapper: Any, modules: Mapping[str, nn.Module]) -> None:
    """Warn where a name or pattern ``mapper`` keys a rule by matches none of ``modules``' names, naming the keys
    and the model's module names.

    Args:
        mapper: the rule mapper.
        modules: the model's modules by the names the mapper sees.
    """
    unmatched = unmatched_names(mapper, modules)
    if unmatched:
        names = [name for name in modules if name]
        shown = ", ".join(repr(name) for name in names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")
        keys = ", ".join(repr(key) for key in unmatched)
        classes = {type(module).__name__ for module in modules.values()}
        by_class = [key for key in unmatched if key in classes]
        hint = (
            f"; {', '.join(repr(key) for key in by_class)} {'is' if len(by_class) == 1 else 'are'} the name of a class "
            "of its modules: a string key matches module names, key the type itself (nn.Linear, ...) to match by class"
            if by_class
            else ""
        )
        warn_at_caller(
            f"LRP: rule_mapper: {keys} {'matches' if len(unmatched) == 1 else 'match'} no module of the model, "
            f"and the rule it keys is not used; its modules are {shown or 'none but the model itself'}{hint}"
        )
