"""Convolutions computed by modules that are no convolution layer: the layer rules, given by module type, miss them.

A rule mapper gives its layer rules by module type, as zennit's composites do: a module of one's own that holds a
weight and calls ``F.conv2d`` in its forward is no ``nn.Conv2d`` to it, so it keeps its plain gradient (LRP-0), where
the preset gives convolutions z⁺, αβ or γ. Nothing else tells: the call is linear in the activation, so the watch of
nonlinear calls (:mod:`~tdhook.attribution._nonlinear_calls`) has nothing to say about it. The watch notes such
calls (a convolution of an activation by a weight computed from parameters, in a module without a rule), and
:func:`report_unmapped_layers` warns of those whose module the mapper would give another rule, were it a
convolution layer: a user's mapper or a preset that leaves convolutions LRP-0 (the transformer presets) hears
nothing.

Examples:
    >>> from tdhook.attribution import EpsilonPlus
    >>> found, modules = {"conv": {"conv2d": 1}}, {"conv": nn.Identity()}
    >>> report_unmapped_layers(found, modules, EpsilonPlus(), strict=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: LRP: module 'conv' (Identity) computes conv2d with its own weight, but is no convolution layer to ...
    >>> report_unmapped_layers(found, modules, None, strict=True)  # no mapper: LRP-0 everywhere
    ()
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from tdhook.attribution.coverage import PlainGradientCall
from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule

__all__ = ["LAYER_FUNCTIONS", "report_unmapped_layers"]

# The functions of the convolution layers, and the layer each stands for to a rule mapper.
LAYER_FUNCTIONS: dict[str, type[nn.Module]] = {
    "conv1d": nn.Conv1d,
    "conv2d": nn.Conv2d,
    "conv3d": nn.Conv3d,
    "conv_transpose1d": nn.ConvTranspose1d,
    "conv_transpose2d": nn.ConvTranspose2d,
    "conv_transpose3d": nn.ConvTranspose3d,
}


def report_unmapped_layers(
    found: Mapping[str, Mapping[str, int]],
    modules: Mapping[str, nn.Module],
    mapper: Callable[[str, nn.Module], Any] | None,
    strict: bool,
) -> tuple[PlainGradientCall, ...]:
    """Warn of (or, ``strict``, refuse) the modules in ``found`` (module name → function → calls) whose calls a
    layer of the function's type would get another rule than the plain gradient from ``mapper``; those calls.

    Raises:
        ValueError: ``strict``, and such a module.
    """
    calls = []
    for name, functions in found.items():
        module = modules.get(name)
        for function, count in functions.items():
            rule = _layer_rule(mapper, name, LAYER_FUNCTIONS[function])
            if rule is None:
                continue
            kind = type(module).__name__ if module is not None else "?"
            calls.append(PlainGradientCall(name, kind, f"{function} (a convolution outside a layer)", count))
            where = f"module {name!r}" if name else "the model itself"
            layer = LAYER_FUNCTIONS[function].__name__
            message = (
                f"LRP: {where} ({kind}) computes {function} with its own weight, but is no convolution layer to the "
                f"rule mapper, which gives rules by module type: it keeps its plain gradient (LRP-0) where a {layer} "
                f"gets {type(rule).__name__}. Make it a subclass of nn.{layer}, or map it in rule_mapper; "
                "lrp.coverage() lists every such call"
            )
            if strict:
                raise ValueError(message)
            warn_at_caller(message)
    return tuple(calls)


def _layer_rule(mapper: Callable[[str, nn.Module], Any] | None, name: str, layer: type[nn.Module]) -> Any:
    """The rule ``mapper`` gives a layer of type ``layer`` named ``name``, where it is not the plain gradient."""
    if mapper is None:
        return None
    rule = mapper(name, layer(1, 1, 1, device="meta"))
    plain = rule is None or isinstance(rule, IgnoreRule)
    if type(rule) is EpsilonRule and rule.epsilon == 0.0:
        plain = True
    return None if plain else rule
