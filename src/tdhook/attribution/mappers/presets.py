"""The CNN presets, written as data: which rule each kind of Linear or convolution layer gets.

Each preset is a :class:`Preset` with two tables of ``(layer types, rule factory)``:
``layer_rules`` for every Linear and convolution layer, and ``first_layer_rules`` for
the layers the model's input reaches first. A factory is called once, with the
preset, so that it can read the preset's parameters (``epsilon``, ``stabilizer``,
and a subclass's own such as ``gamma``). Everything else (activations, pooling,
norms) gets :class:`~tdhook.attribution.mappers.base.BaseRuleMapper`'s defaults.

* :class:`EpsilonPlus`: z⁺ on convolutions, ε on Linear (zennit's ``EpsilonPlus``);
* :class:`EpsilonPlusFlat`: the same with Flat on the first layer;
* :class:`EpsilonAlpha2Beta1`: α2β1 on convolutions, ε on Linear;
* :class:`EpsilonAlpha2Beta1Flat`: the same with Flat on the first layer;
* :class:`EpsilonGammaBox`: γ on convolutions, ε on Linear, z^B on the first convolution;
* :class:`UniformEpsilon`: ε on Linear and convolutions alike (pnpxai's ``LRPUniformEpsilon``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar, Unpack

import torch
from torch import nn

from tdhook.attribution.mappers.base import BaseRuleMapper, PresetOptions
from tdhook.attribution.rules._arguments import bounds, nonnegative
from tdhook.attribution.rules._layers import CONVOLUTIONS, LINEAR_LAYERS
from tdhook.attribution.rules.base import Rule
from tdhook.attribution.rules.basic import EpsilonRule, RefuseRule
from tdhook.attribution.rules.input_layer import FlatRule, ZBoxRule
from tdhook.attribution.rules.modified import AlphaBetaRule, GammaRule
from tdhook.attribution.tunables import EPSILON, GAMMA

__all__ = [
    "Preset",
    "EpsilonPlus",
    "EpsilonPlusFlat",
    "EpsilonAlpha2Beta1",
    "EpsilonAlpha2Beta1Flat",
    "EpsilonGammaBox",
    "UniformEpsilon",
]

RuleFactory = Callable[["Preset"], Rule]
RuleTable = tuple[tuple[tuple[type[nn.Module], ...], RuleFactory], ...]


class Preset(BaseRuleMapper):
    """A rule mapper given by tables of ``(layer types, rule factory)``; the first matching entry wins.

    Args:
        epsilon: ε of the dense (Linear) layers.
        stabilizer: stabilizer of the other rules.
        rule_mapper: the user's mapper, consulted first (see :class:`BaseRuleMapper`).
        strict: raise on a leaf module that gets no rule.
        stabilize_additions: ε-stabilise residual sums.

    Examples:
        >>> class EpsilonEverywhere(Preset):
        ...     layer_rules = ((LINEAR_LAYERS, lambda preset: EpsilonRule(preset.epsilon)),)
        >>> EpsilonEverywhere(epsilon=0.1)("conv", nn.Conv2d(1, 1, 3))
        EpsilonRule(epsilon=0.1)
    """

    layer_rules: ClassVar[RuleTable] = ()
    first_layer_rules: ClassVar[RuleTable] = ()
    tunables = {"epsilon": EPSILON}

    def __init__(self, epsilon: float = 1e-6, **options: Unpack[PresetOptions]) -> None:
        nonnegative(type(self).__name__, "epsilon", epsilon)
        super().__init__(**options)
        self.epsilon = epsilon
        self._layer_table = [(types, make(self)) for types, make in self.layer_rules]
        self._first_layer_table = [(types, make(self)) for types, make in self.first_layer_rules]
        self._refuse_attention = RefuseRule(
            f"{type(self).__name__} has no rule for attention, whose weights would keep their plain gradient and "
            "create or lose relevance; explain attention models with CPLRP (conserving) or AttnLRP, or map this "
            "module to a rule in rule_mapper"
        )

    def default_rule(self, name: str, module: nn.Module) -> Rule | None:
        if isinstance(module, nn.MultiheadAttention):
            return self._refuse_attention
        return super().default_rule(name, module)

    @staticmethod
    def _lookup(table: list[tuple[tuple[type, ...], Rule]], module: nn.Module) -> Rule | None:
        return next((rule for types, rule in table if isinstance(module, types)), None)

    def layer_rule(self, name: str, module: nn.Module) -> Rule | None:
        return self._lookup(self._layer_table, module)

    def first_layer_rule(self, name: str, module: nn.Module) -> Rule | None:
        return self._lookup(self._first_layer_table, module)


_DENSE_EPSILON: RuleTable = (((nn.Linear,), lambda preset: EpsilonRule(epsilon=preset.epsilon)),)
_FLAT_FIRST: RuleTable = ((LINEAR_LAYERS, lambda preset: FlatRule(stabilizer=preset.stabilizer)),)


class EpsilonPlus(Preset):
    """z⁺ on convolutions, ε on dense layers (zennit's ``EpsilonPlus``).

    Examples:
        >>> mapper = EpsilonPlus(epsilon=1e-3)
        >>> mapper("conv", nn.Conv2d(1, 1, 3)), mapper("fc", nn.Linear(2, 2))
        (AlphaBetaRule(stabilizer=1e-06, zero_params=(), alpha=1.0, beta=0.0), EpsilonRule(epsilon=0.001))
    """

    layer_rules = (
        (CONVOLUTIONS, lambda preset: AlphaBetaRule(alpha=1.0, beta=0.0, stabilizer=preset.stabilizer)),
        *_DENSE_EPSILON,
    )


class EpsilonPlusFlat(EpsilonPlus):
    """:class:`EpsilonPlus` with :class:`~tdhook.attribution.rules.input_layer.FlatRule` on the first layer
    (zennit's ``EpsilonPlusFlat``).

    Examples:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> rules = EpsilonPlusFlat().rules(model)
        >>> rules["0"].first, rules["0"].other, rules["1"]
        (FlatRule(stabilizer=1e-06, zero_params=()), EpsilonRule(epsilon=1e-06), PassRule(stabilizer=1e-12))
    """

    first_layer_rules = _FLAT_FIRST


class EpsilonAlpha2Beta1(Preset):
    """αβ with ``α = 2, β = 1`` on convolutions, ε on dense layers (zennit's ``EpsilonAlpha2Beta1``).

    Examples:
        >>> EpsilonAlpha2Beta1()("conv", nn.Conv1d(1, 1, 3)).alpha
        2.0
    """

    layer_rules = (
        (CONVOLUTIONS, lambda preset: AlphaBetaRule(alpha=2.0, beta=1.0, stabilizer=preset.stabilizer)),
        *_DENSE_EPSILON,
    )


class EpsilonAlpha2Beta1Flat(EpsilonAlpha2Beta1):
    """:class:`EpsilonAlpha2Beta1` with :class:`~tdhook.attribution.rules.input_layer.FlatRule` on the first layer.

    Examples:
        >>> model = nn.Sequential(nn.Conv1d(1, 2, 3), nn.ReLU(), nn.Conv1d(2, 1, 3))
        >>> [type(r).__name__ for r in EpsilonAlpha2Beta1Flat().rules(model).values()]
        ['FirstLayerRule', 'PassRule', 'FirstLayerRule']
    """

    first_layer_rules = _FLAT_FIRST


class EpsilonGammaBox(Preset):
    """z^B on the first convolution, γ on the others, ε on dense layers (zennit's ``EpsilonGammaBox``).

    Args:
        low: lowest input value (float or tensor broadcastable to one sample, aligned on its last dimension:
            per-channel bounds of an image are of shape ``[C, 1, 1]``; a 1-D tensor bounds the last dimension, and
            a convolution whose input is as wide as it has channels warns of one of length ``C``; see
            :class:`~tdhook.attribution.rules.input_layer.ZBoxRule`).
        high: highest input value.
        epsilon: ε of the dense layers.
        gamma: γ of the convolutions.
        **options: ``stabilizer``, ``rule_mapper``, ``strict`` and ``stabilize_additions``, as for :class:`Preset`.

    Examples:
        >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.LazyLinear(2))
        >>> [type(r).__name__ for r in EpsilonGammaBox(-3.0, 3.0).rules(model).values()]
        ['FirstLayerRule', 'PassRule', 'FirstLayerRule', 'IgnoreRule', 'EpsilonRule']
    """

    tunables = {"epsilon": EPSILON, "gamma": GAMMA}
    set_when_built = frozenset({"stabilizer", "low", "high"})

    layer_rules = (
        (CONVOLUTIONS, lambda preset: GammaRule(gamma=preset.gamma, stabilizer=preset.stabilizer)),
        *_DENSE_EPSILON,
    )
    first_layer_rules = (
        (CONVOLUTIONS, lambda preset: ZBoxRule(preset.low, preset.high, stabilizer=preset.stabilizer)),
    )

    def __init__(
        self,
        low: float | torch.Tensor,
        high: float | torch.Tensor,
        epsilon: float = 1e-6,
        gamma: float = 0.25,
        **options: Unpack[PresetOptions],
    ) -> None:
        bounds(type(self).__name__, low, high)
        nonnegative(type(self).__name__, "gamma", gamma)
        self.low, self.high, self.gamma = low, high, gamma
        super().__init__(epsilon, **options)


class UniformEpsilon(Preset):
    """One ε-rule on every Linear and convolution layer, the defaults elsewhere (pnpxai's ``LRPUniformEpsilon``).

    Activations pass relevance on, average pooling and the other defaults use
    ``stabilizer`` (see :class:`~tdhook.attribution.mappers.base.BaseRuleMapper`), BatchNorm is merged into the
    layer before it, and LSTM and GRU layers get the recurrent rule. This is zennit's ``LayerMapComposite`` of
    ``Epsilon(epsilon)`` on Linear and convolutions with ``layer_map_base(stabilizer)``. ``nn.MultiheadAttention``
    is refused, as by the other CNN presets; attention written in a module's own forward (timm's ``BottleneckAttn``
    or ``HaloAttn``) keeps its plain gradient, with a warning naming the module (an error with ``strict=True``).
    :class:`~tdhook.attribution.mappers.transformer.AttnLRP` with the same ``epsilon`` is ε on the Linear layers
    with the transformer rules.

    Args:
        epsilon: ε of the Linear and convolution layers.
        stabilizer: stabilizer of the other rules.
        **options: ``rule_mapper``, ``strict`` and ``stabilize_additions``, as for :class:`Preset`.

    Examples:
        >>> mapper = UniformEpsilon()
        >>> mapper("conv", nn.Conv2d(1, 1, 3)), mapper("fc", nn.Linear(2, 2)), mapper("act", nn.ReLU())
        (EpsilonRule(epsilon=0.25), EpsilonRule(epsilon=0.25), PassRule(stabilizer=1e-12))
    """

    layer_rules = ((LINEAR_LAYERS, lambda preset: EpsilonRule(epsilon=preset.epsilon)),)

    def __init__(self, epsilon: float = 0.25, stabilizer: float = 1e-6, **options: Unpack[PresetOptions]) -> None:
        super().__init__(epsilon, stabilizer=stabilizer, **options)
