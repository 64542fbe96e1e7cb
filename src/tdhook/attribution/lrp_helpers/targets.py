"""Moved to :mod:`tdhook.attribution.targets`; this module re-exports its names."""

from tdhook.attribution.targets import Target, initial_gradient

__all__ = ["Target", "initial_gradient"]
