"""The transformer presets: AttnLRP and CP-LRP, over a whole model, functional calls included."""

from __future__ import annotations

from typing import Unpack

from torch import nn

from tdhook.attribution.mappers.base import BaseRuleMapper, PresetOptions
from tdhook.attribution.rules._arguments import nonnegative
from tdhook.attribution.rules._layers import ACTIVATIONS, AVG_POOLS, GATES
from tdhook.attribution.rules.basic import EpsilonRule
from tdhook.attribution.rules.batch_norm import is_batch_norm
from tdhook.attribution.rules.elementwise import ElementwiseRule
from tdhook.attribution.rules.functional import FunctionalRules
from tdhook.attribution.rules.gates import GateRule
from tdhook.attribution.rules.normalization import is_norm
from tdhook.attribution.rules.transformer import (
    AHQKVRule,
    LayerNormRule,
    PseudoIdentityRule,
    SoftmaxEpsilonRule,
)
from tdhook.attribution.tunables import EPSILON

__all__ = ["AttnLRP", "CPLRP"]

# The attention implementations of Hugging Face models whose operations the function rules see and rewrite.
_FOLLOWED_ATTENTION = frozenset({None, "eager", "sdpa"})


def _check_attention_implementation(model: nn.Module) -> None:
    """Raise where a Hugging Face model's config names an attention implementation the rules cannot follow
    (a flash, flex or hub kernel: one fused call whose inside no rule reaches)."""
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        implementation = getattr(config, "_attn_implementation", None)
        if implementation in _FOLLOWED_ATTENTION or not isinstance(implementation, str):
            continue
        raise ValueError(
            f"LRP: module {name or 'the model'!r} ({type(module).__name__}) computes attention with "
            f"{implementation!r}, which the transformer rules cannot follow; they need the eager or sdpa "
            'implementation: load the model with attn_implementation="eager" (or "sdpa"), or call '
            'model.set_attn_implementation("eager") before explaining it'
        )


def _is_hf_activation(module: nn.Module) -> bool:
    return type(module).__module__.startswith("transformers.activations")


def _is_hf_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers")


class AttnLRP(BaseRuleMapper):
    """AttnLRP for transformers (Achtibat et al., 2024), as LXT computes it.

    Linear layers (and Hugging Face's ``Conv1D``) and average pooling: LRP-0,
    or LRP-ε with ``epsilon``; LayerNorm/RMSNorm: :class:`LayerNormRule`; activations, hand-written ones
    included (a module without parameters whose first call shows it element-wise, as Bloom's ``BloomGelu``):
    :class:`PseudoIdentityRule`; softmax: :class:`SoftmaxEpsilonRule`; the
    products in attention (``q · kᵀ``, ``attention · v``, fused
    ``scaled_dot_product_attention`` included) and gates of two signals (``silu(g) * up``): the uniform rule;
    sigmoid-like gates (squeeze-excite) are held constant, as CP-LRP holds them.
    Works on ``nn.MultiheadAttention``, ``nn.TransformerEncoder`` and Hugging
    Face models with no change to their code.

    Args:
        epsilon: ε of the Linear layers (``None``: LRP-0, as LXT).
        softmax_epsilon: ε of :class:`SoftmaxEpsilonRule`.
        **options: ``stabilizer`` (of the other rules), ``rule_mapper``, ``strict`` and
            ``stabilize_additions``, as for :class:`~tdhook.attribution.mappers.base.BaseRuleMapper`.

    Examples:
        >>> layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        >>> rules = AttnLRP().rules(layer)
        >>> type(rules["norm1"]).__name__, type(rules["linear1"]).__name__
        ('LayerNormRule', 'IgnoreRule')
    """

    tunables = {"epsilon": EPSILON}
    set_when_built = frozenset({"stabilizer", "softmax_epsilon"})

    def __init__(
        self, epsilon: float | None = None, softmax_epsilon: float = 0.0, **options: Unpack[PresetOptions]
    ) -> None:
        if epsilon is not None:
            nonnegative(type(self).__name__, "epsilon", epsilon)
        nonnegative(type(self).__name__, "softmax_epsilon", softmax_epsilon)
        super().__init__(**options)
        self.epsilon = epsilon
        self._dense = None if epsilon is None else EpsilonRule(epsilon)
        if self._dense is not None:  # the function rules below hold the norms a Linear layer's forward calls
            self._dense.norms_ruled = True
        self._softmax: SoftmaxEpsilonRule = SoftmaxEpsilonRule(softmax_epsilon)
        self._identity = PseudoIdentityRule()
        self._elementwise = ElementwiseRule(self._identity)
        self._gate_identity = GateRule(stabilizer=self._identity.stabilizer)
        self._norm_rule = LayerNormRule(epsilon=self.stabilizer)

    def layer_rule(self, name, module):
        # Average pooling of tokens (Swin's pooler) is a linear map like the others: LRP-0 unless ε is asked for.
        if isinstance(module, (nn.Linear, *AVG_POOLS)) or _is_hf_conv1d(module):
            return self._dense or self._ignore
        return None

    def default_rule(self, name, module):
        if is_norm(module) and not is_batch_norm(module):
            return self._norm_rule
        if isinstance(module, nn.Softmax):
            return self._softmax
        if isinstance(module, GATES):
            return self._gate_identity  # a sigmoid-like gate: the identity rule, its output marked as a gate
        if isinstance(module, ACTIVATIONS) or _is_hf_activation(module):
            return self._identity
        if type(module).__name__.endswith("RotaryEmbedding"):
            return self._ignore  # cos/sin tables from positions: no relevance flows through them
        return super().default_rule(name, module)

    def rules(self, model: nn.Module) -> dict:
        """The rule of every module of ``model`` (see :meth:`BaseRuleMapper.rules`), after checking that a
        Hugging Face model computes its attention in a way the function rules follow (eager or sdpa)."""
        _check_attention_implementation(model)
        return super().rules(model)

    def function_modes(self) -> list:
        hold_gates = isinstance(self._softmax, AHQKVRule)
        return [*self.addition_modes(), FunctionalRules(self._softmax, self._identity, hold_gates, self._dense)]


class CPLRP(AttnLRP):
    """CP-LRP (Ali et al., 2022): :class:`AttnLRP` with attention weights and gates held constant.

    Relevance reaches the tokens through the value path only (:class:`AHQKVRule`).
    Gates are held constant too, as LXT's CP-LRP does: where an activation's
    output multiplies another activation (the ``act(gate(x)) * up(x)`` of a
    gated MLP), all relevance goes to the other factor. With ``epsilon`` → 0
    and ReLU activations this equals gradient × input of the model with its
    attention weights, gates and normalising scales detached.

    Examples:
        >>> type(CPLRP().function_modes()[0].softmax).__name__
        'AHQKVRule'
    """

    def __init__(self, epsilon: float | None = None, **options: Unpack[PresetOptions]) -> None:
        super().__init__(epsilon, 0.0, **options)
        self._softmax = AHQKVRule()
