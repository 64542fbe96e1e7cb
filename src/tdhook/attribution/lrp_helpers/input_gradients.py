"""Moved: the input gradients of linear layers live in :mod:`tdhook.attribution.rules._input_gradients`;
this path re-exports them."""

from tdhook.attribution.rules._input_gradients import (
    direct_input_gradient,
    direct_input_gradients,
    has_direct_input_gradient,
    phase_stacked_input_gradient,
    shifted_input_gradient,
)

__all__ = [
    "has_direct_input_gradient",
    "direct_input_gradient",
    "direct_input_gradients",
    "phase_stacked_input_gradient",
    "shifted_input_gradient",
]
