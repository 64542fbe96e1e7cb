"""Rule mappers: the protocol the LRP wrapper asks of them, the dict form, and ``BaseRuleMapper``'s defaults.

A rule mapper chooses the rule of each module: ``(name, module) -> Rule | None``.
:class:`BaseRuleMapper` consults the user's mapper first, then a preset's layer
rules, then the defaults for activations, pooling, norms and shape modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from fnmatch import fnmatchcase
from typing import Any, ClassVar, Protocol, TypedDict

from torch import nn
from torchrl.modules import BatchRenorm1d, TanhModule

from tdhook.attribution.mappers.aliases import module_aliases, user_rule
from tdhook.attribution.mappers.foreign_rules import not_a_rule
from tdhook.attribution.rules._arguments import nonnegative
from tdhook.attribution.rules._caller import warn_at_caller
from tdhook.attribution.rules._layers import (
    ACTIVATIONS,
    AVG_POOLS,
    GATES,
    GRADIENT_ROUTED,
    GRADIENT_ROUTED_NAMES,
    GRADIENT_ROUTED_SUFFIXES,
    LINEAR_LAYERS,
)
from tdhook.attribution.rules.activation_calls import SafeTanhCallsRule, TanhCallsRule, samples_a_safe_tanh
from tdhook.attribution.rules.additions import StabilizedAdditions
from tdhook.attribution.rules.base import Rule
from tdhook.attribution.rules.basic import EpsilonRule, IgnoreRule, PassRule
from tdhook.attribution.rules.batch_norm import MergeBatchNormRule, is_batch_norm
from tdhook.attribution.rules.cond_conv import CondConvRule, is_cond_conv
from tdhook.attribution.rules.elementwise import ElementwiseRule, may_be_elementwise
from tdhook.attribution.rules.gates import GateRule, HeldGates
from tdhook.attribution.rules.input_layer import FirstLayerRule
from tdhook.attribution.rules.normalization import BatchRenormRule, NormRule, is_norm
from tdhook.attribution.rules.quantized import QuantizedLinearRule, holds_packed_weights, is_quantized_linear
from tdhook.attribution.rules.recurrent import RecurrentRule, is_recurrent
from tdhook.attribution.rules.routers import RouterRule, is_router, is_router_layer
from tdhook.attribution.tunables import Tunable, _record

__all__ = ["RuleMapper", "rule_mapper_from_dict", "PresetOptions", "BaseRuleMapper"]

# Sigmoid-like modules of other libraries, by class name (timm's ``Sigmoid`` and ``HardSigmoid``).
_GATE_NAMES = frozenset({"Sigmoid", "HardSigmoid", "Hardsigmoid", "GateSigmoid"})
# Element-wise activations timm defines beside its models, with a learnt scale and shift, by module and class name:
# MetaFormer's ``StarReLU`` (``s * relu(x) ** 2 + b``) and ``SquaredReLU``.
_TIMM_MODEL_ACTIVATIONS = {"timm.models.metaformer": frozenset({"StarReLU", "SquaredReLU"})}
# timm's EvoNorms (``x * sigmoid(v * x) / group_std(x) * w + b`` and the like): a gate and a normalising scale on
# ``x`` in one module, which no norm rule holds; relevance passes through them as through an un-merged norm.
_TIMM_EVO_NORMS = ("timm.layers.evo_norm", "EvoNorm")


class RuleMapper(Protocol):
    """What the LRP wrapper asks of a rule mapper: the rule for one module, or ``None`` for the plain gradient.

    Any callable ``(name, module) -> Rule | None`` is one, a plain function included. A mapper that also has
    ``rules(model)`` (as :class:`BaseRuleMapper`) is asked for all rules at once, and one with
    ``function_modes()`` gives the ``TorchFunctionMode``\\ s the forward pass runs in.

    Examples:
        >>> from tdhook.attribution.rules import StopRule
        >>> def stop_the_head(name: str, module: nn.Module) -> Rule | None:
        ...     return StopRule() if name == "head" else None
        >>> stop_the_head("head", nn.Linear(2, 2))
        StopRule()
    """

    def __call__(self, name: str, module: nn.Module) -> Rule | None: ...


def rule_mapper_from_dict(mapping: Mapping[type | tuple[type, ...] | str, Rule]) -> RuleMapper:
    """A rule mapper from a dict keyed by module type(s) or by name pattern.

    String keys match module names with shell-style wildcards (``"features.*"``);
    type keys match with ``isinstance``. The first matching entry, in the
    dict's order, wins. A module the model holds under several names
    (``self.a = self.b = layer``, a layer shared by two blocks) matches a
    string key by any of them.

    Examples:
        >>> from tdhook.attribution.rules import EpsilonRule, StopRule
        >>> mapper = rule_mapper_from_dict({"head": StopRule(), nn.Linear: EpsilonRule(0.25)})
        >>> mapper("head", nn.Linear(2, 2)), mapper("body.0", nn.Linear(2, 2)), mapper("act", nn.Tanh())
        (StopRule(), EpsilonRule(epsilon=0.25), None)
    """
    return _DictRuleMapper(mapping)


class _DictRuleMapper:
    """The mapper :func:`rule_mapper_from_dict` makes: a class, not a closure, so that a wrapper holding it pickles
    (``torch.save``, a collector's worker processes)."""

    def __init__(self, mapping: Mapping[type | tuple[type, ...] | str, Rule]) -> None:
        entries = list(mapping.items())
        for key, rule in entries:
            if not isinstance(rule, Rule):
                raise TypeError(f"rule mapping entry {key!r} must map to a Rule; it maps to {not_a_rule(rule)}")
        self.entries = tuple(entries)  # checked by the wrapper: an entry every module of which an earlier one takes
        self.name_patterns = tuple(key for key, _ in entries if isinstance(key, str))  # checked by the wrapper

    def entry_of(self, name: str, module: nn.Module) -> tuple[int, Rule] | None:
        """The first entry matching the module, with its position (a module of several names takes the first entry
        of any)."""
        for index, (key, rule) in enumerate(self.entries):
            if fnmatchcase(name, key) if isinstance(key, str) else isinstance(module, key):
                return index, rule
        return None

    def __call__(self, name: str, module: nn.Module) -> Rule | None:
        match = self.entry_of(name, module)
        return None if match is None else match[1]


def _refuse_unmappable(owner: str, rule_mapper: object) -> None:
    """Refuse a ``rule_mapper`` that is neither a callable, a dict nor ``None``, naming ``owner``."""
    if rule_mapper is not None and not callable(rule_mapper) and not isinstance(rule_mapper, Mapping):
        raise TypeError(
            f"{owner}: rule_mapper must be a callable (name, module) -> Rule | None, a dict or None, got "
            f"{type(rule_mapper).__name__}"
        )


class PresetOptions(TypedDict, total=False):
    """The keyword options every preset shares with :class:`BaseRuleMapper` (its arguments after ``stabilizer``
    are described there).

    Examples:
        >>> from tdhook.attribution import EpsilonPlus
        >>> options: PresetOptions = {"stabilizer": 1e-9, "strict": True}
        >>> preset = EpsilonPlus(**options)
        >>> preset.stabilizer, preset.strict
        (1e-09, True)
    """

    stabilizer: float
    rule_mapper: RuleMapper | Mapping | None
    strict: bool
    stabilize_additions: bool


class BaseRuleMapper(Tunable):
    """Map ``(name, module)`` to a rule: the user's mapper first, then defaults.

    Defaults: routers of a mixture of experts → :class:`~tdhook.attribution.rules.gates.RouterRule` (routing
    weights held constant); timm's CondConv layers → :class:`~tdhook.attribution.rules.cond_conv.CondConvRule`
    (routing weights held, the mapper's convolution rule applied with each sample's kernel); dynamically quantized
    Linear layers → :class:`~tdhook.attribution.rules.quantized.QuantizedLinearRule` (the ε-rule with
    ``stabilizer`` on the dequantized weight); LSTM and GRU layers and cells →
    :class:`~tdhook.attribution.rules.recurrent.RecurrentRule` (signal-take-all, with ``stabilizer`` as ε);
    sigmoid-like modules → :class:`~tdhook.attribution.rules.gates.GateRule`
    (held constant where they gate a signal); other activations → :class:`PassRule`; torchrl's ``TanhModule`` →
    :class:`~tdhook.attribution.rules.activation_calls.TanhCallsRule` (the pass rule on its ``tanh``); a
    probabilistic module sampling from a ``TanhNormal`` or a ``TanhDelta`` →
    :class:`~tdhook.attribution.rules.activation_calls.SafeTanhCallsRule` (the pass rule on their ``safetanh``);
    average pooling modules → :class:`EpsilonRule` with ``stabilizer`` (zennit's ``Norm``; an average pool
    called as a function, ``F.avg_pool2d`` or ``F.adaptive_avg_pool2d``, keeps its plain gradient, LRP-0, as in
    zennit, which finds no module there: the two forms differ by about ``stabilizer / |z|`` at a pooled output
    ``z``);
    BatchNorm (and frozen ones, torchvision's ``FrozenBatchNorm2d``) → :class:`MergeBatchNormRule`
    (merged into the layer before it, else the ε-rule of its affine map); torchrl's BatchRenorm1d →
    :class:`~tdhook.attribution.rules.normalization.BatchRenormRule` (the ε-rule of its affine map); other
    norms (LayerNorm, GroupNorm, RMSNorm, channels-first and fused norms) →
    :class:`NormRule` (the normalising scale held constant); Linear and
    convolution layers, MaxPool, Dropout, Flatten, Unflatten, Identity →
    :class:`IgnoreRule`; other modules without parameters or children →
    :class:`~tdhook.attribution.rules.elementwise.ElementwiseRule` (the pass
    rule where the module's first call shows it element-wise: a hand-written
    activation). Other modules get no rule (plain gradient).
    Subclasses add Linear/Conv rules in :meth:`layer_rule` and a special first
    layer in :meth:`first_layer_rule`, applied by :class:`FirstLayerRule` to
    the layers the model's input reaches first.

    Args:
        stabilizer: stabilizer of the default rules.
        rule_mapper: ``(name, module) -> Rule | None`` consulted first, or a dict
            for :func:`rule_mapper_from_dict`. A rule it gives wins over the preset's, on the first layer too: a
            type entry ``{nn.Conv2d: GammaRule(0.5)}`` under :class:`~tdhook.attribution.EpsilonGammaBox` puts γ on
            the first convolution in place of z^B (zennit's composites keep their first-layer rule over a
            ``layer_map`` entry). To change the preset's rules and keep its first layer, set its own parameters
            (``EpsilonGammaBox(low, high, gamma=0.5)``), or name the first layer with the rule it should keep.
        strict: raise, naming the module, where a module's own forward computes a function that is not
            piecewise linear and that no rule covers, rather than warn that its plain gradient is used. The
            wrapper decides it from what the first forward pass really calls (see
            :meth:`~tdhook.attribution.LRP.coverage`), not from class names: containers and modules that only
            reshape, pad or scale need no rule.
        stabilize_additions: treat every addition of two activations (residual
            sums) as zennit's ``Sum`` under ``Norm(stabilizer)``, as its ResNet
            canonizer does, instead of splitting it exactly
            (see :class:`~tdhook.attribution.rules.additions.StabilizedAdditions`).

    Examples:
        >>> from tdhook.attribution.rules import StopRule
        >>> mapper = BaseRuleMapper(rule_mapper=lambda name, m: StopRule() if name == "head" else None)
        >>> mapper("head", nn.Linear(2, 2)), mapper("act", nn.Tanh()), mapper("fc", nn.Linear(2, 2))
        (StopRule(), PassRule(stabilizer=1e-12), IgnoreRule())
    """

    #: Constructor arguments, besides the tunables, that the mapper's rules take when it is built.
    set_when_built: ClassVar[frozenset[str]] = frozenset({"stabilizer"})

    def __setattr__(self, name: str, value: Any) -> None:
        # A mapper's rules take these values when it is built: set afterwards, a value would reach none of them
        # (the relevance unchanged, and tune starting from the old value).
        if (name in self.tunables or name in self.set_when_built) and not self._being_built():
            how = f"set_kwargs({name}=...), which builds them anew" if name in self.tunables else "the constructor"
            raise AttributeError(
                f"{type(self).__name__}: {name} is read when the mapper is built (its rules hold it); set it with "
                f"{how}, or build another {type(self).__name__}"
            )
        if name == "rule_mapper" and not self._being_built():
            # As the constructor takes it: a dict stands for the mapper it makes (recorded as given).
            _refuse_unmappable(type(self).__name__, value)
            _record(self, name, value)
            object.__setattr__(self, name, rule_mapper_from_dict(value) if isinstance(value, Mapping) else value)
            return
        super().__setattr__(name, value)

    def __init__(
        self,
        stabilizer: float = 1e-6,
        rule_mapper: RuleMapper | Mapping | None = None,
        strict: bool = False,
        stabilize_additions: bool = False,
    ) -> None:
        nonnegative(type(self).__name__, "stabilizer", stabilizer)
        _refuse_unmappable(type(self).__name__, rule_mapper)
        self.stabilizer = stabilizer
        self.strict = strict
        self.stabilize_additions = stabilize_additions
        self.rule_mapper = rule_mapper_from_dict(rule_mapper) if isinstance(rule_mapper, Mapping) else rule_mapper
        self._pass = PassRule()
        self._elementwise = ElementwiseRule(self._pass)
        self._gate = GateRule()
        self._tanh_calls = TanhCallsRule()
        self._safe_tanh_calls = SafeTanhCallsRule()
        self._router = RouterRule()
        self._quantized_linear = QuantizedLinearRule(epsilon=stabilizer)
        self._recurrent = RecurrentRule(epsilon=stabilizer)
        self._norm = EpsilonRule(epsilon=stabilizer)
        self._ignore = IgnoreRule()
        self._ignore._plain_inside = False  # modules nothing inside which a function mode changes
        self._merge_batch_norm = MergeBatchNormRule(epsilon=stabilizer)
        self._norm_rule: NormRule = NormRule(epsilon=stabilizer)
        self._batch_renorm = BatchRenormRule(epsilon=stabilizer)
        self._first_layer_rules: dict[tuple[int, int], FirstLayerRule] = {}
        self._cond_conv_rules: dict[int, CondConvRule] = {}

    def function_modes(self) -> list:
        r"""``TorchFunctionMode``\ s the wrapper runs the forward pass in: rules for calls that are not modules.

        Where a sigmoid-like module has a :class:`~tdhook.attribution.rules.gates.GateRule`, gates are held
        constant in products (:class:`~tdhook.attribution.rules.gates.HeldGates`); residual sums are stabilised
        with ``stabilize_additions``. Models with neither run without a mode (``torch.compile`` traces them),
        but for the wrapper's first call: it runs in ``HeldGates`` to find gates computed by functions
        (``x * torch.sigmoid(fc(x))``), and holds them in every later call where it finds one.
        """
        gates = [HeldGates()] if self._gate.is_registered_anywhere() else []
        return [*self.addition_modes(), *gates]

    def addition_modes(self) -> list:
        """The mode for residual sums, when ``stabilize_additions`` asks for it."""
        return [StabilizedAdditions(self.stabilizer)] if self.stabilize_additions else []

    def __call__(self, name: str, module: nn.Module) -> Rule | None:
        if self.rule_mapper is not None:
            rule = self.rule_mapper(name, module)
            if rule is not None:
                return rule
        return self._own_rule(name, module)

    def _own_rule(self, name: str, module: nn.Module) -> Rule | None:
        """The preset's rule for ``module``: a router's first (it may be a ``Linear`` itself), then the layer rule,
        then the default."""
        if is_router(module):
            return self._router
        if is_cond_conv(module):
            return self._cond_conv_rule(name, module)
        return self.layer_rule(name, module) or self.default_rule(name, module)

    def _cond_conv_rule(self, name: str, module: nn.Module) -> CondConvRule:
        """A CondConv layer's rule: its routing weights held, and the rule this mapper gives a ``Conv2d`` of its
        shape (LRP-0 where it gives none) applied with each sample's kernel."""
        rule = self.layer_rule(name, _conv_twin(module)) or self._ignore
        if id(rule) not in self._cond_conv_rules:
            try:
                self._cond_conv_rules[id(rule)] = CondConvRule(rule)
            except TypeError as error:
                raise TypeError(f"{type(self).__name__}: module {name!r} ({type(module).__name__}): {error}") from error
        return self._cond_conv_rules[id(rule)]

    def default_rule(self, name: str, module: nn.Module) -> Rule | None:
        """The rule for activations, pooling, norms, dropout, shape modules, routers and recurrent layers."""
        if is_router(module):
            return self._router
        if is_recurrent(module):
            return self._recurrent
        if is_quantized_linear(module):
            return self._quantized_linear
        if holds_packed_weights(module):
            return self._ignore  # a quantized layer's weight store: it never runs
        if isinstance(module, GATES) or type(module).__name__ in _GATE_NAMES:
            return self._gate
        if isinstance(module, ACTIVATIONS):
            return self._pass
        if isinstance(module, TanhModule):
            return self._tanh_calls
        if samples_a_safe_tanh(module):
            return self._safe_tanh_calls
        if is_batch_norm(module):  # a frozen one (torchvision's FrozenBatchNorm2d) included
            return self._merge_batch_norm
        if isinstance(module, BatchRenorm1d):
            return self._batch_renorm
        if is_norm(module):
            return self._norm_rule
        if isinstance(module, AVG_POOLS):
            return self._norm
        name_of_class = type(module).__name__
        if isinstance(module, (*GRADIENT_ROUTED, *LINEAR_LAYERS)) or name_of_class in GRADIENT_ROUTED_NAMES:
            return self._ignore
        if name_of_class.endswith(GRADIENT_ROUTED_SUFFIXES):
            return self._ignore
        if _is_timm_activation(module):
            return self._pass  # timm's own activation classes (GELU, Swish, HardSwish, StarReLU, ...)
        if type(module).__module__ == _TIMM_EVO_NORMS[0] and type(module).__name__.startswith(_TIMM_EVO_NORMS[1]):
            return self._pass  # timm's EvoNorms: an un-merged norm with a gate inside
        if name and may_be_elementwise(module):
            return self._elementwise  # a hand-written activation: the pass rule, where its first call proves it
        return None

    def layer_rule(self, name: str, module: nn.Module) -> Rule | None:
        """The rule for Linear and convolution layers (none here: LRP-0)."""
        return None

    def first_layer_rule(self, name: str, module: nn.Module) -> Rule | None:
        """The rule for the first Linear or convolution layer, when it differs from the others."""
        return None

    def rules(self, model: nn.Module) -> dict[str, Rule]:
        """The rule of every module of ``model`` that has one, by module name.

        Linear and convolution layers whose :meth:`first_layer_rule` differs
        from their rule get a :class:`FirstLayerRule` choosing between the two
        at each call. A module the user's mapper names keeps the user's rule.
        """
        rules: dict[str, Rule] = {}
        quantized: dict[str, Rule] = {}  # quantized Linear layers, and the first-layer rule they do not get
        modules = dict(model.named_modules())
        aliases = module_aliases(model) if self.rule_mapper is not None else {}
        for name, module in modules.items():
            if "parametrizations" in name.split("."):
                continue  # a weight's parametrization (weight_norm, spectral_norm) computes a weight, not activations
            rule = None
            if self.rule_mapper is not None:
                rule = user_rule(self.rule_mapper, name, module, aliases)  # asked under each of its names
            if rule is None and is_router_layer(name, module, modules.get(name.rpartition(".")[0])):
                rule = self._router  # a Linear a Hugging Face class holds as its router (Gemma 3n's AltUp)
            elif rule is None:
                rule = self._own_rule(name, module)
                is_layer = isinstance(module, LINEAR_LAYERS) and rule is not self._router
                first = self.first_layer_rule(name, module) if is_layer else None
                if first is not None and first is not rule:
                    rule = self._first_layer_switch(first, rule)
                elif (
                    rule is self._quantized_linear
                    and (first := self.first_layer_rule(name, _float_twin(module))) is not None
                ):
                    quantized[name] = first
            if rule is not None:
                rules[name] = rule
        if quantized:
            warn_at_caller(
                f"{type(self).__name__}: its first-layer rule ({type(next(iter(quantized.values()))).__name__}) is not "
                f"applied to dynamically quantized Linear layers ({', '.join(map(repr, quantized))}): where "
                "the model's input reaches one of them first, it gets QuantizedLinearRule (ε on its dequantized "
                "weight) instead. Keep the first layer a float nn.Linear (quantize_dynamic(model, {names of the "
                "others})) to have the first-layer rule there"
            )
        return rules

    def _first_layer_switch(self, first: Rule, other: Rule | None) -> FirstLayerRule:
        key = (id(first), id(other))
        if key not in self._first_layer_rules:
            self._first_layer_rules[key] = FirstLayerRule(first, other)
        return self._first_layer_rules[key]


def _float_twin(module: nn.Module) -> nn.Module:
    """A float ``nn.Linear`` of a quantized Linear's shape, on the meta device: what the mapper's first-layer rule
    is looked up for."""
    return nn.Linear(module.in_features, module.out_features, device="meta")


def _conv_twin(module: nn.Module) -> nn.Conv2d:
    """A ``Conv2d`` of a CondConv layer's shape, on the meta device: what the mapper's convolution rule is looked up
    for."""
    return nn.Conv2d(
        module.in_channels,
        module.out_channels,
        module.kernel_size,
        module.stride,
        dilation=module.dilation,
        groups=module.groups,
        bias=module.bias is not None,
        device="meta",
    )


def _is_timm_activation(module: nn.Module) -> bool:
    """Whether ``module`` is one of timm's element-wise activations: a class of ``timm.layers.activations*``, or
    one of those its models define (MetaFormer's ``StarReLU``), which have a scalar scale and shift of their own."""
    kind = type(module)
    return kind.__module__.startswith("timm.layers.activations") or (
        kind.__name__ in _TIMM_MODEL_ACTIVATIONS.get(kind.__module__, ())
    )
