"""Moved: :class:`~tdhook.attribution.rules.additions.StabilizedAdditions` lives in
:mod:`tdhook.attribution.rules.additions`; this path re-exports it."""

from tdhook.attribution.rules.additions import StabilizedAdditions

__all__ = ["StabilizedAdditions"]
