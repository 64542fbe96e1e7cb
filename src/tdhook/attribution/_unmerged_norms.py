"""BatchNorms computed by ``F.batch_norm`` outside a BatchNorm module, on a layer's output: merged by no rule.

An eval-mode BatchNorm module is merged into the Linear or convolution layer that feeds it: the layer's rule (z⁺,
αβ, γ, ε) is applied to the merged layer ``W s``, as zennit's canonizers do. The merge happens at the module, so a
batch norm computed by a function outside one is not merged: a ``torch.fx`` trace holds such calls wherever it
traced through a norm that is not torch's own (timm's ``BatchNormAct2d``), and so does a module of one's own that
calls ``F.batch_norm`` on a layer's output with buffers of its own. The layer's rule then acts on the layer alone,
and the batch norm keeps its plain gradient: a relevance that differs from the same model's with the module (by 99 %
under EpsilonPlus on a traced ``efficientnet_b0`` whose BatchNorm scales have both signs). The watch of the first
call (:mod:`~tdhook.attribution._nonlinear_calls`) notes such calls, and :func:`report_unmerged_norms` warns of them
(or, with a ``strict`` mapper, refuses them). Where the layer's rule is the plain gradient or near it (LRP-0, an ε up
to the presets' default ``1e-6``, the transformer presets' layers), merged or not is the same relevance: nothing is
said.

Examples:
    >>> from torch import nn
    >>> found = {"": {"batch_norm on the output of layer 'conv' (AlphaBetaRule)": 1}}
    >>> report_unmerged_norms(found, {"": nn.Identity()}, strict=True)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ValueError: LRP: the model itself (Identity) computes batch_norm ... 'conv' (AlphaBetaRule): it is not merged ...
    >>> layer_rules_merging([])
    {}
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from tdhook.attribution._unmapped_layers import NEGLIGIBLE_EPSILON
from tdhook.attribution.coverage import PlainGradientCall
from tdhook.attribution.mappers.aliases import module_place
from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules._layers import LINEAR_LAYERS
from tdhook.attribution.rules.base import RemovableRuleHandle, _reaches_model_input
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule
from tdhook.attribution.rules.batch_norm import is_batch_norm
from tdhook.attribution.rules.input_layer import FirstLayerRule

__all__ = ["layer_rules_merging", "merging_rule", "report_unmerged_norms"]


def layer_rules_merging(handles: Iterable[RemovableRuleHandle]) -> dict[int, Any]:
    """``id`` of each Linear or convolution layer → its rule, for the layers whose rule would merge a BatchNorm
    module after them and is not (near) the plain gradient (see :func:`merging_rule`): where a BatchNorm left
    unmerged changes the relevance."""
    rules = {}
    for handle in handles:
        rule = handle.rule
        parts = (rule.first, rule.other) if isinstance(rule, FirstLayerRule) else (rule,)
        if isinstance(handle.module, LINEAR_LAYERS) and any(_merging(part) for part in parts):
            rules[id(handle.module)] = rule
    return rules


def merging_rule(rule: Any, args: tuple) -> Any:
    """The rule that acts on a layer called with ``args``, if it would merge a BatchNorm module after the layer and
    is not (near) the plain gradient, else ``None``. A preset's first-layer rule is resolved as it is at the call:
    its first rule where the model's input reaches the layer through no other layer.

    Examples:
        >>> from tdhook.attribution.rules import AlphaBetaRule, EpsilonRule
        >>> type(merging_rule(AlphaBetaRule(1.0, 0.0), ())).__name__, merging_rule(EpsilonRule(1e-9), ())
        ('AlphaBetaRule', None)
    """
    if isinstance(rule, FirstLayerRule):
        first = bool(args) and isinstance(args[0], torch.Tensor) and _reaches_model_input(args[0])
        rule = rule.first if first else rule.other
    return rule if _merging(rule) else None


def _merging(rule: Any) -> bool:
    if not getattr(rule, "merges_batch_norm", False) or isinstance(rule, IgnoreRule):
        return False
    return not (type(rule) is EpsilonRule and rule.epsilon <= NEGLIGIBLE_EPSILON)


def _unmapped_message(where: str, kind: str, layers: str) -> str:
    """The warning for a BatchNorm module that the rule mapper gave no rule (a function of one's own as the mapper
    gets none of :class:`~tdhook.attribution.mappers.base.BaseRuleMapper`'s defaults)."""
    return (
        f"LRP: {where} ({kind}) has no rule (the rule mapper gave it none), so it is not merged into the output of "
        f"{layers}: the layer's rule acts on the layer alone and the batch norm keeps its plain gradient, which "
        "differs from the relevance of the presets and of zennit's canonizers. Map it to MergeBatchNormRule, or "
        "pass a mapping function as BaseRuleMapper(rule_mapper=function), whose defaults merge it (a function alone "
        "gets none of them); lrp.coverage() lists every such call"
    )


def report_unmerged_norms(
    found: Mapping[str, Mapping[str, int]], modules: Mapping[str, nn.Module], strict: bool
) -> tuple[PlainGradientCall, ...]:
    """Warn of (or, ``strict``, refuse) the unmerged batch norms in ``found`` (module name →
    ``"batch_norm on the output of layer '<name>' (<rule>)"`` → calls); those calls.

    Raises:
        ValueError: ``strict``, and such a call.
    """
    calls = []
    for name, functions in found.items():
        module = modules.get(name)
        kind = type(module).__name__ if module is not None else "?"
        where = module_place(name, modules)
        calls += [PlainGradientCall(name, kind, function, count) for function, count in functions.items()]
        layers = " and of ".join(function.split(" of ", 1)[1] for function in functions)
        message = (
            _unmapped_message(where, kind, layers)
            if module is not None and is_batch_norm(module)
            else f"LRP: {where} ({kind}) computes batch_norm with F.batch_norm, outside a BatchNorm module, on the "
            f"output of {layers}: it is not merged into the layer, so the layer's rule acts on the layer alone and "
            "the batch norm keeps its plain gradient, which differs from the relevance of the same model with the "
            "BatchNorm as a module. Keep the BatchNorm a module (in a torch.fx trace, a leaf module), or fold it into "
            "the layer's weights; lrp.coverage() lists every such call"
        )
        if strict:
            raise ValueError(message)
        warn_at_caller(message)
    return tuple(calls)
