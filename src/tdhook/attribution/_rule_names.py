"""The names and patterns a rule mapper keys rules by, checked against the model's modules; and a dict's entries
that an earlier entry takes every module of.

A rule keyed by a name that matches no module would be left out silently,
and the module it was meant for keep another rule: a name relative to the
wrong object (``"0"`` for a network wrapped in a ``TensorDictModule``, whose
modules are ``"module.0"``, ...), or a typo. The wrapper warns, naming the
key; a warning rather than an error, as one mapper may serve several models. In a dict the first matching entry
wins, so an entry every module of which also matches an earlier one (``{nn.Linear: rule, "head": other}``, with
``head`` a Linear) is never used either: the wrapper warns, naming it and the entry that takes its modules.

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

__all__ = [
    "shadowed_entries",
    "unmatched_names",
    "warn_for_shadowed_entries",
    "warn_for_unmatched_names",
    "warn_for_unused_keys",
]

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
    # The model itself is among them, at "": the mapper is asked for its rule too.
    return [key for key in _name_patterns(mapper) if not any(fnmatchcase(name, key) for name in modules)]


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


def _key_text(key: Any) -> str:
    """A dict key as a message shows it: a pattern quoted, a type (or tuple of types) by class name."""
    if isinstance(key, str):
        return repr(key)
    if isinstance(key, tuple):
        return "(" + ", ".join(kind.__name__ for kind in key) + ")"
    return key.__name__


def _dict_mapper(mapper: Any) -> Any:
    """The mapper made from a dict among ``mapper`` and the user's mappers it consults, or ``None``."""
    seen: set[int] = set()
    while mapper is not None and id(mapper) not in seen:
        seen.add(id(mapper))
        if getattr(mapper, "entries", None) is not None and getattr(mapper, "entry_of", None) is not None:
            return mapper
        mapper = getattr(mapper, "rule_mapper", None)
    return None


def shadowed_entries(mapper: Any, modules: Mapping[str, nn.Module]) -> list[tuple[Any, Any, list[str]]]:
    """The entries of a dict mapper that match modules of the model, every one of which an earlier entry takes.

    Args:
        mapper: the rule mapper (a dict made into one by ``rule_mapper_from_dict``, or a preset consulting one).
        modules: the model's modules by every name they have.

    Returns:
        ``(key, earlier key, names of the modules it matches)`` for each such entry, in the dict's order.

    Examples:
        >>> from tdhook.attribution.mappers import rule_mapper_from_dict
        >>> from tdhook.attribution.rules import EpsilonRule, StopRule
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> mapper = rule_mapper_from_dict({nn.Linear: EpsilonRule(), "2": StopRule()})
        >>> shadowed_entries(mapper, dict(net.named_modules()))
        [('2', <class 'torch.nn.modules.linear.Linear'>, ['2'])]
    """
    found = _dict_mapper(mapper)
    if found is None:
        return []
    keys = [key for key, _ in found.entries]
    by_module: dict[int, tuple[nn.Module, list[str]]] = {}
    for name, module in modules.items():  # the model itself included, at ""
        by_module.setdefault(id(module), (module, []))[1].append(name)
    taken: dict[int, int] = {}  # each module's entry: the first one any of its names matches
    for key_id, (module, names) in by_module.items():
        matches = [match[0] for name in names if (match := found.entry_of(name, module)) is not None]
        if matches:
            taken[key_id] = min(matches)
    shadowed = []
    for index, key in enumerate(keys):
        matched = [
            key_id
            for key_id, (module, names) in by_module.items()
            if (any(fnmatchcase(name, key) for name in names) if isinstance(key, str) else isinstance(module, key))
        ]
        if matched and all(taken[key_id] < index for key_id in matched):
            earlier = keys[min(taken[key_id] for key_id in matched)]
            shadowed.append((key, earlier, [by_module[key_id][1][0] for key_id in matched]))
    return shadowed


def warn_for_shadowed_entries(mapper: Any, modules: Mapping[str, nn.Module]) -> None:
    """Warn, naming each, where a dict entry is never used: every module it matches takes an earlier entry.

    Args:
        mapper: the rule mapper.
        modules: the model's modules by every name they have.
    """
    for key, earlier, names in shadowed_entries(mapper, modules):
        shown = ", ".join(repr(name) for name in names[:_SHOWN]) + (", ..." if len(names) > _SHOWN else "")
        warn_at_caller(
            f"LRP: rule_mapper: the entry {_key_text(key)} is never used: every module it matches ({shown}) "
            f"matches the earlier entry {_key_text(earlier)}, and the first matching entry in the dict's order wins. "
            f"Put {_key_text(key)} before {_key_text(earlier)}"
        )


def warn_for_unused_keys(mapper: Any, model: nn.Module) -> None:
    """Warn where a key of ``mapper`` keys a rule no module of ``model`` gets: a name or pattern that matches none
    of its modules' names (every name of a module registered twice included), or a dict entry an earlier entry takes
    every module of.

    Args:
        mapper: the rule mapper.
        model: the model, whose module names the mapper sees.
    """
    modules = dict(model.named_modules(remove_duplicate=False))
    warn_for_unmatched_names(mapper, modules)
    warn_for_shadowed_entries(mapper, modules)
