"""The reports of what :class:`~tdhook.attribution._nonlinear_calls.NonlinearCalls` found: the functions no rule
covers, named per module in a warning (an error under ``strict``), and the dropout calls that make an explanation
random.

Examples:
    >>> from torch import nn
    >>> report_plain_gradient({}, {"act": nn.Identity()}, strict=True)
    ()
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from tdhook.attribution._cut_signals import CUT_SIGNAL
from tdhook.attribution._function_kinds import PIECEWISE_CONSTANT
from tdhook.attribution._nonlinear_calls import ROUNDING
from tdhook.attribution._offset_products import OFFSET_PRODUCT
from tdhook.attribution._operator_calls import OPERATOR_FORM
from tdhook.attribution._quantized_calls import QUANTIZING, quantizing_message
from tdhook.attribution._straight_through import GRADIENT_SCALING, STRAIGHT_THROUGH
from tdhook.attribution.coverage import PlainGradientCall
from tdhook.attribution.mappers.aliases import module_place
from tdhook.attribution.rules._caller import warn_at_caller

__all__ = ["report_dropout_calls", "report_plain_gradient"]

# Calls reported by a message of their own, not as curved functions.
_NAMED_APART = frozenset({STRAIGHT_THROUGH, GRADIENT_SCALING, OFFSET_PRODUCT, CUT_SIGNAL})


def report_plain_gradient(
    found: Mapping[str, Mapping[str, int]],
    modules: Mapping[str, nn.Module],
    strict: bool,
    function_rules: bool = False,
) -> tuple[PlainGradientCall, ...]:
    """The calls :class:`NonlinearCalls` found, as a report; a warning per module, or an error with ``strict``.

    Args:
        found: what :meth:`NonlinearCalls.found` returns.
        modules: the model's modules by name.
        strict: raise instead of warning.
        function_rules: the mapper's function rules (AttnLRP's, CPLRP's) ran: no other preset is advised.

    Raises:
        ValueError: ``strict`` and a module computes a nonlinear function that no rule covers.

    Examples:
        >>> report_plain_gradient({"act": {"sin": 2}}, {"act": nn.Identity()}, strict=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: LRP: module 'act' (Identity) computes sin in its own forward, which is not piecewise linear, ...
    """
    calls = tuple(
        PlainGradientCall(name, type(modules[name]).__name__ if name in modules else "?", function, count)
        for name, functions in found.items()
        for function, count in functions.items()
    )
    for name, functions in found.items():
        module = modules.get(name)
        where = module_place(name, modules)
        kind = f" ({type(module).__name__})" if module is not None else ""
        constant = [f for f in functions if f in PIECEWISE_CONSTANT or f" ({ROUNDING}" in f]
        operators = [f for f in functions if f" ({OPERATOR_FORM} " in f]
        quantizing = [f for f in functions if f.endswith(QUANTIZING)]
        curved = [f for f in functions if f not in (*constant, *operators, *quantizing) and f not in _NAMED_APART]
        messages = []
        if STRAIGHT_THROUGH in functions:
            messages.append(
                f"LRP: {where}{kind} adds a detached difference back to an activation in its own forward (a "
                "straight-through estimator, x + (y - x).detach() or x.data = y: a vector-quantised code, a one-hot "
                "sample, a binarised activation): the "
                "next layers read y, but the gradient passes through x alone, so the relevance passed back is that of "
                "the activation x, not of the value y, and its sum is not the explained output's. Map the module in "
                "rule_mapper to a rule of your own that passes relevance as the estimator should, or explain the "
                "model up to the estimator; lrp.coverage() lists every such call"
            )
        if GRADIENT_SCALING in functions:
            messages.append(
                f"LRP: {where}{kind} scales the gradient through an activation in its own forward (x * s + "
                "x.detach() * (1 - s), MuZero's scale_gradient): its value is x, but the gradient, and with it the "
                "relevance, passes through it times s, so what it reads gets s times the relevance of the same model "
                "without the scaling. Scale the gradient in training only (if self.training: ...), or map the module "
                "in rule_mapper to a rule of your own; lrp.coverage() lists every such call"
            )
        if CUT_SIGNAL in functions:
            messages.append(
                f"LRP: {where}{kind} adds back to the signal a part it computed from the explained inputs without "
                "gradient, in its own forward (h + f(h).detach(), or f(h) under torch.no_grad(), summed with h or "
                "joined to it by torch.cat): the relevance pass takes that part for a constant, so the relevance "
                "that reaches it stops there, as a bias's does, and the input relevance does not sum to the "
                "explained output. Compute that part with gradient while explaining (a model's option to run every "
                "step with gradient), or map the module in rule_mapper to a rule of your own; lrp.coverage() lists "
                "every such call"
            )
        if OFFSET_PRODUCT in functions:
            messages.append(
                f"LRP: {where}{kind} multiplies activations where a factor adds a constant to an activation in its "
                "own forward ((up + 1) * glu, x * (1 + scale)): the product's rule hands that factor its share of the "
                "relevance, and the constant takes a part of it, as a bias does, so the relevance is not conserved "
                "there (and, unlike a bias, the constant cannot be zeroed). Map the module in rule_mapper to a rule "
                "of your own, or hold the factor constant (a gate); lrp.coverage() lists every such call"
            )
        if curved:
            messages.append(
                f"LRP: {where}{kind} computes {', '.join(curved)} in its own forward, which is not piecewise "
                "linear, and no rule covers it: its plain gradient is used. Map the module in rule_mapper (for "
                "example PassRule for an element-wise activation, UniformRule or IgnoreRule)"
                + ("" if function_rules else ", or use a preset whose function rules cover it (AttnLRP, CPLRP)")
                + "; lrp.coverage() lists every such call"
            )
        if operators:
            messages.append(
                f"LRP: {where}{kind} calls {', '.join(operators)} through torch.ops in its own forward: the rules act "
                "on the torch function (relevance passes through a clip as through nn.Hardtanh, where a unit clipped "
                "at a bound other than zero keeps its relevance; a residual sum is stabilised), but see no ATen "
                "operator, so its plain gradient is used. Call the torch function instead, or map the module in "
                "rule_mapper; lrp.coverage() lists every such call"
            )
        if quantizing:
            messages.append(quantizing_message(where, kind, quantizing))
        if constant:
            messages.append(
                f"LRP: {where}{kind} computes {', '.join(constant)} in its own forward, which is piecewise constant: "
                "its gradient is zero, so no relevance passes back through it and what it reads gets none. Map the "
                "module in rule_mapper (for example PassRule for an element-wise rounding, as a straight-through "
                "estimator passes it, or IgnoreRule to keep the zero); lrp.coverage() lists every such call"
            )
        for message in messages:
            if strict:
                raise ValueError(message)
            warn_at_caller(message)
    return calls


def report_dropout_calls(found: Mapping[str, Mapping[str, int]], modules: Mapping[str, nn.Module]) -> None:
    """Warn, per module, of the dropout functions :meth:`NonlinearCalls.found_dropouts` found: each forward pass drops
    other units, and the explanation is random from call to call, as with a Dropout module in training mode.

    Examples:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     report_dropout_calls({"body": {"dropout (p=0.5)": 1}}, {"body": nn.Identity()})
        >>> str(caught[0].message)[:60]
        "LRP: module 'body' (Identity) calls dropout (p=0.5) in its o"
    """
    for name, functions in found.items():
        module = modules.get(name)
        where = module_place(name, modules)
        kind = f" ({type(module).__name__})" if module is not None else ""
        warn_at_caller(
            f"LRP: {where}{kind} calls {', '.join(functions)} in its own forward in training mode, outside any "
            "Dropout module, so each forward pass drops other units and the explanation is random from call to call; "
            "call .eval() on the model for a deterministic one"
        )
