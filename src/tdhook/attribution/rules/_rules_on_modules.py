"""The rules registered on each module now: a second one is refused.

A rule rewrites its module's output (or runs its forward in a mode of its own). Two rules registered on one module,
by hand (:meth:`~tdhook.attribution.rules.base.Rule.register`) or one by hand and one by an open wrapper's context,
each rewrote the output the other left, and the gradient was neither rule's, with no word: ``EpsilonRule(0.5)`` and
``GammaRule(0.5)`` on one Linear gave a gradient 0.21 off the one and 0.54 off the other. Each registration is noted
here, by module, and a rule registered where another one is refuses, naming both.

Examples:
    >>> from torch import nn
    >>> from tdhook.attribution.rules import EpsilonRule, GammaRule
    >>> layer = nn.Linear(2, 2)
    >>> with EpsilonRule(0.5).register(layer):
    ...     GammaRule(0.5).register(layer)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: GammaRule(...) cannot be registered on this Linear: EpsilonRule(epsilon=0.5) is registered on it ...
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from tdhook.attribution.rules._identity import IdentityWeakKeyDict

__all__ = ["forget_rule", "note_rule", "raise_for_another_rule"]

# By module: the rules registered on it now (weakly: a rule is kept by its handle, not by this record).
_RULES_ON: IdentityWeakKeyDict[nn.Module, list[weakref.ref]] = IdentityWeakKeyDict()


def raise_for_another_rule(rule: Any, module: nn.Module) -> None:
    """Refuse to register ``rule`` on ``module`` where another rule is registered on it (by hand, or by an open
    wrapper's context)."""
    for reference in _RULES_ON.get(module, ()):
        other = reference()
        if other is not None and other is not rule and module in other._registrations:
            raise ValueError(
                f"{rule!r} cannot be registered on this {type(module).__name__}: {other!r} is registered on it "
                "already (by hand, or by an open LRP context); remove that rule's handle first, as two rules on one "
                "module would each rewrite its output and the gradient would be neither rule's"
            )


def note_rule(rule: Any, module: nn.Module) -> None:
    """``rule`` is registered on ``module`` now."""
    _RULES_ON.setdefault(module, []).append(weakref.ref(rule))


def forget_rule(rule: Any, module: nn.Module) -> None:
    """``rule`` is registered on ``module`` no more (a no-op where it was not)."""
    rules = _RULES_ON.get(module)
    if rules is not None:
        rules[:] = [reference for reference in rules if reference() is not None and reference() is not rule]
        if not rules:
            _RULES_ON.pop(module, None)
