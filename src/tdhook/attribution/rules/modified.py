"""The rules that run the layer forward with modified parameters: αβ (z⁺ among them) and γ.

The modified passes run in the backward pass, only when relevance reaches the
layer, with parameters built once per context and rebuilt when the layer's own change (see
:class:`~tdhook.attribution.rules.base.ParamModifier` and :meth:`~tdhook.attribution.rules.base.Rule.prepared_state`).
Inputs after a ReLU (``x ≥ 0``) take direct paths that apply the transposed
modified weight without an autograd graph. In a call that keeps the graph
(``LRP(..., create_graph=True)``), the modified parameters are functions of the
live ones and every rule computes its gradient with autograd alone
(:meth:`~_ModifiedForwardRule.input_gradient_keeping_graph`).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
from torch import nn

from tdhook.attribution.rules._arguments import finite_number, nonnegative
from tdhook.attribution.rules._autograd import is_plain_gradient, may_overwrite, redirect
from tdhook.attribution.rules._half_precision import (
    HALF_PRECISIONS,
    float32_params,
    is_half_precision,
    without_autocast,
)
from tdhook.attribution.rules._input_gradients import (
    direct_input_gradient,
    direct_input_gradients,
    has_direct_input_gradient,
)
from tdhook.attribution.rules._keeping_graph import graph_kept
from tdhook.attribution.rules._layers import effective_parameters, forward_with, has_weight
from tdhook.attribution.rules._numerics import has_negative, nonzero_where_negative, pieces, signed_shift, stabilize
from tdhook.attribution.rules._parameter_sets import ParameterSets
from tdhook.attribution.rules.base import _ZERO_BIAS, ParamModifier, Registration, Rule, _single_input, _zeroing
from tdhook.attribution.tunables import GAMMA

__all__ = ["AlphaBetaRule", "GammaRule"]


class _ModifiedForwardRule(Rule):
    """Rules that route relevance through forward passes with modified parameters.

    The modified passes run in the backward pass, only when relevance reaches
    the layer: a layer whose relevance is taken over by a merged BatchNorm, or
    that lies off the explained path, costs nothing but a copy of its output.
    """

    #: whether :meth:`input_gradient` reads the output ``z`` only in ``z · grad`` (the output relevance), so
    #: that relevance on outputs exactly 0 can be handed to it directly (see :meth:`zero_output_seeds`).
    relevance_from_output_product: bool = False

    merges_batch_norm = True
    differentiable = True

    def __init__(self, stabilizer: float = 1e-6, zero_params: Sequence[str] = ()) -> None:
        nonnegative(type(self).__name__, "stabilizer", stabilizer)
        # Read once: an iterator checked first and read again would be empty, zeroing nothing.
        names = tuple(zero_params) if isinstance(zero_params, Iterable) and not isinstance(zero_params, str) else None
        if names is None or not all(isinstance(name, str) for name in names):
            raise ValueError(
                f"{type(self).__name__}: zero_params must be a sequence of parameter names, got {zero_params!r}"
            )
        super().__init__()
        self.stabilizer = stabilizer
        self.zero_params = names

    def modifiers(self) -> dict[str, ParamModifier | BiasZeroed]:
        """The rule's parameter sets by name: each a modifier of the layer's parameters, or a :class:`BiasZeroed`."""
        raise NotImplementedError

    def _denominator(self, modified: torch.Tensor) -> torch.Tensor:
        """``stabilize(modified)``; without a stabilizer (``0``), ``modified`` with its zeros made ones. A zero
        modified output is a sum of contributions that are all zero (or of terms that cancel, for γ, whose share
        is then zero too), so its share multiplies only zeros: the limit of small stabilizers, not ``0 / 0``."""
        if self.stabilizer:
            return stabilize(modified, self.stabilizer)
        return torch.where(modified == 0, torch.ones_like(modified), modified)

    def _shifted_(self, denominator: torch.Tensor) -> torch.Tensor:
        """``denominator + ε`` in place, for a denominator that is never negative; its zeros made ones where
        ``ε = 0`` (see :meth:`_denominator`)."""
        if self.stabilizer:
            return denominator.add_(self.stabilizer)
        return denominator.masked_fill_(denominator == 0, 1)

    def modified_params(self, params: Mapping[str, torch.Tensor]) -> MutableMapping[str, Any]:
        """The modified parameter sets of the rule, by name, built from ``params``.

        Each set is built at its first read (:class:`~tdhook.attribution.rules._parameter_sets.ParameterSets`):
        a call reads only those its path needs, and a layer merged with its BatchNorm none of its own. A set with
        its bias zeroed (:class:`BiasZeroed`) holds the weight tensor of the set without it. In a call that keeps
        the graph, every set is built at once, as a function of the live parameters.
        """
        zero = _zeroing(self.zero_params)
        modifiers = self.modifiers()
        if graph_kept() is not None:
            chains = {key: _chain(zero, m) for key, m in modifiers.items()}
            modified: MutableMapping[str, Any] = {key: m.modify(params) for key, m in chains.items()}
            modified["plain"] = dict(params)
            return modified
        builders: dict[str, Callable[[MutableMapping[str, Any]], Any]] = {}
        for key, m in modifiers.items():
            of = next((k for k, other in modifiers.items() if isinstance(m, BiasZeroed) and other is m.modifier), None)
            if of is not None:  # the same weight as ``of``'s: shared, not built twice
                builders[key] = functools.partial(_bias_zeroed, of=of, params=params)
            else:
                builders[key] = functools.partial(_built, _chain(zero, m), params)
        builders["plain"] = lambda sets: dict(params)  # the layer's own (or BatchNorm-merged) weight and bias
        sources = [t for t in params.values() if isinstance(t, torch.Tensor)]
        return ParameterSets(builders, sources, owner=type(self).__name__)

    def prepare(self, module: nn.Module) -> MutableMapping[str, Any]:
        if not has_weight(module):
            raise ValueError(f"{type(self).__name__} needs a module with a weight; {type(module).__name__} has none")
        sets = self.modified_params(effective_parameters(module))
        if isinstance(sets, ParameterSets):
            sets.owner = f"{type(self).__name__} on {type(module).__name__}"
        return sets

    def input_gradient(
        self,
        module: nn.Module,
        registration: Registration,
        params: dict[str, dict[str, torch.Tensor]],
        x: torch.Tensor,
        z: torch.Tensor,
        grad: torch.Tensor,
    ) -> torch.Tensor:
        """The gradient the rule sends to the layer input ``x``, given the output ``z`` and its gradient."""
        raise NotImplementedError

    def zero_output_seeds(self, call, relevance):
        """For a rule whose gradient reads the output ``z`` only as the output relevance ``z · grad``
        (``relevance_from_output_product``): ``R_j`` on an output ``z_j = 0`` is shared by the modified
        outputs, which need not be 0, as zennit shares it. The pass starts at the layer input, with the
        gradient the rule sends it for output relevance ``R``; relevance it records (zero inputs) is added
        as in any pass."""
        if not self.relevance_from_output_product or call.raw.shape != relevance.shape:
            return None
        params = self.prepared_state(call.module, call.registration)
        shares = (call.module, call.registration, params, call.x, torch.ones_like(relevance), relevance)
        if graph_kept() is not None:
            return [(call.x, self._gradient(*shares, keeping_graph=True))]
        return [(call.x, self._gradient(*shares))]

    def input_gradient_keeping_graph(
        self,
        module: nn.Module,
        registration: Registration,
        params: dict[str, dict[str, torch.Tensor]],
        x: torch.Tensor,
        z: torch.Tensor,
        grad: torch.Tensor,
    ) -> torch.Tensor:
        """:meth:`input_gradient` as a function of ``x``, ``z``, ``grad`` and ``params`` that autograd can
        differentiate: no detached tensor, no in-place write (a call with ``create_graph=True``)."""
        raise NotImplementedError

    #: whether :meth:`input_gradient` itself computes in float32 for half-precision inputs (the input-layer
    #: rules, which record relevance at the input tensor itself); otherwise :meth:`_gradient` does.
    computes_half_precision_in_float32: bool = False

    def _gradient(self, module, registration, params, x, z, grad, keeping_graph: bool = False) -> torch.Tensor:
        """:meth:`input_gradient` (or :meth:`input_gradient_keeping_graph`), in float32 for a float16 or bfloat16
        input, rounded to its dtype at the end (see :mod:`~tdhook.attribution.rules._half_precision`)."""
        gradient = self.input_gradient_keeping_graph if keeping_graph else self.input_gradient
        if not is_half_precision(x) or self.computes_half_precision_in_float32:
            return gradient(module, registration, params, x, z, grad)
        with without_autocast(x):
            with torch.enable_grad() if keeping_graph else torch.no_grad():
                wide = [t.float() for t in (x, z, grad)]
            result = gradient(module, registration, float32_params(params, keep=not keeping_graph), *wide)
            return result.to(x.dtype)

    def _redirect_keeping_graph(self, module, registration, params, x, output):
        version, z = x._version, output.clone()  # a copy: later in-place operations must not reach it

        def backward(grad: torch.Tensor) -> list[torch.Tensor]:
            self._check_unchanged(module, x, version)
            with torch.enable_grad():
                return [self._gradient(module, registration, params, x, z, grad, keeping_graph=True)]

        return redirect(output, [x], backward)

    def _check_unchanged(self, module: nn.Module, x: torch.Tensor, version: int) -> None:
        if x._version != version:
            raise RuntimeError(
                f"{type(self).__name__} on {type(module).__name__}: the layer's input was modified in place "
                "after the layer ran; make that operation out of place"
            )

    def rewrite(self, module, registration, inputs, output):
        x = _single_input(self, module, inputs)
        if not x.requires_grad:
            return None
        if graph_kept() is not None:
            params = self.prepared_state(module, registration)
            return self._redirect_keeping_graph(module, registration, params, x, output)
        # When a BatchNorm took over the last call, it most likely takes over this one: this redirect is then
        # never used, and the output is not copied (if it is used after all, z is copied or recomputed then).
        copy_output = not registration.merged_by_norm
        return self._redirect_lazily(module, registration, registration.state, x, output, copy_output)

    def rewrite_merged(self, call, output, merged):
        call.registration.merged_by_norm = True
        if graph_kept() is not None:  # merged.params are the live ones: so are the modified ones
            params = self.modified_params(merged.params)
            return self._redirect_keeping_graph(call.module, call.registration, params, call.x, output)
        params = merged.cache.get(self)
        if params is None:
            params = merged.cache[self] = self.modified_params(merged.params)
        return self._redirect_lazily(call.module, call.registration, params, call.x, output)

    def _redirect_lazily(self, module, registration, params, x, output, copy_output=True):
        version = x._version
        if copy_output:
            z = output.detach().clone()  # later in-place operations (ReLU(inplace=True)) must not change it
        else:
            z, z_version = output.detach(), output._version

        def backward(grad: torch.Tensor) -> list[torch.Tensor]:
            self._check_unchanged(module, x, version)
            z_now = z
            if not copy_output:  # a copy the rule may write into; the output itself, if it is unchanged
                with torch.no_grad():
                    z_now = (
                        z.clone()
                        if z._version == z_version
                        else self._forward(module, registration, params["plain"], x, z.shape)
                    )
            with torch.enable_grad():
                if x.dtype in HALF_PRECISIONS:  # the one test float32 and float64 layers pay
                    return [self._gradient(module, registration, params, x, z_now, grad)]
                return [self.input_gradient(module, registration, params, x, z_now, grad)]

        return redirect(output, [x], backward)

    @staticmethod
    def _forward(module, registration, params, x, out_shape: Sequence[int]) -> torch.Tensor:
        """The layer's forward on ``x`` with ``params``, giving an output of ``out_shape`` (the explained call's)."""
        return forward_with(module, params, x, registration.busy, out_shape)

    def _signed_forward(
        self, module, registration, params, x, pairs: Sequence[tuple[str, str]], out_shape: Sequence[int]
    ) -> list[torch.Tensor]:
        """For each ``(key⁺, key⁻)``: the forward of ``x⁺`` with params ``key⁺`` plus ``x⁻`` with ``key⁻``.

        The ``x⁻`` pass is skipped when ``x`` has no negative entry (after a ReLU): it would add exact zeros.
        """
        has_neg = has_negative(x)
        x_pos = x.clamp(min=0) if has_neg else x
        x_neg = x.clamp(max=0) if has_neg else None
        outputs = []
        for pos_key, neg_key in pairs:
            out = self._forward(module, registration, params[pos_key], x_pos, out_shape)
            if has_neg:
                out = out + self._forward(module, registration, params[neg_key], x_neg, out_shape)
            outputs.append(out)
        return outputs


def _clamp(min: float | None = None, max: float | None = None) -> ParamModifier:
    return ParamModifier(lambda n, p: p.clamp(min=min, max=max))


class BiasZeroed:
    """A parameter set in :meth:`_ModifiedForwardRule.modifiers`: ``modifier``'s, with the bias zeroed.

    Where another set of the rule is ``modifier``'s itself (the same object), the two hold one weight tensor
    (``up`` and ``up_nobias`` of γ); otherwise the set is built on its own, as
    ``ParamModifier.from_modifiers([modifier, zero_bias])`` would build it.

    Examples:
        >>> positive = ParamModifier(lambda n, p: p.clamp(min=0))
        >>> rule = AlphaBetaRule()
        >>> rule.modifiers = lambda: {"pos": positive, "pos_nobias": BiasZeroed(positive)}
        >>> sets = rule.modified_params({"weight": torch.tensor([[-1.0, 2.0]]), "bias": torch.tensor([3.0])})
        >>> sets["pos_nobias"]["weight"] is sets["pos"]["weight"], sets["pos_nobias"]["bias"]
        (True, tensor([0.]))
    """

    __slots__ = ("modifier",)

    def __init__(self, modifier: ParamModifier) -> None:
        self.modifier = modifier


def _chain(zero: ParamModifier, modifier: ParamModifier | BiasZeroed) -> ParamModifier:
    """``modifier`` after the zeroing of the rule's ``zero_params``; the bias zeroed last for :class:`BiasZeroed`."""
    if isinstance(modifier, BiasZeroed):
        return ParamModifier.from_modifiers([zero, modifier.modifier, _ZERO_BIAS])
    return ParamModifier.from_modifiers([zero, modifier])


def _built(modifier: ParamModifier, params: Mapping[str, torch.Tensor], sets: MutableMapping[str, Any]) -> dict:
    """``modifier.modify(params)`` outside a call that keeps the graph: detached (built at the set's first read,
    which may come in the relevance pass)."""
    with torch.no_grad():
        return {n: modifier.modify_fn(n, p.detach()) for n, p in params.items() if modifier.select_fn(n, p)}


def _bias_zeroed(sets: MutableMapping[str, Any], of: str, params: Mapping[str, torch.Tensor]) -> dict:
    """The set ``of`` with its bias zeroed: its own weight tensor, the bias as :data:`_ZERO_BIAS` makes it."""
    base = sets[of]
    zeroed = {}
    for name, param in params.items():
        if name == "bias":
            zeroed[name] = torch.zeros_like(base.get(name, param)).detach()
        elif name in base:
            zeroed[name] = base[name]
    return zeroed


class AlphaBetaRule(_ModifiedForwardRule):
    """LRP-αβ: positive and negative contributions weighted by ``α`` and ``β`` (``α - β = 1``).

    With ``x⁺ = max(x, 0)``, ``x⁻ = min(x, 0)``, ``w⁺``, ``w⁻`` likewise:
    ``z⁺ = w⁺x⁺ + b⁺ + w⁻x⁻`` and ``z⁻ = w⁻x⁺ + b⁻ + w⁺x⁻``;
    ``R_i = α (x⁺_i w⁺_ij + x⁻_i w⁻_ij) R_j / stabilize(z⁺_j) - β (x⁺_i w⁻_ij + x⁻_i w⁺_ij) R_j / stabilize(z⁻_j)``.
    ``α = 1, β = 0`` is z⁺ (zennit's ``ZPlus``, captum's ``Alpha1_Beta0_Rule``).

    Examples:
        >>> AlphaBetaRule(alpha=1.0, beta=0.0)
        AlphaBetaRule(stabilizer=1e-06, zero_params=(), alpha=1.0, beta=0.0)
        >>> AlphaBetaRule(alpha=2.0, beta=2.0)
        Traceback (most recent call last):
        ...
        ValueError: AlphaBetaRule needs alpha - beta == 1 and both non-negative, got alpha=2.0, beta=2.0
        >>> AlphaBetaRule().set_kwargs(alpha=3.0).beta  # β follows α
        2.0
    """

    relevance_from_output_product = True

    tunables = {"alpha": (float, {"low": 1.0, "high": 4.0, "log": False})}

    def _rebuild(self, values: dict) -> None:
        super()._rebuild({**values, "beta": values["alpha"] - 1.0} if "alpha" in values else values)

    def __init__(
        self, alpha: float = 2.0, beta: float = 1.0, stabilizer: float = 1e-6, zero_params: Sequence[str] = ()
    ) -> None:
        a, b = finite_number(type(self).__name__, "alpha", alpha), finite_number(type(self).__name__, "beta", beta)
        if a < 0 or b < 0 or not math.isclose(a - b, 1.0, rel_tol=0.0, abs_tol=1e-9):
            raise ValueError(
                f"AlphaBetaRule needs alpha - beta == 1 and both non-negative, got alpha={alpha}, beta={beta}"
            )
        super().__init__(stabilizer, zero_params)
        self.alpha = alpha
        self.beta = beta

    def modifiers(self):
        positive, negative = _clamp(min=0.0), _clamp(max=0.0)
        mods = {"pos": positive, "neg_nobias": BiasZeroed(negative)}
        if self.beta:
            mods["neg"] = negative
            mods["pos_nobias"] = BiasZeroed(positive)
        return mods

    def input_gradient(self, module, registration, params, x, z, grad):
        if has_direct_input_gradient(module):
            if has_negative(x):
                return self._signed_input_gradient(module, registration, params, x.detach(), z, grad)
            if not self.beta:
                return self._z_plus_of_nonnegative_input(module, registration, params["pos"], x.detach(), z, grad)
        leaf = x.detach().requires_grad_(True)
        pairs = [("pos", "neg_nobias"), ("neg", "pos_nobias")] if self.beta else [("pos", "neg_nobias")]
        modified = self._signed_forward(module, registration, params, leaf, pairs, z.shape)
        factors = (self.alpha, -self.beta)
        grads = [f * grad * z / self._denominator(m.detach()) for f, m in zip(factors, modified, strict=False)]
        return torch.autograd.grad(modified, leaf, grads)[0]

    def input_gradient_keeping_graph(self, module, registration, params, x, z, grad):
        pairs = [("pos", "neg_nobias"), ("neg", "pos_nobias")] if self.beta else [("pos", "neg_nobias")]
        modified = self._signed_forward(module, registration, params, x, pairs, z.shape)
        factors = (self.alpha, -self.beta)
        shares = [f * grad * z / self._denominator(m) for f, m in zip(factors, modified, strict=False)]
        return torch.autograd.grad(modified, x, shares, create_graph=True)[0]

    def _signed_input_gradient(self, module, registration, params, x, z, grad):
        """αβ for a signed ``x``: the same gradient as through autograd, with no graph.

        ``z⁺ = w⁺x⁺ + b⁺ + w⁻x⁻ ≥ 0`` (both products are sums of non-negative terms), so ``stabilize(z⁺)`` is
        ``z⁺ + ε`` exactly; ``z⁻ = w⁻x⁺ + b⁻ + w⁺x⁻`` is stabilised as usual. With ``s⁺ = α grad · z / stabilize(z⁺)``
        and ``s⁻ = -β grad · z / stabilize(z⁻)``, the input gradient is ``w⁺ᵀ s⁺ + w⁻ᵀ s⁻`` where ``x > 0``,
        ``w⁻ᵀ s⁺ + w⁺ᵀ s⁻`` where ``x < 0`` and 0 where ``x = 0`` (as through the clamps ``x⁺``, ``x⁻``: torch's
        clamp passes no gradient at its bound).
        """
        pairs = [("pos", "neg_nobias"), ("neg", "pos_nobias")] if self.beta else [("pos", "neg_nobias")]
        with torch.no_grad():
            x_pos, x_neg = x.clamp(min=0), x.clamp(max=0)
            on_pos = on_neg = None
            for factor, (up, down) in zip((self.alpha, -self.beta), pairs, strict=False):
                modified = self._forward(module, registration, params[up], x_pos, z.shape)
                modified += self._forward(module, registration, params[down], x_neg, z.shape)
                shifted = self._shifted_(modified) if up == "pos" else self._denominator(modified)
                share = (factor * grad * z).div_(shifted)
                weights = [params[up]["weight"], params[down]["weight"]]
                through_pos, through_neg = direct_input_gradients(module, weights, share, x)
                on_pos = through_pos if on_pos is None else on_pos.add_(through_pos)
                on_neg = through_neg if on_neg is None else on_neg.add_(through_neg)
            # Masks as 0/1 factors from sign(x): several times faster on CPU than torch.where or masked_fill_.
            sign = torch.sign(x)
            return on_pos.mul_(sign.clamp(min=0)).add_(on_neg.mul_(sign.clamp_(max=0).neg_()))

    def _z_plus_of_nonnegative_input(self, module, registration, positive, x, z, grad):
        """z⁺ (α = 1, β = 0) for ``x ≥ 0``: the same gradient with fewer passes over the output.

        ``z⁺ = w⁺x + b⁺ ≥ 0``, so ``stabilize(z⁺)`` is ``z⁺ + ε`` exactly, and ``W⁺ᵀ`` is applied directly,
        with no autograd graph behind the modified forward pass.
        """
        with torch.no_grad():
            share = self._forward(module, registration, positive, x, z.shape)
            if not is_plain_gradient(grad, z):
                share = grad * z / self._shifted_(share)
            else:
                for d, z_, g, scratch in pieces(share, z, grad):
                    torch.div(torch.mul(g, z_, out=scratch), self._shifted_(d), out=d)  # α = 1
            return direct_input_gradient(module, positive["weight"], share, x)


class GammaRule(_ModifiedForwardRule):
    """LRP-γ, generalised to signed inputs and outputs (zennit's ``Gamma``).

    With ``w^γ⁺ = w + γ w⁺`` and ``w^γ⁻ = w + γ w⁻`` (biases alike):
    ``z^↑ = w^γ⁺ x⁺ + b^γ⁺ + w^γ⁻ x⁻`` serves outputs ``z > 0`` and
    ``z^↓ = w^γ⁻ x⁺ + b^γ⁻ + w^γ⁺ x⁻`` serves ``z < 0``;
    ``R_i = Σ_j [z_j>0] (x⁺_i w^γ⁺_ij + x⁻_i w^γ⁻_ij) R_j / stabilize(z^↑_j)
    + [z_j<0] (x⁺_i w^γ⁻_ij + x⁻_i w^γ⁺_ij) R_j / stabilize(z^↓_j)``.
    ``zero_params=("bias",)`` gives captum's ``GammaRule(set_bias_to_zero=True)``.

    Examples:
        >>> GammaRule(gamma=0.5).gamma
        0.5
    """

    tunables = {"gamma": GAMMA}

    def __init__(self, gamma: float = 0.25, stabilizer: float = 1e-6, zero_params: Sequence[str] = ()) -> None:
        nonnegative(type(self).__name__, "gamma", gamma)
        super().__init__(stabilizer, zero_params)
        self.gamma = gamma

    def modifiers(self):
        gamma = self.gamma
        up = ParamModifier(lambda n, p: p + gamma * p.clamp(min=0))
        down = ParamModifier(lambda n, p: p + gamma * p.clamp(max=0))
        return {
            "up": up,
            "down": down,
            "up_nobias": BiasZeroed(up),
            "down_nobias": BiasZeroed(down),
        }

    def modified_params(self, params):
        modified = super().modified_params(params)
        if set(self.zero_params) <= {"bias"} and isinstance(modified, ParameterSets):  # the fast paths' parameters
            gamma, zeroed_bias = self.gamma, "bias" in self.zero_params

            def shift(sets: MutableMapping[str, Any]) -> dict[str, torch.Tensor]:
                # z^↑ = z + D with D = γ W⁺x + (b^γ⁺ − b): the shift's parameters, for inputs x ≥ 0.
                bias = params.get("bias")
                bias_up = sets["up"].get("bias") if "bias" in params else None
                with torch.no_grad():
                    built = {"weight": params["weight"].detach().clamp(min=0).mul_(gamma)}
                    if bias is not None or bias_up is not None:
                        built["bias"] = (0 if bias_up is None else bias_up) - (0 if bias is None else bias.detach())
                return built

            def shift_is_nonnegative(sets: MutableMapping[str, Any]) -> bool:
                # D ≥ 0 when its bias is (the default: b^γ⁺ − b = γ b⁺): then z > 0 gives z^↑ > 0 and z < 0 gives
                # z^↓ < 0.
                return "bias" not in sets["shift"] or bool((sets["shift"]["bias"] >= 0).all())

            def down_mirrors_up(sets: MutableMapping[str, Any]) -> bool:
                # z^↓ = (1 + γ) z − D needs b^γ⁻ = (2 + γ) b − b^γ⁺, which the γ-modified biases satisfy; zeroed
                # ones only where the layer's own bias is zero.
                bias = params.get("bias")
                return not zeroed_bias or bias is None or not bool(bias.any())

            modified.define("shift", shift)
            modified.define("shift_is_nonnegative", shift_is_nonnegative)
            modified.define("down_mirrors_up", down_mirrors_up)
        return modified

    def input_gradient(self, module, registration, params, x, z, grad):
        if (
            "shift" in params
            and is_plain_gradient(grad, z)
            and has_direct_input_gradient(module)
            and not has_negative(x)
        ):
            with torch.no_grad():
                if not nonzero_where_negative(grad, z):  # no relevance reaches a negative output (a ReLU follows)
                    return self._positive_outputs_gradient(module, registration, params, x.detach(), z, grad)
                if params["shift_is_nonnegative"] and params["down_mirrors_up"]:
                    return self._nonnegative_input_gradient(module, registration, params, x.detach(), z, grad)
        leaf = x.detach().requires_grad_(True)
        pairs = [("up", "down_nobias"), ("down", "up_nobias")]
        z_up, z_down = self._signed_forward(module, registration, params, leaf, pairs, z.shape)
        grad_up = grad * z.clamp(min=0) / self._denominator(z_up.detach())
        grad_down = grad * z.clamp(max=0) / self._denominator(z_down.detach())
        return torch.autograd.grad((z_up, z_down), leaf, (grad_up, grad_down))[0]

    def input_gradient_keeping_graph(self, module, registration, params, x, z, grad):
        pairs = [("up", "down_nobias"), ("down", "up_nobias")]
        z_up, z_down = self._signed_forward(module, registration, params, x, pairs, z.shape)
        grad_up = grad * z.clamp(min=0) / self._denominator(z_up)
        grad_down = grad * z.clamp(max=0) / self._denominator(z_down)
        return torch.autograd.grad((z_up, z_down), x, (grad_up, grad_down), create_graph=True)[0]

    def _positive_outputs_gradient(self, module, registration, params, x, z, grad):
        """The gradient for ``x ≥ 0`` when ``grad`` is zero wherever ``z < 0``: ``W^γ⁺ᵀ a`` alone.

        ``z^↑ = z + D`` (see :meth:`modified_params`): one forward pass for ``D`` and one transposed product,
        with ``a = grad · z / stabilize(z^↑)``. Where ``z ≤ 0``, ``a`` is zero with any non-zero denominator.
        """
        shift = self._forward(module, registration, params["shift"], x, z.shape)
        nonnegative, epsilon = params["shift_is_nonnegative"], self.stabilizer
        for d, z_, g, scratch in pieces(shift, z, grad):
            if nonnegative:  # stabilize(z + D) = z + D + ε where z > 0; elsewhere D + ε > 0 does
                self._shifted_(d.add_(torch.clamp(z_, min=0, out=scratch)))
            else:
                d.add_(z_).add_(signed_shift(d, epsilon))
                if not epsilon:
                    d.masked_fill_(d == 0, 1)
            torch.div(torch.mul(g, z_, out=scratch), d, out=d)
        return direct_input_gradient(module, params["up"]["weight"], shift, x)

    def _nonnegative_input_gradient(self, module, registration, params, x, z, grad):
        """The gradient for ``x ≥ 0`` (after a ReLU) and ``D ≥ 0``: one forward pass for ``D``, two products.

        ``z^↑ = z + D`` and ``z^↓ = (1 + γ) z − D`` (see :meth:`modified_params`), so that
        ``|stabilize(z^↑)| = z + D + ε`` where ``z > 0``, ``|stabilize(z^↓)| = −(1 + γ) z + D + ε`` where
        ``z < 0``: both are ``m = max(z, −(1 + γ) z) + D + ε``. With ``r = grad / m`` the shares are
        ``a = z⁺ r`` and ``c = −z⁻ r``, and the input gradient is ``W^γ⁺ᵀ a + W^γ⁻ᵀ c``.
        """
        shift = self._forward(module, registration, params["shift"], x, z.shape)
        negative_share = shift  # −c is written over D
        positive_share = z if may_overwrite(grad, z) else torch.empty_like(z)
        scale = -(1 + self.gamma)
        for d, z_, g, a, scratch in pieces(shift, z, grad, positive_share):
            self._shifted_(d.add_(torch.maximum(z_, torch.mul(z_, scale, out=scratch), out=scratch)))
            torch.div(g, d, out=d)
            torch.clamp(z_, max=0, out=scratch)
            torch.clamp(z_, min=0, out=a).mul_(d)
            d.mul_(scratch)
        through_up = direct_input_gradient(module, params["up"]["weight"], positive_share, x)
        through_down = direct_input_gradient(module, params["down"]["weight"], negative_share, x)
        return through_up.sub_(through_down)
