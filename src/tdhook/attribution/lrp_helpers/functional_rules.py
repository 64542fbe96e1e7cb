"""Moved: :class:`~tdhook.attribution.rules.functional.FunctionalRules` lives in
:mod:`tdhook.attribution.rules.functional`; this path re-exports it."""

from tdhook.attribution.rules.functional import FunctionalRules

__all__ = ["FunctionalRules"]
