"""A module the model holds under several names: the user's mapper is asked for its rule under every one of them.

``named_modules()`` gives each module once, under the first name it is found at. A layer registered twice
(``self.a = self.b = layer``), or shared by two blocks (``self.encoder.embed = self.decoder.embed = embed``), is
the same module under every name, called with one rule. A rule the user keyed by its second name (``{"b": rule}``,
``{"decoder.*": rule}``) was asked for under the first name only: it was not used, and the module kept the
preset's rule. Each of the module's names is now asked: for a dict (:func:`~tdhook.attribution.mappers.base.
rule_mapper_from_dict`), the first entry in the dict's order that matches one of its names wins, as for a module of
one name; for a callable, the rule it gives under any name, and an error where it gives different rules under two
of them (one module gets one rule).

Examples:
    >>> from torch import nn
    >>> from tdhook.attribution.mappers.base import rule_mapper_from_dict
    >>> from tdhook.attribution.rules import EpsilonRule
    >>> layer = nn.Linear(2, 2)
    >>> net = nn.Sequential(layer, nn.ReLU(), layer)
    >>> aliases = module_aliases(net)
    >>> aliases[id(layer)]
    ('0', '2')
    >>> user_rule(rule_mapper_from_dict({"2": EpsilonRule(0.5)}), "0", layer, aliases)
    EpsilonRule(epsilon=0.5)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from tdhook.attribution.rules.base import Rule

__all__ = ["every_named_module", "module_aliases", "module_place", "user_rule"]


def module_aliases(model: nn.Module) -> dict[int, tuple[str, ...]]:
    """Every name of each module of ``model`` that has more than one, by the module's ``id``.

    Args:
        model: the model.

    Returns:
        For each module reachable under several names, its names, the one ``named_modules()`` gives first.
    """
    names: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        names.setdefault(id(module), []).append(name)
    return {key: tuple(dict.fromkeys(found)) for key, found in names.items() if len(set(found)) > 1}


def every_named_module(model: nn.Module) -> dict[str, nn.Module]:
    """``model``'s modules under every name they have: a module held under several names is listed under each.

    Args:
        model: the model.

    Returns:
        ``name -> module``, in the order of ``named_modules(remove_duplicate=False)``.

    Examples:
        >>> layer = nn.Linear(2, 2)
        >>> list(every_named_module(nn.Sequential(layer, nn.ReLU(), layer)))
        ['', '0', '1', '2']
    """
    return dict(model.named_modules(remove_duplicate=False))


def module_place(name: str, modules: Mapping[str, nn.Module]) -> str:
    """How a message names the module ``name`` of ``modules`` (the model's, by name, the model at ``""``): by that
    name, followed by the other names the model holds it under, if any.

    Args:
        name: the module's name.
        modules: the model's modules by name; without the model itself (``""``) no other name is found.

    Returns:
        ``"module 'name'"``, ``"module 'name' (also named 'other')"``, or ``"the model itself"`` for ``""``.

    Examples:
        >>> layer = nn.Linear(2, 2)
        >>> modules = dict(nn.Sequential(layer, nn.ReLU(), layer).named_modules())
        >>> module_place("0", modules), module_place("1", modules), module_place("", modules)
        ("module '0' (also named '2')", "module '1'", 'the model itself')
    """
    if not name:
        return "the model itself"
    module, model = modules.get(name), modules.get("")
    names = module_aliases(model).get(id(module), ()) if module is not None and model is not None else ()
    others = [alias for alias in names if alias != name]
    return f"module {name!r}" + (f" (also named {', '.join(map(repr, others))})" if others else "")


def user_rule(
    mapper: Callable[[str, nn.Module], Any], name: str, module: nn.Module, aliases: Mapping[int, tuple[str, ...]]
) -> Any:
    """The rule ``mapper`` gives ``module``, asked under each of its names.

    Args:
        mapper: the user's mapper: a dict made a mapper by ``rule_mapper_from_dict``, or a callable.
        name: the module's name in ``named_modules()``.
        module: the module.
        aliases: :func:`module_aliases` of the model.

    Returns:
        For a dict mapper, the rule of its first entry matching one of the names; for a callable, the rule it gives
        under any name; ``None`` where there is none.

    Raises:
        ValueError: a callable gives the module different rules under two of its names.
    """
    names = aliases.get(id(module))
    if names is None:
        return mapper(name, module)
    entry_of = getattr(mapper, "entry_of", None)
    if entry_of is not None:  # a dict: the first entry in its order that one of the names matches
        matches = [match for alias in names if (match := entry_of(alias, module)) is not None]
        return min(matches, key=lambda match: match[0])[1] if matches else None
    given = [(alias, rule) for alias in names if (rule := mapper(alias, module)) is not None]
    distinct = {_identity(rule): (alias, rule) for alias, rule in given}
    if len(distinct) > 1:
        shown = ", ".join(f"{rule!r} under {alias!r}" for alias, rule in given)
        raise ValueError(
            f"LRP: rule_mapper gives module {name!r} ({type(module).__name__}), which the model holds under the "
            f"names {', '.join(map(repr, names))}, different rules under its names ({shown}); it is one module, "
            "called with one rule: give every one of its names the same rule"
        )
    return given[0][1] if given else None


def _identity(rule: Any) -> tuple:
    """What tells two rules apart: the object for anything but a tdhook rule, else its class and parameters."""
    return (type(rule), repr(rule)) if isinstance(rule, Rule) else (id(rule),)
