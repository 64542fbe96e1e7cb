"""LRP rules, rule mappers and presets.

Every rule changes the gradient that flows backward through one module, so that
the relevance of any tensor ``a`` is ``a * grad(a)`` (DESIGN §1). With ``z`` the
module's output and ``R = z * grad(z)`` its relevance, each rule's docstring
gives the relevance ``R_i`` it assigns to the module's input ``x``.

A rule is registered on a module with :meth:`Rule.register`, which returns a
:class:`RemovableRuleHandle`. Registration adds forward hooks only: parameters
are never written, and the modified parameters a rule needs are computed once,
when it is registered.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from tdhook.attribution.lrp_helpers.redirect import redirect, relevance_proxy

__all__ = [
    "stabilize",
    "ParamModifier",
    "RemovableRuleHandle",
    "Registration",
    "Rule",
    "EpsilonRule",
    "UniformEpsilonRule",
    "PassRule",
    "IgnoreRule",
    "StopRule",
    "UniformRule",
    "AlphaBetaRule",
    "GammaRule",
    "FlatRule",
    "WSquareRule",
    "ZBoxRule",
    "RuleMapper",
    "rule_mapper_from_dict",
    "BaseRuleMapper",
    "EpsilonPlus",
    "EpsilonPlusFlat",
    "EpsilonAlpha2Beta1",
    "EpsilonAlpha2Beta1Flat",
    "EpsilonGammaBox",
    "raise_for_unconserved_rel_factory",
]


def stabilize(tensor: torch.Tensor, epsilon: float = 1e-6) -> torch.Tensor:
    """Shift ``tensor`` away from zero by ``epsilon``, keeping its sign (zero counts as positive).

    ``stabilize(z) = z + epsilon * sign(z)`` with ``sign(0) = 1``, so that dividing
    by the result is safe.

    Examples:
        >>> stabilize(torch.tensor([-1.0, 0.0, 2.0]), epsilon=0.5)
        tensor([-1.5000,  0.5000,  2.5000])
    """
    return tensor + torch.where(tensor >= 0, epsilon, -epsilon).to(tensor.dtype)


# ----------------------------------------------------------------------------- parameters


def _identity_modifier(name: str, param: torch.Tensor) -> torch.Tensor:
    return param


class ParamModifier:
    """A modification of a module's own parameters, applied without touching them.

    Args:
        modify_fn: ``(name, param) -> tensor``, the modified value of a selected parameter.
            Defaults to the identity.
        select_fn: ``(name, param) -> bool``, which parameters to modify. Defaults to
            :meth:`select_all`.

    Examples:
        >>> lin = nn.Linear(2, 1)
        >>> positive = ParamModifier(lambda name, p: p.clamp(min=0))
        >>> original, modified = positive.state_dicts(lin)
        >>> sorted(modified), bool((modified["weight"] >= 0).all())
        (['bias', 'weight'], True)
        >>> with positive(lin):
        ...     bool((lin.weight >= 0).all())
        True
        >>> lin.weight is original["weight"]
        True
    """

    def __init__(
        self,
        modify_fn: Callable[[str, torch.Tensor], torch.Tensor] | None = None,
        select_fn: Callable[[str, torch.Tensor], bool] | None = None,
    ) -> None:
        self.modify_fn = modify_fn or _identity_modifier
        self.select_fn = select_fn or self.select_all

    @staticmethod
    def select_all(name: str, param: torch.Tensor) -> bool:
        """Select every parameter."""
        return True

    @classmethod
    def from_modifiers(cls, modifiers: Sequence[ParamModifier]) -> ParamModifier:
        """Chain modifiers: each applies, in order, to the parameters it selects.

        Examples:
            >>> zero_bias = ParamModifier(lambda n, p: torch.zeros_like(p), lambda n, p: n == "bias")
            >>> ones = ParamModifier(lambda n, p: torch.ones_like(p))
            >>> flat = ParamModifier.from_modifiers([ones, zero_bias])
            >>> _, modified = flat.state_dicts(nn.Linear(2, 1))
            >>> modified["weight"].tolist(), modified["bias"].tolist()
            ([[1.0, 1.0]], [0.0])
        """
        modifiers = list(modifiers)

        def select_fn(name: str, param: torch.Tensor) -> bool:
            return any(m.select_fn(name, param) for m in modifiers)

        def modify_fn(name: str, param: torch.Tensor) -> torch.Tensor:
            for m in modifiers:
                if m.select_fn(name, param):
                    param = m.modify_fn(name, param)
            return param

        return cls(modify_fn, select_fn)

    def state_dicts(self, module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The selected parameters of ``module`` (not of its children), as they are and as modified."""
        original = {n: p for n, p in module.named_parameters(recurse=False) if self.select_fn(n, p)}
        with torch.no_grad():
            modified = {n: self.modify_fn(n, p.detach()) for n, p in original.items()}
        return original, modified

    @contextmanager
    def __call__(self, module: nn.Module) -> Iterator[nn.Module]:
        """Swap in the modified parameters for the ``with`` block; restore the originals after it."""
        original, modified = self.state_dicts(module)
        try:
            for name, value in modified.items():
                module._parameters[name] = value
            yield module
        finally:
            for name, value in original.items():
                module._parameters[name] = value


_ZERO_BIAS = ParamModifier(lambda n, p: torch.zeros_like(p), lambda n, p: n == "bias")


def _zeroing(names: Sequence[str]) -> ParamModifier:
    names = tuple(names)
    return ParamModifier(lambda n, p: torch.zeros_like(p), lambda n, p: n in names)


def _forward_with(module: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, busy: list) -> torch.Tensor:
    """Run ``module`` on ``x`` with ``params`` in place of its own parameters."""
    weight = params.get("weight", getattr(module, "weight", None))
    bias = params.get("bias", getattr(module, "bias", None))
    if type(module) is nn.Linear:
        return F.linear(x, weight, bias)
    if isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)):
        return module._conv_forward(x, weight, bias)
    busy.append(True)  # the rule's own hook must not run on this inner call
    try:
        return functional_call(module, params, (x,))
    finally:
        busy.pop()


# ----------------------------------------------------------------------------- rule base


@dataclass
class Registration:
    """What a rule keeps for one module it is registered on."""

    state: Any
    hooks: list = field(default_factory=list)
    snapshots: list = field(default_factory=list)
    records: list = field(default_factory=list)
    busy: list = field(default_factory=list)


class RemovableRuleHandle:
    """Undo one :meth:`Rule.register`. Holds the module by weak reference.

    Examples:
        >>> lin = nn.Linear(2, 2)
        >>> with EpsilonRule().register(lin):
        ...     len(lin._forward_hooks)
        1
        >>> len(lin._forward_hooks)
        0
    """

    def __init__(self, rule: Rule, module: nn.Module) -> None:
        self.rule = rule
        self._module_ref = weakref.ref(module)

    @property
    def module(self) -> nn.Module | None:
        """The module, or ``None`` once it has been garbage collected."""
        return self._module_ref()

    def pop_records(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Relevance not carried by the gradient, as ``(module input, relevance)`` pairs, since the last pop."""
        module = self.module
        registration = self.rule._registrations.get(module) if module is not None else None
        if registration is None:
            return []
        records, registration.records = registration.records, []
        return records

    def remove(self) -> None:
        """Remove the rule's hooks from the module."""
        module = self.module
        if module is not None:
            self.rule.unregister(module)

    def __enter__(self) -> RemovableRuleHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.remove()


class Rule:
    """Base class of the LRP rules.

    A rule rewrites a module's output into a tensor of the same value whose
    gradient is the rule's. Subclasses implement :meth:`rewrite` and, when they
    need modified parameters, :meth:`prepare` (called once per registration).
    """

    #: whether :meth:`rewrite` reads the module's input (in-place modules then keep a copy of it).
    uses_input: bool = True

    def __init__(self) -> None:
        self._registrations: weakref.WeakKeyDictionary[nn.Module, Registration] = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not k.startswith("_"))
        return f"{type(self).__name__}({args})"

    def prepare(self, module: nn.Module) -> Any:
        """Per-module state computed once at registration (for example modified parameters)."""
        return None

    def rewrite(
        self, module: nn.Module, registration: Registration, inputs: tuple, output: torch.Tensor
    ) -> torch.Tensor | None:
        """Return the module's output with the rule's gradient, or ``None`` to keep it.

        ``registration.state`` holds what :meth:`prepare` returned, and relevance the
        gradient cannot carry goes to ``registration.records``.
        """
        raise NotImplementedError

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        """Attach the rule to ``module``; the returned handle removes it."""
        if module in self._registrations:
            raise ValueError(f"{self!r} is already registered on this {type(module).__name__}")
        registration = Registration(self.prepare(module))
        if self.uses_input and getattr(module, "inplace", False):
            registration.hooks.append(module.register_forward_pre_hook(self._snapshot_hook(registration)))
        registration.hooks.append(module.register_forward_hook(self._forward_hook(registration)))
        self._registrations[module] = registration
        return RemovableRuleHandle(self, module)

    def unregister(self, module: nn.Module) -> None:
        """Detach the rule from ``module`` (no-op when it is not attached)."""
        registration = self._registrations.pop(module, None)
        if registration is not None:
            for hook in registration.hooks:
                hook.remove()

    @staticmethod
    def _snapshot_hook(registration: Registration) -> Callable:
        def hook(module: nn.Module, args: tuple) -> None:
            if torch.is_grad_enabled() and args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                registration.snapshots.append((args[0].clone(), *args[1:]))

        return hook

    def _forward_hook(self, registration: Registration) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            inputs = registration.snapshots.pop() if registration.snapshots else args
            if registration.busy or not torch.is_grad_enabled():
                return None
            if not isinstance(output, torch.Tensor) or not output.requires_grad:
                return None
            return self.rewrite(module, registration, inputs, output)

        return hook


def _single_input(rule: Rule, module: nn.Module, inputs: tuple) -> torch.Tensor:
    if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor):
        raise ValueError(
            f"{type(rule).__name__} expects one tensor input on {type(module).__name__}, got {len(inputs)} arguments"
        )
    return inputs[0]


# ----------------------------------------------------------------------------- rules


class IgnoreRule(Rule):
    """The plain gradient: ``R_i = x_i * (∂z/∂x)^T (R / z)`` for linear ``z`` (LRP-0).

    For MaxPool, Dropout, Flatten, Identity and other modules whose gradient
    already routes relevance. Registers nothing.

    Examples:
        >>> pool = nn.MaxPool1d(2)
        >>> with IgnoreRule().register(pool):
        ...     len(pool._forward_hooks)
        0
    """

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        return RemovableRuleHandle(self, module)


class StopRule(Rule):
    """No relevance flows back through the module: ``R_i = 0``.

    Examples:
        >>> x = torch.ones(1, 2, requires_grad=True)
        >>> lin = nn.Linear(2, 2)
        >>> with StopRule().register(lin):
        ...     lin(x).requires_grad
        False
    """

    uses_input = False

    def rewrite(self, module, registration, inputs, output):
        return output.detach()


class EpsilonRule(Rule):
    """LRP-ε: ``R_i = x_i * Σ_j (∂z_j/∂x_i) R_j / stabilize(z_j, ε)``.

    The output gradient is rescaled by ``z / stabilize(z, ε)`` and the module's
    ordinary backward does the rest: no second forward pass. ``ε = 0`` is
    LRP-0, which equals gradient × input. With ``ε`` as a pure stabilizer this
    is zennit's ``Norm`` (used for average pooling).

    Args:
        epsilon: the stabilizer added to ``z`` with its sign.

    Examples:
        >>> lin = nn.Linear(3, 2)
        >>> x = torch.randn(4, 3, requires_grad=True)
        >>> with EpsilonRule(epsilon=0.0).register(lin):
        ...     relevance = x * torch.autograd.grad(lin(x)[:, 0].sum(), x)[0]
        >>> torch.allclose(relevance, x * lin.weight[0])
        True
    """

    uses_input = False

    def __init__(self, epsilon: float = 1e-6) -> None:
        super().__init__()
        self.epsilon = epsilon

    def _scale(self, output: torch.Tensor, n_inputs: int) -> torch.Tensor:
        z = output.detach()
        if self.epsilon == 0:
            return torch.where(z != 0, 1.0, 0.0).to(z.dtype) / n_inputs
        return z / (stabilize(z, self.epsilon) * n_inputs)

    def rewrite(self, module, registration, inputs, output):
        scale = self._scale(output, 1)
        output.register_hook(lambda grad: grad * scale)
        return None


class UniformEpsilonRule(EpsilonRule):
    """LRP-ε shared evenly among the ``n`` tensor inputs of a multi-input module.

    ``R_i^(k) = x_i^(k) * Σ_j (∂z_j/∂x_i^(k)) R_j / (n * stabilize(z_j, ε))``. For an
    element-wise product ``z = a * b`` each factor gets ``R / 2``.

    Examples:
        >>> class Mul(nn.Module):
        ...     def forward(self, a, b):
        ...         return a * b
        >>> mul, a, b = Mul(), torch.tensor([2.0], requires_grad=True), torch.tensor([3.0], requires_grad=True)
        >>> with UniformEpsilonRule(epsilon=0.0).register(mul):
        ...     ga, gb = torch.autograd.grad(mul(a, b), (a, b))
        >>> (a * ga).item(), (b * gb).item()
        (3.0, 3.0)
    """

    def rewrite(self, module, registration, inputs, output):
        n_inputs = sum(isinstance(i, torch.Tensor) and i.requires_grad for i in inputs)
        scale = self._scale(output, max(n_inputs, 1))
        output.register_hook(lambda grad: grad * scale)
        return None


class PassRule(Rule):
    """Relevance passes unchanged through an element-wise module: ``R_i = R_i(out)``.

    For activations and un-merged normalisation. The input gradient is
    ``grad(z) * z / stabilize(x)``. On ``nn.ReLU`` this equals the plain
    gradient, so nothing is registered there.

    Examples:
        >>> x = torch.tensor([-1.0, 0.5, 2.0], requires_grad=True)
        >>> act = nn.Tanh()
        >>> with PassRule().register(act):
        ...     z = act(x)
        ...     relevance = x * torch.autograd.grad(z, x, torch.ones(3))[0]
        >>> torch.allclose(relevance, z)
        True
    """

    def __init__(self, stabilizer: float = 1e-12) -> None:
        super().__init__()
        self.stabilizer = stabilizer

    def register(self, module: nn.Module) -> RemovableRuleHandle:
        if type(module) is nn.ReLU:
            return RemovableRuleHandle(self, module)
        return super().register(module)

    def rewrite(self, module, registration, inputs, output):
        x = _single_input(self, module, inputs)
        if x.shape != output.shape:
            raise ValueError(
                f"PassRule needs an element-wise module; {type(module).__name__} maps {tuple(x.shape)} "
                f"to {tuple(output.shape)}"
            )
        if not x.requires_grad:
            return None
        scale = output.detach() / stabilize(x.detach(), self.stabilizer)
        return redirect(output, [x], lambda grad: [grad * scale])


class UniformRule(Rule):
    """Relevance split evenly among the ``n`` inputs of a module: ``R^(k) = R / n``.

    Every input must have the output's shape. The relevance is set directly (it
    is not proportional to the input), so zero-valued inputs keep theirs.

    Examples:
        >>> class Add(nn.Module):
        ...     def forward(self, a, b):
        ...         return a + b
        >>> add, a, b = Add(), torch.tensor([1.0], requires_grad=True), torch.tensor([3.0], requires_grad=True)
        >>> with UniformRule().register(add):
        ...     ga, gb = torch.autograd.grad(add(a, b), (a, b))
        >>> (a * ga).item(), (b * gb).item()
        (2.0, 2.0)
    """

    def rewrite(self, module, registration, inputs, output):
        tensors = [i for i in inputs if isinstance(i, torch.Tensor) and i.requires_grad]
        for t in tensors:
            if t.shape != output.shape:
                raise ValueError(
                    f"UniformRule needs inputs shaped like the output {tuple(output.shape)} on "
                    f"{type(module).__name__}, got {tuple(t.shape)}"
                )
        if not tensors:
            return None
        share = output.detach() / len(tensors)
        stand_ins = []
        for t in tensors:
            (ones,) = relevance_proxy(
                t,
                [torch.ones_like(share)],
                lambda grads: grads[0],
                lambda rest, t=t: registration.records.append((t, rest)),
            )
            stand_ins.append(ones)
        # d(share * ones)/d(ones) = share, so each proxy receives R / n as its gradient.
        return redirect(output, stand_ins, lambda grad: [grad * share] * len(stand_ins))


class _ModifiedForwardRule(Rule):
    """Rules that route relevance through forward passes with modified parameters."""

    def __init__(self, stabilizer: float = 1e-6, zero_params: Sequence[str] = ()) -> None:
        super().__init__()
        self.stabilizer = stabilizer
        self.zero_params = tuple(zero_params)

    def modifiers(self) -> dict[str, ParamModifier]:
        raise NotImplementedError

    def prepare(self, module: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
        if not isinstance(getattr(module, "weight", None), torch.Tensor):
            raise ValueError(f"{type(self).__name__} needs a module with a weight; {type(module).__name__} has none")
        zero = _zeroing(self.zero_params)
        params = {}
        for key, modifier in self.modifiers().items():
            _, modified = ParamModifier.from_modifiers([zero, modifier]).state_dicts(module)
            params[key] = modified
        return params

    def _forward(self, module, registration, key, x):
        return _forward_with(module, registration.state[key], x, registration.busy)

    def _signed_forward(self, module, registration, x, pairs: Sequence[tuple[str, str]]) -> list[torch.Tensor]:
        """For each ``(key⁺, key⁻)``: the forward of ``x⁺`` with params ``key⁺`` plus ``x⁻`` with ``key⁻``.

        The ``x⁻`` pass is skipped when ``x`` has no negative entry (after a ReLU): it would add exact zeros.
        """
        x_pos, x_neg = x.clamp(min=0), x.clamp(max=0)
        has_neg = bool((x < 0).any())
        outputs = []
        for pos_key, neg_key in pairs:
            z = self._forward(module, registration, pos_key, x_pos)
            if has_neg:
                z = z + self._forward(module, registration, neg_key, x_neg)
            outputs.append(z)
        return outputs


def _clamp(min: float | None = None, max: float | None = None) -> ParamModifier:
    return ParamModifier(lambda n, p: p.clamp(min=min, max=max))


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
    """

    def __init__(
        self, alpha: float = 2.0, beta: float = 1.0, stabilizer: float = 1e-6, zero_params: Sequence[str] = ()
    ) -> None:
        if alpha < 0 or beta < 0 or alpha - beta != 1:
            raise ValueError(
                f"AlphaBetaRule needs alpha - beta == 1 and both non-negative, got alpha={alpha}, beta={beta}"
            )
        super().__init__(stabilizer, zero_params)
        self.alpha = alpha
        self.beta = beta

    def modifiers(self):
        positive, negative = _clamp(min=0.0), _clamp(max=0.0)
        mods = {"pos": positive, "neg_nobias": ParamModifier.from_modifiers([negative, _ZERO_BIAS])}
        if self.beta:
            mods["neg"] = negative
            mods["pos_nobias"] = ParamModifier.from_modifiers([positive, _ZERO_BIAS])
        return mods

    def rewrite(self, module, registration, inputs, output):
        x = _single_input(self, module, inputs)
        if not x.requires_grad:
            return None
        pairs = [("pos", "neg_nobias"), ("neg", "pos_nobias")] if self.beta else [("pos", "neg_nobias")]
        modified = self._signed_forward(module, registration, x, pairs)
        z = output.detach()
        factors = (self.alpha, -self.beta)
        scales = [f * z / stabilize(m.detach(), self.stabilizer) for f, m in zip(factors, modified, strict=False)]
        return redirect(output, modified, lambda grad: [grad * s for s in scales])


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

    def __init__(self, gamma: float = 0.25, stabilizer: float = 1e-6, zero_params: Sequence[str] = ()) -> None:
        super().__init__(stabilizer, zero_params)
        self.gamma = gamma

    def modifiers(self):
        gamma = self.gamma
        up = ParamModifier(lambda n, p: p + gamma * p.clamp(min=0))
        down = ParamModifier(lambda n, p: p + gamma * p.clamp(max=0))
        return {
            "up": up,
            "down": down,
            "up_nobias": ParamModifier.from_modifiers([up, _ZERO_BIAS]),
            "down_nobias": ParamModifier.from_modifiers([down, _ZERO_BIAS]),
        }

    def rewrite(self, module, registration, inputs, output):
        x = _single_input(self, module, inputs)
        if not x.requires_grad:
            return None
        z_up, z_down = self._signed_forward(module, registration, x, [("up", "down_nobias"), ("down", "up_nobias")])
        z = output.detach()
        scale_up = torch.where(z > 0, z, 0) / stabilize(z_up.detach(), self.stabilizer)
        scale_down = torch.where(z < 0, z, 0) / stabilize(z_down.detach(), self.stabilizer)
        return redirect(output, [z_up, z_down], lambda grad: [grad * scale_up, grad * scale_down])


class _DirectInputRule(_ModifiedForwardRule):
    """Input-layer rules whose relevance is not proportional to the input."""

    def stand_ins(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [torch.ones_like(x)]

    def modified_output(self, module, registration, stand_ins) -> torch.Tensor:
        return self._forward(module, registration, "mod", stand_ins[0])

    def relevance(self, stand_ins, grads) -> torch.Tensor:
        return grads[0]

    def rewrite(self, module, registration, inputs, output):
        x = _single_input(self, module, inputs)
        if not x.requires_grad:
            return None
        values = [s.detach() for s in self.stand_ins(x)]
        proxies = relevance_proxy(
            x, values, lambda grads: self.relevance(values, grads), lambda rest: registration.records.append((x, rest))
        )
        z_mod = self.modified_output(module, registration, proxies)
        scale = output.detach() / stabilize(z_mod.detach(), self.stabilizer)
        return redirect(output, [z_mod], lambda grad: [grad * scale])


class FlatRule(_DirectInputRule):
    """LRP-flat: ``R_i = Σ_j R_j / stabilize(n_j)`` over output ``j``'s receptive field of size ``n_j``.

    Weights set to one, biases to zero and the input to ones; the relevance is
    set directly, so zero-valued inputs get their share.

    Examples:
        >>> lin = nn.Linear(2, 1)
        >>> x = torch.tensor([[0.0, 5.0]], requires_grad=True)
        >>> with FlatRule().register(lin) as handle:
        ...     y = lin(x)
        ...     grad = torch.autograd.grad(y, x, torch.ones_like(y))[0]
        ...     relevance = x * grad + handle.pop_records()[0][1]
        >>> torch.allclose(relevance, y.detach() / 2)
        True
    """

    def modifiers(self):
        return {"mod": ParamModifier.from_modifiers([ParamModifier(lambda n, p: torch.ones_like(p)), _ZERO_BIAS])}


class WSquareRule(_DirectInputRule):
    """LRP-w²: ``R_i = Σ_j w_ij² R_j / stabilize(Σ_i' w_i'j² + b_j²)`` (zennit squares the bias too).

    Examples:
        >>> WSquareRule(stabilizer=1e-3).stabilizer
        0.001
    """

    def modifiers(self):
        return {"mod": ParamModifier(lambda n, p: p**2)}


class ZBoxRule(_DirectInputRule):
    """LRP-z^B for inputs bounded in ``[low, high]``.

    ``z^B_j = Σ_i x_i w_ij - l_i w⁺_ij - h_i w⁻_ij`` (biases cancel) and
    ``R_i = Σ_j (x_i w_ij - l_i w⁺_ij - h_i w⁻_ij) R_j / stabilize(z^B_j)``.

    Args:
        low: lowest input value, a float or a tensor broadcastable to one sample.
        high: highest input value, likewise.

    Examples:
        >>> ZBoxRule(low=-1.0, high=1.0).low
        -1.0
    """

    def __init__(
        self,
        low: float | torch.Tensor,
        high: float | torch.Tensor,
        stabilizer: float = 1e-6,
        zero_params: Sequence[str] = (),
    ) -> None:
        super().__init__(stabilizer, zero_params)
        self.low = low
        self.high = high

    def modifiers(self):
        return {"orig": ParamModifier(), "pos": _clamp(min=0.0), "neg": _clamp(max=0.0)}

    def stand_ins(self, x):
        low = torch.as_tensor(self.low, dtype=x.dtype, device=x.device).expand_as(x)
        high = torch.as_tensor(self.high, dtype=x.dtype, device=x.device).expand_as(x)
        return [x, low, high]

    def modified_output(self, module, registration, stand_ins):
        x, low, high = stand_ins
        return (
            self._forward(module, registration, "orig", x)
            - self._forward(module, registration, "pos", low)
            - self._forward(module, registration, "neg", high)
        )

    def relevance(self, stand_ins, grads):
        return sum(s * g for s, g in zip(stand_ins, grads, strict=True) if g is not None)


# ----------------------------------------------------------------------------- mappers and presets

RuleMapper = Callable[[str, nn.Module], "Rule | None"]

_ACTIVATIONS = (
    nn.ELU,
    nn.Hardshrink,
    nn.Hardsigmoid,
    nn.Hardtanh,
    nn.Hardswish,
    nn.LeakyReLU,
    nn.LogSigmoid,
    nn.PReLU,
    nn.ReLU,
    nn.ReLU6,
    nn.RReLU,
    nn.SELU,
    nn.CELU,
    nn.GELU,
    nn.Sigmoid,
    nn.SiLU,
    nn.Mish,
    nn.Softplus,
    nn.Softshrink,
    nn.Softsign,
    nn.Tanh,
    nn.Tanhshrink,
    nn.Threshold,
)
_AVG_POOLS = (
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)
_GRADIENT_ROUTED = (
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.Dropout,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.AlphaDropout,
    nn.Flatten,
    nn.Unflatten,
    nn.Identity,
)
_CONVOLUTIONS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)
_LINEAR_LAYERS = (*_CONVOLUTIONS, nn.Linear)


def rule_mapper_from_dict(mapping: Mapping[type | tuple[type, ...] | str, Rule]) -> RuleMapper:
    """A rule mapper from a dict keyed by module type(s) or by name pattern.

    String keys match module names with shell-style wildcards (``"features.*"``);
    type keys match with ``isinstance``. The first matching entry, in the
    dict's order, wins.

    Examples:
        >>> mapper = rule_mapper_from_dict({"head": StopRule(), nn.Linear: EpsilonRule(0.25)})
        >>> mapper("head", nn.Linear(2, 2)), mapper("body.0", nn.Linear(2, 2)), mapper("act", nn.Tanh())
        (StopRule(), EpsilonRule(epsilon=0.25), None)
    """
    entries = list(mapping.items())
    for key, rule in entries:
        if not isinstance(rule, Rule):
            raise TypeError(f"rule mapping entry {key!r} must map to a Rule, got {type(rule).__name__}")

    def mapper(name: str, module: nn.Module) -> Rule | None:
        for key, rule in entries:
            if isinstance(key, str) and fnmatchcase(name, key):
                return rule
            if not isinstance(key, str) and isinstance(module, key):
                return rule
        return None

    return mapper


class BaseRuleMapper:
    """Map ``(name, module)`` to a rule: the user's mapper first, then defaults.

    Defaults: activations → :class:`PassRule`; average pooling → :class:`EpsilonRule`
    with ``stabilizer`` (zennit's ``Norm``); BatchNorm → :class:`PassRule`;
    MaxPool, Dropout, Flatten, Unflatten, Identity → :class:`IgnoreRule`. Other
    modules get no rule (plain gradient). Subclasses add Linear/Conv rules in
    :meth:`layer_rule` and a special first layer in :meth:`first_layer_rule`.

    Args:
        stabilizer: stabilizer of the default rules.
        rule_mapper: ``(name, module) -> Rule | None`` consulted first, or a dict
            for :func:`rule_mapper_from_dict`.

    Examples:
        >>> mapper = BaseRuleMapper(rule_mapper=lambda name, m: StopRule() if name == "head" else None)
        >>> mapper("head", nn.Linear(2, 2)), mapper("act", nn.Tanh()), mapper("fc", nn.Linear(2, 2))
        (StopRule(), PassRule(stabilizer=1e-12), None)
    """

    def __init__(self, stabilizer: float = 1e-6, rule_mapper: RuleMapper | Mapping | None = None) -> None:
        self.stabilizer = stabilizer
        self.rule_mapper = rule_mapper_from_dict(rule_mapper) if isinstance(rule_mapper, Mapping) else rule_mapper
        self._pass = PassRule()
        self._norm = EpsilonRule(epsilon=stabilizer)
        self._ignore = IgnoreRule()

    def __call__(self, name: str, module: nn.Module) -> Rule | None:
        if self.rule_mapper is not None:
            rule = self.rule_mapper(name, module)
            if rule is not None:
                return rule
        return self.layer_rule(name, module) or self.default_rule(name, module)

    def default_rule(self, name: str, module: nn.Module) -> Rule | None:
        """The rule for activations, pooling, norms, dropout and shape modules."""
        if isinstance(module, _ACTIVATIONS) or isinstance(module, _BATCH_NORMS):
            return self._pass
        if isinstance(module, _AVG_POOLS):
            return self._norm
        if isinstance(module, _GRADIENT_ROUTED):
            return self._ignore
        return None

    def layer_rule(self, name: str, module: nn.Module) -> Rule | None:
        """The rule for Linear and convolution layers (none here: LRP-0)."""
        return None

    def first_layer_rule(self, name: str, module: nn.Module) -> Rule | None:
        """The rule for the first Linear or convolution layer, when it differs from the others."""
        return None

    def rules(self, model: nn.Module) -> dict[str, Rule]:
        """The rule of every module of ``model`` that has one, by module name."""
        rules: dict[str, Rule] = {}
        first = next((m for _, m in model.named_modules() if isinstance(m, _LINEAR_LAYERS)), None)
        for name, module in model.named_modules():
            rule = None
            if self.rule_mapper is not None:
                rule = self.rule_mapper(name, module)
            if rule is None and module is first:
                rule = self.first_layer_rule(name, module)
            if rule is None:
                rule = self.layer_rule(name, module) or self.default_rule(name, module)
            if rule is not None:
                rules[name] = rule
        return rules


class EpsilonPlus(BaseRuleMapper):
    """z⁺ on convolutions, ε on dense layers (zennit's ``EpsilonPlus``).

    Examples:
        >>> mapper = EpsilonPlus(epsilon=1e-3)
        >>> mapper("conv", nn.Conv2d(1, 1, 3)), mapper("fc", nn.Linear(2, 2))
        (AlphaBetaRule(stabilizer=1e-06, zero_params=(), alpha=1.0, beta=0.0), EpsilonRule(epsilon=0.001))
    """

    def __init__(
        self, epsilon: float = 1e-6, stabilizer: float = 1e-6, rule_mapper: RuleMapper | Mapping | None = None
    ):
        super().__init__(stabilizer, rule_mapper)
        self.epsilon = epsilon
        self._conv = AlphaBetaRule(alpha=1.0, beta=0.0, stabilizer=stabilizer)
        self._dense = EpsilonRule(epsilon=epsilon)

    def layer_rule(self, name, module):
        if isinstance(module, _CONVOLUTIONS):
            return self._conv
        if isinstance(module, nn.Linear):
            return self._dense
        return None


class EpsilonPlusFlat(EpsilonPlus):
    """:class:`EpsilonPlus` with :class:`FlatRule` on the first layer (zennit's ``EpsilonPlusFlat``).

    Examples:
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> {name: type(rule).__name__ for name, rule in EpsilonPlusFlat().rules(model).items()}
        {'0': 'FlatRule', '1': 'PassRule', '2': 'EpsilonRule'}
    """

    def __init__(
        self, epsilon: float = 1e-6, stabilizer: float = 1e-6, rule_mapper: RuleMapper | Mapping | None = None
    ):
        super().__init__(epsilon, stabilizer, rule_mapper)
        self._first = FlatRule(stabilizer=stabilizer)

    def first_layer_rule(self, name, module):
        return self._first


class EpsilonAlpha2Beta1(BaseRuleMapper):
    """αβ with ``α = 2, β = 1`` on convolutions, ε on dense layers (zennit's ``EpsilonAlpha2Beta1``).

    Examples:
        >>> EpsilonAlpha2Beta1()("conv", nn.Conv1d(1, 1, 3)).alpha
        2.0
    """

    def __init__(
        self, epsilon: float = 1e-6, stabilizer: float = 1e-6, rule_mapper: RuleMapper | Mapping | None = None
    ):
        super().__init__(stabilizer, rule_mapper)
        self.epsilon = epsilon
        self._conv = AlphaBetaRule(alpha=2.0, beta=1.0, stabilizer=stabilizer)
        self._dense = EpsilonRule(epsilon=epsilon)

    layer_rule = EpsilonPlus.layer_rule


class EpsilonAlpha2Beta1Flat(EpsilonAlpha2Beta1):
    """:class:`EpsilonAlpha2Beta1` with :class:`FlatRule` on the first layer.

    Examples:
        >>> model = nn.Sequential(nn.Conv1d(1, 2, 3), nn.ReLU(), nn.Conv1d(2, 1, 3))
        >>> [type(r).__name__ for r in EpsilonAlpha2Beta1Flat().rules(model).values()]
        ['FlatRule', 'PassRule', 'AlphaBetaRule']
    """

    def __init__(
        self, epsilon: float = 1e-6, stabilizer: float = 1e-6, rule_mapper: RuleMapper | Mapping | None = None
    ):
        super().__init__(epsilon, stabilizer, rule_mapper)
        self._first = FlatRule(stabilizer=stabilizer)

    first_layer_rule = EpsilonPlusFlat.first_layer_rule


class EpsilonGammaBox(BaseRuleMapper):
    """z^B on the first convolution, γ on the others, ε on dense layers (zennit's ``EpsilonGammaBox``).

    Args:
        low: lowest input value (float or tensor broadcastable to one sample).
        high: highest input value.
        epsilon: ε of the dense layers.
        gamma: γ of the convolutions.
        stabilizer: stabilizer of the other rules.

    Examples:
        >>> model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3), nn.Flatten(), nn.LazyLinear(2))
        >>> [type(r).__name__ for r in EpsilonGammaBox(-3.0, 3.0).rules(model).values()]
        ['ZBoxRule', 'PassRule', 'GammaRule', 'IgnoreRule', 'EpsilonRule']
    """

    def __init__(
        self,
        low: float | torch.Tensor,
        high: float | torch.Tensor,
        epsilon: float = 1e-6,
        gamma: float = 0.25,
        stabilizer: float = 1e-6,
        rule_mapper: RuleMapper | Mapping | None = None,
    ):
        super().__init__(stabilizer, rule_mapper)
        self.epsilon = epsilon
        self._conv = GammaRule(gamma=gamma, stabilizer=stabilizer)
        self._dense = EpsilonRule(epsilon=epsilon)
        self._first = ZBoxRule(low, high, stabilizer=stabilizer)

    layer_rule = EpsilonPlus.layer_rule

    def first_layer_rule(self, name, module):
        return self._first if isinstance(module, _CONVOLUTIONS) else None


# ----------------------------------------------------------------------------- checks


def raise_for_unconserved_rel_factory(
    atol: float = 1e-6, rtol: float = 1e-6
) -> Callable[[str, nn.Module, torch.Tensor, torch.Tensor], None]:
    """A layer check that raises where relevance is lost, created, NaN or infinite.

    The check compares the total relevance entering a module (its output's)
    with the total leaving it (its input's). Pass it as ``LRP(...,
    relevance_check=...)``. Biases and ε absorb relevance, so use it with
    zero biases and a small ε, or loose tolerances.

    Examples:
        >>> check = raise_for_unconserved_rel_factory(atol=1e-3)
        >>> check("fc", nn.Linear(2, 2), torch.tensor([0.5, 0.5]), torch.tensor([1.0]))
        >>> check("fc", nn.Linear(2, 2), torch.tensor([0.5, 0.0]), torch.tensor([1.0]))
        Traceback (most recent call last):
        ...
        ValueError: relevance is not conserved at module 'fc' (Linear): input sum 0.5, output sum 1
    """

    def check(name: str, module: nn.Module, relevance_in: torch.Tensor, relevance_out: torch.Tensor) -> None:
        kind = type(module).__name__
        for label, rel in (("input", relevance_in), ("output", relevance_out)):
            if not torch.isfinite(rel).all():
                raise ValueError(f"{label} relevance of module {name!r} ({kind}) has NaN or inf values")
        total_in, total_out = relevance_in.sum().item(), relevance_out.sum().item()
        if abs(total_in - total_out) > atol + rtol * abs(total_out):
            raise ValueError(
                f"relevance is not conserved at module {name!r} ({kind}): "
                f"input sum {total_in:.6g}, output sum {total_out:.6g}"
            )

    return check
