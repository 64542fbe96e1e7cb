"""LRP rules: each changes the gradient through one module, so that ``relevance = input × modified gradient``.

One family of rules per module: :mod:`~tdhook.attribution.rules.base` (what a rule is),
:mod:`~tdhook.attribution.rules.basic` (ε, pass, ignore, stop, uniform),
:mod:`~tdhook.attribution.rules.modified` (αβ, z⁺, γ),
:mod:`~tdhook.attribution.rules.input_layer` (Flat, w², z^B and the first-layer switch),
:mod:`~tdhook.attribution.rules.batch_norm`, :mod:`~tdhook.attribution.rules.recurrent` (LSTM, GRU),
:mod:`~tdhook.attribution.rules.cond_conv` (timm's CondConv layers: routing held, each sample's kernel),
:mod:`~tdhook.attribution.rules.elementwise` (hand-written element-wise modules),
:mod:`~tdhook.attribution.rules.activation_calls` (``tanh`` inside a module's own forward: torchrl's ``TanhModule``),
:mod:`~tdhook.attribution.rules.taylor` (first-order Taylor at a reference point),
:mod:`~tdhook.attribution.rules.transformer`,
:mod:`~tdhook.attribution.rules.functional` (rules on function calls),
:mod:`~tdhook.attribution.rules.additions` (stabilised residual sums) and
:mod:`~tdhook.attribution.rules.checks`. :func:`redirect`, :func:`relevance_proxy`,
:func:`scale_gradient` and :func:`hold` are what a rule of one's own is written with (see the docs' page on
custom rules).
"""

from tdhook.attribution.rules._autograd import hold, redirect, relevance_proxy, scale_gradient
from tdhook.attribution.rules._glue import GlueError
from tdhook.attribution.rules._numerics import stabilize
from tdhook.attribution.rules.activation_calls import SafeTanhCallsRule, TanhCallsRule
from tdhook.attribution.rules.additions import StabilizedAdditions
from tdhook.attribution.rules.base import (
    LayerCall,
    MergedLayer,
    ParamModifier,
    Registration,
    RemovableRuleHandle,
    Rule,
    layer_call_of,
)
from tdhook.attribution.rules.basic import (
    EpsilonRule,
    IgnoreRule,
    PassRule,
    RefuseRule,
    StopRule,
    UniformEpsilonRule,
    UniformRule,
)
from tdhook.attribution.rules.batch_norm import MergeBatchNormRule
from tdhook.attribution.rules.checks import raise_for_unconserved_rel_factory
from tdhook.attribution.rules.cond_conv import CondConvRule
from tdhook.attribution.rules.elementwise import ElementwiseRule
from tdhook.attribution.rules.functional import FunctionalRules
from tdhook.attribution.rules.gates import GateRule, HeldGates
from tdhook.attribution.rules.input_layer import FirstLayerRule, FlatRule, WSquareRule, ZBoxRule
from tdhook.attribution.rules.modified import AlphaBetaRule, GammaRule
from tdhook.attribution.rules.normalization import BatchRenormRule, NormRule
from tdhook.attribution.rules.quantized import QuantizedLinearRule
from tdhook.attribution.rules.recurrent import RecurrentRule
from tdhook.attribution.rules.routers import RouterRule
from tdhook.attribution.rules.taylor import TaylorDecompositionRule
from tdhook.attribution.rules.transformer import (
    AHQKVRule,
    LayerNormRule,
    PseudoIdentityRule,
    SoftmaxEpsilonRule,
    uniform_product,
)

__all__ = [
    "GlueError",
    "stabilize",
    "redirect",
    "relevance_proxy",
    "scale_gradient",
    "hold",
    "ParamModifier",
    "RemovableRuleHandle",
    "Registration",
    "Rule",
    "LayerCall",
    "MergedLayer",
    "layer_call_of",
    "EpsilonRule",
    "UniformEpsilonRule",
    "PassRule",
    "ElementwiseRule",
    "TanhCallsRule",
    "SafeTanhCallsRule",
    "IgnoreRule",
    "StopRule",
    "UniformRule",
    "RefuseRule",
    "AlphaBetaRule",
    "GammaRule",
    "FlatRule",
    "WSquareRule",
    "ZBoxRule",
    "FirstLayerRule",
    "MergeBatchNormRule",
    "NormRule",
    "BatchRenormRule",
    "GateRule",
    "HeldGates",
    "RouterRule",
    "QuantizedLinearRule",
    "CondConvRule",
    "RecurrentRule",
    "TaylorDecompositionRule",
    "SoftmaxEpsilonRule",
    "LayerNormRule",
    "PseudoIdentityRule",
    "AHQKVRule",
    "uniform_product",
    "FunctionalRules",
    "StabilizedAdditions",
    "raise_for_unconserved_rel_factory",
]
