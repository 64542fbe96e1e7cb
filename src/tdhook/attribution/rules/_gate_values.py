"""A module taken for a sigmoid-like gate by its class name must return a gate's values, in ``[0, 1]``.

Examples:
    >>> import torch
    >>> class GateSigmoid(torch.nn.Module):  # named like a gate, an activation
    ...     def forward(self, x):
    ...         return x * torch.sigmoid(x)
    >>> raise_for_values_outside_a_gate(GateSigmoid(), torch.tensor([0.2, 0.9]))  # a gate's values: passes
    >>> raise_for_values_outside_a_gate(GateSigmoid(), torch.tensor([-0.27, 3.0]))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: GateRule on GateSigmoid: taken for a sigmoid-like gate by its class name, it returned values ...
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["raise_for_values_outside_a_gate"]


def raise_for_values_outside_a_gate(module: Any, output: Any) -> None:
    """Raise where a module mapped to the gate rule by its class name returns values outside ``[0, 1]``: a gate's
    output scales a signal (a sigmoid's, a hard sigmoid's); a ``GateSigmoid`` computing ``x · sigmoid(x)`` is an
    activation, and held as a gate it would give its product's relevance to the other factor."""
    if not isinstance(output, torch.Tensor) or not output.is_floating_point() or not output.numel():
        return
    low, high = torch.aminmax(output.detach())
    if bool(low < -_GATE_SLACK) or bool(high > 1 + _GATE_SLACK):
        raise ValueError(
            f"GateRule on {type(module).__name__}: taken for a sigmoid-like gate by its class name, it returned "
            f"values from {low.item():.4g} to {high.item():.4g}, outside [0, 1]: it is no gate. Map it to the rule "
            "of what it computes (PassRule for an element-wise activation)"
        )


# How far outside [0, 1] a gate's values may round.
_GATE_SLACK = 1e-3
