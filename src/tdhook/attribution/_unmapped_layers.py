"""Layers computed by modules that are no such layer: the layer rules, given by module type, miss them.

A rule mapper gives its layer rules by module type, as zennit's composites do: a module of one's own that holds a
weight and calls ``F.conv2d`` (or ``F.linear``) in its forward is no ``nn.Conv2d`` (no ``nn.Linear``) to it, so it
keeps its plain gradient (LRP-0), where the preset gives convolutions z⁺, αβ or γ, or Linear layers a large ε. A
``torch.fx`` graph traced through its ``nn.Linear`` layers holds such calls too. Nothing else tells: the call is
linear in the activation, so the watch of nonlinear calls (:mod:`~tdhook.attribution._nonlinear_calls`) has nothing
to say about it. The watch notes such calls (a convolution or linear map of an activation by a weight computed from
parameters, in a module without a rule), and :func:`report_unmapped_layers` warns of those whose module the mapper
would give a rule that is not (near) the plain gradient, were it such a layer: a user's mapper or a preset that
leaves these layers LRP-0 (the transformer presets), or gives them an ε no larger than the presets' default
(``1e-6``, which changes the relevance by ε over the layer's outputs), hears nothing. A call the model's input
reaches through no layer stands in the first layer's place, and is judged by the rule a first layer gets: a preset's
Flat or z^B there (``EpsilonPlusFlat``), which a later call of the same module (a tied head) would not get.

Examples:
    >>> from tdhook.attribution import EpsilonPlus
    >>> found, modules = {"conv": {"conv2d": 1}}, {"conv": nn.Identity()}
    >>> report_unmapped_layers(found, modules, EpsilonPlus(), strict=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: LRP: module 'conv' (Identity) computes conv2d with its own weight, but is no convolution layer to ...
    >>> report_unmapped_layers(found, modules, None, strict=True)  # no mapper: LRP-0 everywhere
    ()
    >>> from tdhook.attribution import EpsilonPlusFlat
    >>> found, modules = {"stem": {"linear": 1}}, {"stem": nn.Identity()}
    >>> report_unmapped_layers(found, modules, EpsilonPlusFlat(), strict=False)  # a later layer: ε = 1e-6
    ()
    >>> report_unmapped_layers(found, modules, EpsilonPlusFlat(), strict=True, first=found)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: LRP: module 'stem' (Identity) computes ... where a Linear the model's input reaches first gets ...
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from tdhook.attribution.coverage import PlainGradientCall
from tdhook.attribution.mappers.aliases import module_place
from tdhook.attribution.mappers.base import BaseRuleMapper
from tdhook.attribution.rules._autograd import is_activation, is_held
from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule
from tdhook.attribution.rules.input_layer import FirstLayerRule

__all__ = [
    "LAYER_FUNCTIONS",
    "MATRIX_PRODUCTS",
    "NEGLIGIBLE_EPSILON",
    "bilinear_layer",
    "layer_of",
    "is_weight",
    "matrix_product_layer",
    "report_recurrent_first_layers",
    "report_unmapped_layers",
]

# An ε-rule with an ε up to this (the presets' default) is the plain gradient but where a layer's output is as small.
NEGLIGIBLE_EPSILON = 1e-6

# The functions of the Linear and convolution layers, and the layer each stands for to a rule mapper.
LAYER_FUNCTIONS: dict[str, type[nn.Module]] = {
    "linear": nn.Linear,
    "conv1d": nn.Conv1d,
    "conv2d": nn.Conv2d,
    "conv3d": nn.Conv3d,
    "conv_transpose1d": nn.ConvTranspose1d,
    "conv_transpose2d": nn.ConvTranspose2d,
    "conv_transpose3d": nn.ConvTranspose3d,
}

# Matrix products that compute a Linear layer's map where one factor is an activation and the others are weights
# computed from parameters (``x @ self.W``, ``torch.einsum``, ``torch.addmm(b, x, W)``); taken over the patches of
# ``F.unfold`` (or the windows of ``Tensor.unfold``), a convolution's.
MATRIX_PRODUCTS = frozenset("matmul mm bmm einsum tensordot addmm baddbmm addbmm mv addmv".split())
# Where a product's factors are: an added term (addmm's input) or an equation (einsum's) is not a factor.
_PRODUCT_FACTORS = {name: slice(1, 3) for name in ("addmm", "addmv", "baddbmm", "addbmm")} | {"einsum": slice(1, None)}
# The nodes that make patches of an activation, and the convolution a product over them stands for.
_PATCHES = {
    "Im2ColBackward0": (" of F.unfold patches", nn.Conv2d),
    "UnfoldBackward0": (" of unfold windows", nn.Conv1d),
}
_PATCH_LAYERS = dict(_PATCHES.values())
# Nodes that only reshape, select or copy, between the patches and the product.
_REARRANGING = frozenset(
    "ViewBackward0 UnsafeViewBackward0 ReshapeAliasBackward0 UnsqueezeBackward0 SqueezeBackward0 SqueezeBackward1 "
    "ExpandBackward0 CloneBackward0 TransposeBackward0 PermuteBackward0 TBackward0 SliceBackward0 "
    "ContiguousBackward0".split()
)


def layer_of(function: str) -> type[nn.Module]:
    """The layer type a call recorded as ``function`` stands for to a rule mapper.

    Examples:
        >>> layer_of("conv2d").__name__, layer_of("matmul").__name__, layer_of("matmul of F.unfold patches").__name__
        ('Conv2d', 'Linear', 'Conv2d')
    """
    if function in LAYER_FUNCTIONS:
        return LAYER_FUNCTIONS[function]
    return next((layer for suffix, layer in _PATCH_LAYERS.items() if function.endswith(suffix)), nn.Linear)


def matrix_product_layer(name: str, args: tuple) -> tuple[str, torch.Tensor] | None:
    """Where the matrix product ``name`` (one of :data:`MATRIX_PRODUCTS`) called with ``args`` maps one activation by
    weights computed from parameters (what a Linear layer computes): the name to record it by (that of a
    convolution where the activation is made of unfolded patches) and the activation; else ``None``.

    Examples:
        >>> x, weight = torch.randn(2, 3, requires_grad=True) * 1, nn.Parameter(torch.randn(3, 4))
        >>> matrix_product_layer("matmul", (x, weight))[0], matrix_product_layer("matmul", (x, x.T))
        ('matmul', None)
        >>> patches = nn.functional.unfold(torch.randn(1, 2, 4, 4, requires_grad=True) * 1, 3)
        >>> matrix_product_layer("matmul", (nn.Parameter(torch.randn(5, 18)), patches))[0]
        'matmul of F.unfold patches'
    """
    factors = args[_PRODUCT_FACTORS.get(name, slice(None))]
    if name == "einsum" and len(factors) == 1 and isinstance(factors[0], (list, tuple)):
        factors = tuple(factors[0])
    tensors = [factor for factor in factors if isinstance(factor, torch.Tensor)]
    activations = [tensor for tensor in tensors if is_activation(tensor)]
    if len(activations) != 1 or not any(is_weight(t) for t in tensors):
        return None
    return name + _patches(activations[0]), activations[0]


def bilinear_layer(args: tuple) -> tuple[str, torch.Tensor] | None:
    """Where ``F.bilinear(x1, x2, weight, bias)`` called with ``args`` maps one activation by a weight computed from
    parameters, the other input a constant (an ``nn.Bilinear`` conditioned on an input that is not explained, a
    buffer): a Linear layer's map of that activation. The name to record it by and the activation; else ``None``.

    Examples:
        >>> x, weight = torch.randn(2, 3, requires_grad=True) * 1, nn.Parameter(torch.randn(4, 3, 2))
        >>> bilinear_layer((x, torch.randn(2, 2), weight))[0], bilinear_layer((x, x[:, :2], weight))
        ('bilinear', None)
    """
    if len(args) < 3 or not is_weight(args[2]):
        return None
    activations = [a for a in args[:2] if isinstance(a, torch.Tensor) and is_activation(a)]
    return ("bilinear", activations[0]) if len(activations) == 1 else None


def is_weight(value: Any) -> bool:
    """Whether ``value`` is a weight: a tensor computed from parameters alone, or a parameter (or a view of one, as
    ``self.weight.T``) that does not require grad (a frozen model's, ``model.requires_grad_(False)``); a buffer is not.

    Examples:
        >>> frozen = nn.Parameter(torch.randn(3, 4), requires_grad=False)
        >>> is_weight(frozen.T), is_weight(torch.randn(3, 4)), is_weight(nn.Parameter(torch.randn(2)))
        (True, False, True)
    """
    if not isinstance(value, torch.Tensor) or is_activation(value):
        return False
    with torch._C.DisableTorchFunction():  # an inspection, which a function mode of the call must not see
        # A tensor a rule holds (attention weights under CP-LRP) requires grad only where the call keeps the graph
        # (see hold): a constant of the rule as where it is detached, no weight.
        required = value.requires_grad and not is_held(value)
        return required or isinstance(value, nn.Parameter) or isinstance(value._base, nn.Parameter)


def _patches(activation: torch.Tensor) -> str:
    """What to add to a product's name where ``activation`` is made of unfolded patches (up to reshapes)."""
    node = activation.grad_fn
    while node is not None:
        kind = type(node).__name__
        if kind in _PATCHES:
            return _PATCHES[kind][0]
        edges = [edge for edge, _ in node.next_functions if edge is not None]
        if kind not in _REARRANGING or len(edges) != 1:
            return ""
        node = edges[0]
    return ""


def report_unmapped_layers(
    found: Mapping[str, Mapping[str, int]],
    modules: Mapping[str, nn.Module],
    mapper: Callable[[str, nn.Module], Any] | None,
    strict: bool,
    first: Mapping[str, Mapping[str, int]] | None = None,
) -> tuple[PlainGradientCall, ...]:
    """Warn of (or, ``strict``, refuse) the modules in ``found`` (module name → function → calls) whose calls a
    layer of the function's type would get another rule than the plain gradient from ``mapper``; those calls.
    ``first`` holds those of them made in the first layer's place (the model's input reaching them through no
    layer), judged by the rule a first layer gets.

    Raises:
        ValueError: ``strict``, and such a module.
    """
    calls = []
    for name, functions in found.items():
        module = modules.get(name)
        for function, count in functions.items():
            is_first = function in (first or {}).get(name, {})
            # Said to be in the first layer's place only where that gave the rule: a mapper with no first-layer rule
            # (EpsilonPlus) gives every such layer the same one.
            rule, is_first = _layer_rule(mapper, name, layer_of(function), is_first)
            if rule is None:
                continue
            kind = type(module).__name__ if module is not None else "?"
            layer = layer_of(function).__name__
            what = "Linear layer" if layer == "Linear" else "convolution layer"
            calls.append(PlainGradientCall(name, kind, f"{function} (a {what}'s product outside a layer)", count))
            where = module_place(name, modules)
            place = f"a {layer} the model's input reaches first" if is_first else f"a {layer}"
            remedy = f"Make it a subclass of nn.{layer}, or map it in rule_mapper"
            if function == "bilinear":  # a linear map of one input where the other is a constant
                function = "bilinear of one activation and a constant"
                remedy = "Map it in rule_mapper (EpsilonRule gives it the ε-rule of that map)"
            message = (
                f"LRP: {where} ({kind}) computes {function} with its own weight, but is no {what} to the "
                f"rule mapper, which gives rules by module type: it keeps its plain gradient (LRP-0) where {place} "
                f"gets {type(rule).__name__}. {remedy}; lrp.coverage() lists every such call"
            )
            if strict:
                raise ValueError(message)
            warn_at_caller(message)
    return tuple(calls)


def report_recurrent_first_layers(
    found: Mapping[str, Mapping[str, int]], mapper: Callable[[str, nn.Module], Any] | None, strict: bool
) -> None:
    """Warn of (or, ``strict``, refuse) the recurrent layers in ``found`` (module name → class name → calls) that
    the model's input reaches through no layer, where ``mapper`` is a preset with a first-layer rule (Flat, z^B):
    that rule has no form for a recurrent layer, which keeps its own rule (where no other layer reads the input, no
    layer gets it). A module the user's
    mapper names keeps the user's rule, and hears nothing.

    Examples:
        >>> from tdhook.attribution import EpsilonPlus, EpsilonPlusFlat
        >>> report_recurrent_first_layers({"rnn": {"LSTM": 1}}, EpsilonPlus(), strict=True)  # no first-layer rule
        >>> report_recurrent_first_layers({"rnn": {"LSTM": 1}}, EpsilonPlusFlat(), strict=True)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: LRP: module 'rnn' (LSTM) is the first layer the model's input reaches, and EpsilonPlusFlat's ...

    Raises:
        ValueError: ``strict``, and such a layer.
    """
    if not isinstance(mapper, BaseRuleMapper) or not found:
        return
    layer = nn.Linear(1, 1, device="meta")  # what the mapper's first-layer rule is looked up for
    for name, kinds in found.items():
        if mapper.rule_mapper is not None and mapper.rule_mapper(name, layer) is not None:
            continue  # the user's rule for layers of this name wins over the first-layer rule
        first = mapper.first_layer_rule(name, layer)
        if first is None:
            continue
        for kind in kinds:
            message = (
                f"LRP: module {name!r} ({kind}) is the first layer the model's input reaches, and "
                f"{type(mapper).__name__}'s first-layer rule ({type(first).__name__}) has no form for a recurrent "
                f"layer: it keeps {_recurrent_rule(kind)}, and where no other layer reads the input, no layer gets the "
                "first-layer rule and the relevance is that of the same preset without it. Put a Linear encoder "
                "before it to have the first-layer rule there, or use the preset without a first-layer rule"
            )
            if strict:
                raise ValueError(message)
            warn_at_caller(message)


def _recurrent_rule(kind: str) -> str:
    """The rule a recurrent layer of class ``kind`` keeps, for a message: an ``nn.RNN`` or ``nn.RNNCell`` (with a
    ReLU: one with a tanh is warned of as not piecewise linear) has none, and keeps its plain gradient."""
    return "its plain gradient (LRP-0)" if kind in ("RNN", "RNNCell") else "its RecurrentRule"


def _layer_rule(
    mapper: Callable[[str, nn.Module], Any] | None, name: str, layer: type[nn.Module], first: bool = False
) -> tuple[Any, bool]:
    """The rule ``mapper`` gives a layer of type ``layer`` named ``name`` (in the first layer's place where
    ``first``), where it is not (near) the plain gradient, and whether it is a first-layer rule.

    Examples:
        >>> from tdhook.attribution import EpsilonPlus, EpsilonPlusFlat
        >>> rule, took_first = _layer_rule(EpsilonPlusFlat(), "0", nn.Conv2d, first=True)
        >>> type(rule).__name__, took_first
        ('FlatRule', True)
        >>> rule, took_first = _layer_rule(EpsilonPlus(), "0", nn.Conv2d, first=True)  # z⁺ for every convolution
        >>> type(rule).__name__, took_first
        ('AlphaBetaRule', False)
    """
    if mapper is None:
        return None, False
    shape = (1, 1) if layer is nn.Linear else (1, 1, 1)
    module = layer(*shape, device="meta")
    rule, took_first = mapper(name, module), False
    if first and isinstance(mapper, BaseRuleMapper):
        # As BaseRuleMapper.rules decides: a rule of the user's mapper wins, else the preset's first-layer rule.
        users = mapper.rule_mapper(name, module) if mapper.rule_mapper is not None else None
        if users is None and (first_rule := mapper.first_layer_rule(name, module)) is not None:
            rule, took_first = first_rule, True
    if isinstance(rule, FirstLayerRule):
        rule, took_first = (rule.first, True) if first else (rule.other, False)
    plain = rule is None or isinstance(rule, IgnoreRule)
    if type(rule) is EpsilonRule and rule.epsilon <= NEGLIGIBLE_EPSILON:
        plain = True
    return (None, False) if plain else (rule, took_first)
